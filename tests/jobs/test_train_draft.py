"""The train_draft job: the smoke config end to end on a tiny target, its negative control, resume, refusals.

The target is a tiny one-layer Llama with a sharpened head (its next-token law depends on the context, mostly
the last token, and is far from uniform), so that what the draft learns is measurable in seconds. The real
Hydra config is composed (conf/train_draft_smoke.yaml), as the command line would.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from tiny_pair_support import WORDS, build_tokenizer

from jobs.train_draft import run, summary_line
from pipeline.config import ModelConfig
from pipeline.distillation import distillation_loss, per_position_divergence
from pipeline.errors import JobInputError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


@pytest.fixture(scope="module")
def sharp_target(tmp_path_factory) -> dict[str, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("train_draft")
    tokenizer = build_tokenizer(WORDS, root / "target")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=2, pad_token_id=3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(100.0)  # a peaked law, far from uniform
    model.save_pretrained(root / "target")
    rng = random.Random(0)
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(64):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))
            f.write(json.dumps({"id": f"p{i}", "prompt": words}) + "\n")
    return {"target": root / "target", "prompts": root / "prompts.jsonl"}


def compose_config(sharp_target, out: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train_draft_smoke", overrides=[
            f"model.target={sharp_target['target']}", f"data.path={sharp_target['prompts']}", f"out={out}",
            "draft.kind=model", *overrides])


def test_smoke_trains_a_draft_the_generate_job_loads_and_the_engine_runs(sharp_target, tmp_path):
    import spectr
    from pipeline.models import check_pair, load_model

    out = tmp_path / "draft"
    cfg = compose_config(sharp_target, out)
    result = run(cfg)
    assert result.steps == cfg.train.steps and result.stopped_by == "steps"
    assert result.history[-1][1] < result.history[0][1], "the distillation loss goes down"
    assert result.acceptance > 0.6 and result.heldout_positions > 0
    line = summary_line(result, str(sharp_target["target"]))
    assert f"model.draft={out}" in line and "acceptance" in line and "parameters" in line

    pair = ModelConfig(target=str(sharp_target["target"]), draft=str(out), dtype="float32")
    check_pair(pair)  # same vocabulary, identical tokenizers: what jobs.generate checks before it starts
    target = load_model(pair.target, pair, "cpu")
    draft = load_model(pair.draft, pair, "cpu")
    assert draft.config.vocab_size == target.config.vocab_size
    output = spectr.generate(target, draft, [[1, 5, 6, 7], [1, 8]], method="speculative", draft_length=3,
                             max_new_tokens=8, eos_token_id=2)
    assert all(0 < len(tokens) <= 8 for tokens in output.tokens)
    assert output.stats.block_efficiency > 1.0, "the draft's tokens are accepted"

    # resumed: a second run on the same directory with more steps continues from the checkpoint
    more = run(compose_config(sharp_target, out, f"train.steps={cfg.train.steps + 5}"))
    assert more.steps == cfg.train.steps + 5 and len(more.history) == 5


def test_shuffled_targets_are_a_negative_control(sharp_target, tmp_path):
    """Same steps, the target laws permuted across positions: the draft cannot learn the target."""
    normal = run(compose_config(sharp_target, tmp_path / "normal", "train.loss=tv"))
    shuffled = run(compose_config(sharp_target, tmp_path / "shuffled", "train.loss=tv", "train.shuffle_targets=true"))
    assert normal.steps == shuffled.steps
    assert normal.acceptance > shuffled.acceptance + 0.3, (normal.acceptance, shuffled.acceptance)


def test_an_output_directory_holding_something_else_is_refused(sharp_target, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(JobInputError, match="holds something else"):
        run(compose_config(sharp_target, out))
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_another_run_in_the_output_directory_is_refused(sharp_target, tmp_path):
    out = tmp_path / "draft"
    first = run(compose_config(sharp_target, out, "train.steps=2"))
    assert first.train_sequences == 2 * 4, "only the prompts 2 steps of 4 sequences draw are completed"
    capped = run(compose_config(sharp_target, tmp_path / "capped", "train.steps=2", "train.sequences=5"))
    assert capped.train_sequences == 5
    with pytest.raises(JobInputError, match="another target, data, draft or loss"):
        run(compose_config(sharp_target, out, "train.loss=tv"))


def test_an_architecture_the_engine_does_not_run_is_refused(sharp_target, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    target = tmp_path / "gpt2"
    tokenizer = build_tokenizer(WORDS, target)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, n_positions=64)
                    ).save_pretrained(target)
    with pytest.raises(JobInputError, match="does not run this architecture"):
        run(compose_config(sharp_target, tmp_path / "out", f"model.target={target}"))
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_that_cannot_be_saved_is_refused(tmp_path):
    from pipeline.train_draft.draft_model import check_tokenizer_saves

    class Unsavable:
        def save_pretrained(self, folder):
            raise NotImplementedError("no files for this tokenizer")

    with pytest.raises(JobInputError, match="cannot be saved with the draft"):
        check_tokenizer_saves(Unsavable(), tmp_path)


@pytest.mark.parametrize("override, message", [("train.loss=reverse_kl", "train.loss"),
                                               ("+train.stepz=3", "unknown keys"),
                                               ("train.batch_size=0", "train.batch_size")])
def test_bad_config_is_refused_before_anything_is_written(sharp_target, tmp_path, override, message):
    with pytest.raises(JobInputError, match=message):
        run(compose_config(sharp_target, tmp_path / "out", override))
    assert not (tmp_path / "out").exists()


def test_the_losses_are_the_forward_kl_and_one_minus_acceptance():
    generator = torch.Generator().manual_seed(0)
    draft_logits = torch.randn(2, 3, 7, generator=generator)  # [B, T, V]
    target_logits = 3 * torch.randn(2, 3, 7, generator=generator)  # [B, T, V]
    p, q = draft_logits.softmax(-1), target_logits.softmax(-1)
    kl = (q * (q.log() - p.log())).sum(-1)  # [B, T]
    tv = 1 - torch.minimum(p, q).sum(-1)  # [B, T]
    logp, logq = draft_logits.log_softmax(-1), target_logits.log_softmax(-1)
    torch.testing.assert_close(per_position_divergence(logp, logq, "forward_kl"), kl)
    torch.testing.assert_close(per_position_divergence(logp, logq, "tv"), tv)
    mask = torch.tensor([[True, False, True], [False, False, True]])
    torch.testing.assert_close(distillation_loss(draft_logits, target_logits, "tv", mask), tv[mask].mean())
    torch.testing.assert_close(distillation_loss(draft_logits, target_logits, "forward_kl"), kl.mean())


def test_the_kept_laws_are_the_targets_full_laws_in_the_loss_masks_order(sharp_target):
    """One pass of the target keeps, per completion position, its whole next-token law (float16); a batch's
    rows come back in the order the loss mask selects the positions, so the steps need no target pass."""
    from transformers import AutoModelForCausalLM

    from pipeline.train_draft.completions import Sequences, padded_batch, target_laws

    target = AutoModelForCausalLM.from_pretrained(sharp_target["target"], dtype=torch.float32).eval()
    sequences = Sequences([[1, 5, 6, 7, 8], [1, 9, 10], [1, 4, 5, 6, 7, 8, 9], [1, 5, 2]], [2, 2, 4, 3])
    laws = target_laws(target, sequences, temperature=0.7, pad_id=3, device="cpu", batch_size=3)
    assert laws.log_probs.shape == (sequences.completion_tokens(), target.config.vocab_size)
    assert laws.log_probs.dtype == torch.float16
    rows = [2, 0, 2, 3]  # repeated and out of order, as the sampler draws them
    inputs, attention, mask = padded_batch(sequences, rows, pad_id=3)
    with torch.no_grad():
        expected = torch.log_softmax(target(input_ids=inputs, attention_mask=attention).logits[mask] / 0.7, dim=-1)
    kept = laws.rows_of(rows).float()
    assert kept.shape == expected.shape
    torch.testing.assert_close(kept.exp(), expected.exp(), atol=2e-3, rtol=1e-2)


def test_steps_without_kept_laws_run_the_target_and_learn_the_same(sharp_target, tmp_path, monkeypatch):
    """With the laws kept the steps never run the target; train.law_cache_gib=0: the target runs at every
    step instead; same data, same first loss."""
    from pipeline.train_draft import training

    target_passes = []  # per run: the target's forward calls during the training loop
    loop = training._train_model

    def counted_loop(config, folder, target, *args):
        count = [0]
        handle = target.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
        try:
            return loop(config, folder, target, *args)
        finally:
            handle.remove()
            target_passes.append(count[0])

    monkeypatch.setattr(training, "_train_model", counted_loop)
    kept = run(compose_config(sharp_target, tmp_path / "kept", "train.steps=3"))
    rerun = run(compose_config(sharp_target, tmp_path / "rerun", "train.steps=3", "train.law_cache_gib=0"))
    assert target_passes == [0, 3]
    assert kept.history[0][1] == pytest.approx(rerun.history[0][1], rel=1e-3)


def test_the_steps_draw_every_sequence_once_per_pass_and_resume_where_they_stopped():
    from pipeline.train_draft.training import batch_rows

    draws = [row for step in range(10) for row in batch_rows(7, 3, step, seed=5)]  # 30 draws over 7 sequences
    for first in range(0, 28, 7):
        assert sorted(draws[first: first + 7]) == list(range(7)), draws
    assert draws[:7] != draws[7:14], "each pass in another order"
    assert batch_rows(7, 3, 4, seed=5) == draws[12:15], "a step's rows depend on the step only (resume)"
    assert batch_rows(7, 3, 0, seed=6) != draws[:3]
