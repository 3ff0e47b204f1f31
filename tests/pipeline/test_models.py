"""Model-directory and tokenizer checks: missing dirs, pickle weights, different tokenizers, chat mode."""

from __future__ import annotations

import shutil

import pytest
from tiny_pair_support import WORDS, build_tokenizer

from pipeline import models
from pipeline.config import DataConfig
from pipeline.errors import JobInputError


def test_model_dir_checks(tiny_pair, tmp_path):
    assert models.check_model_dir(str(tiny_pair["target"]), "model.target", allow_pickle=False).is_dir()
    with pytest.raises(JobInputError, match="model.target: no such model directory: .*missing"):
        models.check_model_dir(str(tmp_path / "missing"), "model.target", allow_pickle=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(JobInputError, match="model.draft: .*has no config.json"):
        models.check_model_dir(str(tmp_path / "empty"), "model.draft", allow_pickle=False)


def test_pickle_weights_are_refused_unless_allowed(tiny_pair, tmp_path):
    import torch
    from safetensors.torch import load_file

    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_pair["draft"], pickled)
    (pickled / "model.safetensors").unlink()
    torch.save(load_file(str(tiny_pair["draft"] / "model.safetensors")), pickled / "pytorch_model.bin")
    with pytest.raises(
        JobInputError, match=r"only pickle-format weights \(pytorch_model.bin\).*model.allow_pickle=true"
    ):
        models.check_model_dir(str(pickled), "model.draft", allow_pickle=False)
    assert models.check_model_dir(str(pickled), "model.draft", allow_pickle=True) == pickled


def test_identical_tokenizers_pass_and_different_ones_are_described(tiny_pair, tmp_path):
    target = models.load_tokenizer(tiny_pair["target"], "model.target", False)
    draft = models.load_tokenizer(tiny_pair["draft"], "model.draft", False)
    assert models.tokenizer_differences(target, draft) == []
    models.check_same_tokenizer(target, draft, tiny_pair["target"], tiny_pair["draft"])

    other_words = build_tokenizer(list(reversed(WORDS)), tmp_path / "reordered")
    differences = models.tokenizer_differences(target, other_words)
    assert any("with different ids" in d for d in differences)
    with pytest.raises(
        JobInputError, match="model.draft: the draft tokenizer .* differs from the target tokenizer"
    ):
        models.check_same_tokenizer(target, other_words, tiny_pair["target"], tmp_path / "reordered")

    # same vocabulary, different pre-tokenization: still a different tokenizer
    from tokenizers import pre_tokenizers

    same_vocab = build_tokenizer(WORDS + ["user", "assistant", ":"], tmp_path / "same_vocab")
    same_vocab.backend_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assert models.tokenizer_differences(target, same_vocab) == ["pre_tokenizer differs"]


def test_chat_template_rendering(tiny_pair, tmp_path):
    tokenizer = models.load_tokenizer(tiny_pair["target"], "model.target", False)
    chat = DataConfig(path="x", chat=True)
    texts = models.render_prompts(tokenizer, chat, None, [[{"role": "user", "content": "def x"}]])
    assert texts == ["user : def x assistant :"]
    plain = build_tokenizer(WORDS, tmp_path / "plain")
    with pytest.raises(JobInputError, match="data.chat: chat mode needs a chat template"):
        models.render_prompts(plain, chat, None, [[{"role": "user", "content": "x"}]])
    ids = models.tokenize(tokenizer, texts, add_special_tokens=False)
    assert tokenizer.decode(ids[0]) == texts[0]


def test_every_eos_id_of_the_generation_config_is_passed_on():
    from types import SimpleNamespace

    tokenizer = SimpleNamespace(eos_token_id=7)
    with_list = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[2, 5, 2]))
    assert models.eos_token_ids_of(with_list, tokenizer) == [2, 5]
    single = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=3))
    assert models.eos_token_ids_of(single, tokenizer) == [3]
    none = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None))
    assert models.eos_token_ids_of(none, tokenizer) == [7]
    assert models.eos_token_ids_of(none, SimpleNamespace(eos_token_id=None)) == []


def test_dtype_auto_is_bfloat16_on_cuda_and_float32_on_cpu():
    import torch

    assert models.resolve_dtype("auto", "cpu") is torch.float32
    assert models.resolve_dtype("auto", "cuda", bf16_supported=True) is torch.bfloat16
    assert models.resolve_dtype("auto", "cuda:1", bf16_supported=False) is torch.float16
    assert models.resolve_dtype("bfloat16", "cpu") is torch.bfloat16


def test_the_target_plan_and_what_the_loader_does_with_it(tiny_pair):
    """model.device_map=auto: the plan from the target's config (only with > 1 GPU), and the loader placing the
    target by it (GPU n -> the CPU here): the map is recorded, the layers form one group per GPU, same logits."""
    import torch

    from pipeline.config import ModelConfig
    from pipeline.placement import placement_plan
    from spectr.split import layer_groups

    auto = ModelConfig(target=str(tiny_pair["target"]), draft=str(tiny_pair["draft"]), device_map="auto")
    assert models.target_plan(auto.target, auto, gpus=1) is None
    assert models.target_plan(auto.target, ModelConfig(target=auto.target, draft=auto.draft), gpus=2) is None
    plan = models.target_plan(auto.target, auto, gpus=2)
    assert plan == placement_plan(2, [0, 1]) and plan["model.layers.0"] == 0 and plan["model.layers.1"] == 1
    split = models.load_model(auto.target, auto, "cpu", plan=plan, devices={0: "cpu", 1: "cpu"})
    whole = models.load_model(auto.target, auto, "cpu")
    assert split.hf_device_map == plan and not hasattr(whole, "hf_device_map")
    assert layer_groups(split, 2) == ((0, 1, torch.device("cpu")), (1, 2, torch.device("cpu")))
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(split(ids).logits, whole(ids).logits)
    tied = placement_plan(4, [0, 1], tied_head=True)  # the head IS the embedding: it stays on the first GPU
    assert tied["lm_head"] == tied["model.embed_tokens"] == 0 and tied["model.norm"] == 1
