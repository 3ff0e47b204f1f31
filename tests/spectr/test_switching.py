"""Per-iteration configurations on one ContinuousBatcher: labels, bounds, what a step reports, and the
draft cache catching up after autoregressive iterations in ONE forward (counted), to exactly the
entries a fresh prefill writes (a catch-up that skips the forward is caught). The output law under
switching is tested in test_exactness_e2e.py (chi-square) and test_sequence_exact.py (enumeration)."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import noisy_copy, tiny_model

from spectr.batching import ContinuousBatcher
from spectr.drafting import TreeDrafter
from spectr.hf import HFCausalLM
from spectr.rows import prefill
from spectr.steps import StepConfig

AR = StepConfig.of("autoregressive")


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(vocab_size=64, init_std=0.2, seed=3, max_positions=128)
    return target, noisy_copy(target, noise_std=0.08, seed=4)


@pytest.mark.parametrize("label", ["autoregressive", "speculative L=3", "block L=3", "spectr K=4 L=3",
                                   "specinfer K=2 L=2"])
def test_labels_parse_back_and_round_trip_through_json_dicts(label):
    config = StepConfig.parse(label)
    assert config.label == label == str(config)
    assert StepConfig.from_dict(config.to_dict()) == config


def test_configs_have_one_normal_form_and_bad_labels_are_refused():
    assert StepConfig.of("speculative", 4, 3) == StepConfig.parse("speculative L=3")  # one draft
    assert StepConfig.of("autoregressive", 4, 3) == AR and AR.num_drafts == AR.draft_length == 0
    for bad in ("spectr L=3", "speculative K=2 L=3", "beam K=2 L=2", "block"):
        with pytest.raises(ValueError):
            StepConfig.parse(bad)


def test_a_step_outside_the_bounds_or_without_a_draft_is_refused(pair):
    batcher = ContinuousBatcher(*pair, batch_size=2, max_length=32, method="speculative", num_drafts=1,
                                draft_length=2, max_num_drafts=2, max_draft_length=3)
    assert batcher.config == StepConfig.parse("speculative L=2") and batcher.bounds == (2, 3)
    batcher.admit([[1, 2, 3]], max_new_tokens=4)
    with pytest.raises(ValueError, match="K <= 2, L <= 3"):
        batcher.step(StepConfig.of("spectr", 4, 2))
    with pytest.raises(ValueError, match="L <= 3"):
        batcher.step(StepConfig.of("block", 1, 4))
    plain = ContinuousBatcher(pair[0], None, batch_size=2, max_length=32, method="autoregressive")
    plain.admit([[1, 2, 3]], max_new_tokens=4)
    with pytest.raises(ValueError, match="draft model absent"):
        plain.step(StepConfig.of("speculative", 1, 1))


def test_greedy_runs_every_speculative_config_with_one_draft(pair):
    batcher = ContinuousBatcher(*pair, batch_size=2, max_length=32, method="spectr", num_drafts=3,
                                draft_length=2, temperature=0.0)
    assert batcher.check_config(StepConfig.of("spectr", 3, 2)) == StepConfig("spectr", 1, 2)


def test_step_reports_count_every_committed_token_and_the_live_rows(pair):
    schedule = [AR, StepConfig.of("spectr", 3, 2), StepConfig.of("speculative", 1, 3), AR, AR,
                StepConfig.of("block", 1, 2)]
    batcher = ContinuousBatcher(*pair, batch_size=3, max_length=48, method="autoregressive", max_num_drafts=3,
                                max_draft_length=3)
    budgets = [5, 17, 9, 12, 3, 20, 7]
    batcher.admit([[1 + i, 2, 3] for i in range(len(budgets))], max_new_tokens=budgets, seed=7)
    reports, rows = [], []
    while not batcher.idle:
        rows += batcher.step(schedule[len(reports) % len(schedule)])
        reports.append(batcher.last_step)
    assert sum(r.tokens for r in reports) == sum(budgets) == sum(len(r.tokens) for r in rows)
    assert [r.config for r in reports] == [schedule[i % len(schedule)] for i in range(len(reports))]
    assert all(1 <= r.rows <= 3 and r.seconds > 0 for r in reports)
    assert sum(r.finished for r in reports) == len(budgets)
    assert all(r.tokens == r.rows for r in reports if r.config == AR and not r.finished)
    assert sum(r.accepted for r in reports) == sum(sum(row.accepted_per_position) for row in rows)
    assert sum(r.tested for r in reports) == sum(row.tested_positions for row in rows)


def count_draft_forwards(batcher, monkeypatch) -> list[int]:
    calls = []
    forward = batcher.draft.forward
    monkeypatch.setattr(batcher.draft, "forward", lambda *a, **k: calls.append(a[0].shape[1]) or forward(*a, **k))
    return calls


def fresh_draft_keys(draft_model, sequence: list[int], length: int) -> torch.Tensor:
    """Layer-0 keys of the first `length` tokens of `sequence`, from a fresh prefill: [H, length, D]."""
    draft = HFCausalLM(draft_model, role="draft")
    cache = draft.new_cache(1, len(sequence) + 8)
    prefill(draft, cache, [sequence[: length + 1]], torch.device("cpu"))
    return cache.rows.committed(0, 0)[0]


def run_ar_then_speculative(pair, monkeypatch, autoregressive_iterations: int):
    batcher = ContinuousBatcher(*pair, batch_size=2, max_length=64, method="autoregressive", max_num_drafts=2,
                                max_draft_length=3)
    prompts = [[5, 6, 7, 8], [9, 10]]
    batcher.admit(prompts, max_new_tokens=40, seed=3)
    batcher.fill()
    calls = count_draft_forwards(batcher, monkeypatch)
    for _ in range(autoregressive_iterations):
        batcher.step(AR)
    assert calls == []  # autoregressive iterations never run the draft
    batcher.step(StepConfig.of("spectr", 2, 3))
    return batcher, prompts, calls


def test_after_autoregressive_iterations_the_draft_catches_up_in_one_forward_to_a_fresh_prefill(pair, monkeypatch):
    batcher, prompts, calls = run_ar_then_speculative(pair, monkeypatch, 7)
    # one catch-up forward over (up to 2 pending + 7 missing - 1) tokens, then the L = 3 drafting forwards
    assert len(calls) == 1 + 3 and calls[0] == 1 + 7 and batcher.stats.draft_catch_ups == 1
    tokens = batcher.records.tokens.tolist()
    lengths = batcher.records.lengths.tolist()
    draft_cache = batcher.rows.drafter.cache.rows
    for slot, prompt in enumerate(prompts):
        sequence = prompt + tokens[slot][: lengths[slot]]
        length = int(draft_cache.lengths[slot])
        assert length >= len(prompt) - 1 + 7  # the 7 autoregressive tokens are in the draft cache
        keys = draft_cache.committed(0, slot)[0]  # [H, length, D]
        torch.testing.assert_close(keys, fresh_draft_keys(pair[1], sequence, length), atol=1e-5, rtol=1e-4)
    batcher.step(StepConfig.of("speculative", 1, 2))
    assert len(calls) == 4 + 2  # in sync now: no catch-up before the next speculative iteration


def test_negative_control_a_catch_up_that_skips_the_forward_is_caught(pair, monkeypatch):
    def skip_forward(self, recent, lag, view_length):  # broken: pending moves on, the cache never sees the tokens
        self.cache.rows.advance(torch.where(lag > 0, self.num_pending + lag - 1, 0))
        self.pending[:, 0] = torch.where(lag > 0, recent[:, -1], self.pending[:, 0])
        self.num_pending = torch.where(lag > 0, 1, self.num_pending)

    monkeypatch.setattr(TreeDrafter, "catch_up", skip_forward)
    batcher, prompts, _ = run_ar_then_speculative(pair, monkeypatch, 7)
    tokens, lengths = batcher.records.tokens.tolist(), batcher.records.lengths.tolist()
    draft_cache = batcher.rows.drafter.cache.rows
    sequence = prompts[0] + tokens[0][: lengths[0]]
    length = int(draft_cache.lengths[0])
    with pytest.raises(AssertionError):
        torch.testing.assert_close(draft_cache.committed(0, 0)[0], fresh_draft_keys(pair[1], sequence, length),
                                   atol=1e-5, rtol=1e-4)
