"""Shared fixtures: a tiny random Llama draft/target pair with a tiny tokenizer, and one local Ray.

The pair is built here (no hub, no embedded assets): a WordLevel tokenizer over a few dozen words,
wrapped in `PreTrainedTokenizerFast` and saved with `save_pretrained`, and two random `LlamaForCausalLM`
models (hidden size 32 and 16) saved as safetensors next to it. `max_position_embeddings` is small
(64) so that a long prompt is an easy per-row failure.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORDS = (
    "def return if else for in while import from class self print the a of to and is not none true false "
    "x y z value name list dict data result item key index len range open file line"
).split()
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
TINY_MAX_POSITIONS = 64


def build_tokenizer(words: list[str], directory: Path, chat_template: str | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + list(dict.fromkeys(words)))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    if chat_template:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def build_llama(
    directory: Path,
    vocab_size: int,
    hidden: int,
    layers: int,
    seed: int,
    max_positions: int = TINY_MAX_POSITIONS,
):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(directory))
    return model


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> dict[str, Path]:
    """{'target': dir, 'draft': dir, 'root': dir}: a random Llama pair sharing one tiny tokenizer."""
    root = tmp_path_factory.mktemp("tiny_pair")
    target, draft = root / "target", root / "draft"
    chat = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}"
    tokenizer = build_tokenizer(WORDS + ["user", "assistant", ":"], target, chat_template=chat)
    build_tokenizer(WORDS + ["user", "assistant", ":"], draft, chat_template=chat)
    build_llama(target, len(tokenizer), hidden=32, layers=2, seed=1)
    build_llama(draft, len(tokenizer), hidden=16, layers=1, seed=2)
    return {"root": root, "target": target, "draft": draft}


@pytest.fixture(scope="session")
def prompts_jsonl(tmp_path_factory) -> Path:
    """40 prompts with string ids, as JSONL."""
    import random

    rng = random.Random(0)
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    with open(path, "w") as f:
        for i in range(40):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))
            f.write(json.dumps({"id": f"p{i:03d}", "prompt": words}) + "\n")
    return path


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for the whole session (2 CPUs), shut down at the end."""
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=2, include_dashboard=False, object_store_memory=128 * 1024 * 1024, log_to_driver=False
        )
    yield ray
    ray.shutdown()


def job_config(tiny_pair: dict[str, Path], data_path: Path, output_dir: Path, /, **overrides) -> dict:
    """A plain config dict for the tiny pair (what the YAML would give), with dotted overrides."""
    raw = {
        "model": {"target": str(tiny_pair["target"]), "draft": str(tiny_pair["draft"]), "dtype": "float32"},
        "data": {"path": str(data_path)},
        "spectr": {
            "method": "spectr",
            "num_drafts": 2,
            "draft_length": 3,
            "max_new_tokens": 8,
            "batch_size": 4,
        },
        "ray": {"num_actors": 2, "cpus_per_actor": 1},
        "mlflow": {"enabled": False},
        "output_dir": str(output_dir),
        "shard_size": 8,
        "progress": False,
    }
    for dotted, value in overrides.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return raw
