"""The planner with traversal verification: a candidate like any method (K in {2, 4} at the longest L, never
under greedy decoding), priced with its rejection loop, its tokens per call a lower bound (its own
measured/model ratio), chosen where it is the fastest, and run by the `AutoBatcher` on the engine."""

from __future__ import annotations

import pytest
from hf_tiny import noisy_copy, tiny_model
from test_planner_chooser import ACCEPTANCE, Machine, drive, measured_rate, prior

from spectr.planner import AutoBatcher
from spectr.planner.chooser import OnlineChooser, default_candidates
from spectr.planner.prior import (
    TRAVERSAL_STEP_S,
    TRAVERSAL_VOCAB_S,
    PriorLatencies,
    prior_tokens_per_second,
    reach,
)
from spectr.planner.table import REJECT_ALL
from spectr.steps import StepConfig

TRAVERSAL = StepConfig.parse("traversal K=2 L=4")


def test_traversal_candidates_within_the_bounds_and_not_under_greedy():
    labels = [c.label for c in default_candidates(4, 4) if c.method == "traversal"]
    assert labels == ["traversal K=2 L=4", "traversal K=4 L=4"]  # the longest draft only: where it gains
    assert [c.label for c in default_candidates(2, 3) if c.method == "traversal"] == ["traversal K=2 L=3"]
    assert not any(c.method == "traversal" for c in default_candidates(4, 2))
    assert [c.label for c in default_candidates(8, 8) if c.method == "traversal"] == [
        "traversal K=2 L=4", "traversal K=4 L=4"]  # the job's bounds (8, 8): the candidates stop at L = 4
    assert not any(c.method == "traversal" for c in default_candidates(4, 4, greedy=True))
    assert StepConfig.parse(TRAVERSAL.label) == TRAVERSAL


def test_the_prior_charges_the_rejection_loop_and_counts_tokens_like_spectr():
    latencies = PriorLatencies(34_000_000, 2_500_000, 8192)
    for rows in (1, 8):
        spectr_s = latencies.at(f"selection_spectr_{REJECT_ALL}", rows, (4, 3))
        traversal_s = latencies.at(f"selection_traversal_{REJECT_ALL}", rows, (4, 3))
        assert traversal_s - spectr_s == pytest.approx(12 * (TRAVERSAL_STEP_S + TRAVERSAL_VOCAB_S * rows * 8192))
    spectr, traversal = StepConfig.of("spectr", 4, 3), StepConfig.of("traversal", 4, 3)
    assert reach(traversal, 0.6) == reach(spectr, 0.6)  # a lower bound for traversal
    assert prior_tokens_per_second(latencies, traversal, 4, 0.6) < prior_tokens_per_second(latencies, spectr, 4, 0.6)


class TreeMachine(Machine):
    """`Machine` whose traversal iterations draw their tokens as spectr's do (first position tried K times),
    so that a label's rate is the rate its iterations deliver."""

    def accepted(self, config: StepConfig) -> int:
        if config.method != "traversal":
            return super().accepted(config)
        first = 1 - (1 - ACCEPTANCE) ** config.num_drafts
        count = 0
        while count < config.draft_length and self.random.random() < (first if count == 0 else ACCEPTANCE):
            count += 1
        return count


def test_where_traversal_is_the_fastest_the_chooser_settles_on_it():
    """A device where the tree verify is cheap and traversal's longer accepted paths pay (GPU-like rates)."""
    rates = {"autoregressive": 100.0, "speculative L=1": 120.0, "block L=2": 130.0, "block L=3": 138.0,
             "block L=4": 140.0, "spectr K=2 L=4": 150.0, "traversal K=2 L=4": 175.0, "other": 120.0}
    chooser = OnlineChooser(default_candidates(4, 4), prior)
    assert TRAVERSAL in chooser.candidates
    chosen = drive(chooser, TreeMachine(lambda rows: rates, seed=1), [4] * 500)
    late = chosen[250:]
    assert sum(c == TRAVERSAL for c in late) >= 0.85 * len(late)
    assert measured_rate(chooser, 250) >= 0.9 * 175


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(vocab_size=64, init_std=0.2, seed=3, max_positions=128)
    return target, noisy_copy(target, noise_std=0.08, seed=4)


def test_the_auto_batcher_runs_traversal_iterations(pair):
    batcher = AutoBatcher(*pair, batch_size=3, max_length=64, max_num_drafts=2, max_draft_length=3,
                          candidates=[StepConfig.of("autoregressive"), StepConfig.of("traversal", 2, 3)])
    batcher.admit([[1, 2, 3], [4, 5], [6]], max_new_tokens=[20, 9, 14], seed=5, tags=["a", "b", "c"])
    rows = {row.tag: row for row in batcher.finished()}
    assert {tag: len(row.tokens) for tag, row in rows.items()} == {"a": 20, "b": 9, "c": 14}
    tokens = batcher.chooser.tokens_by_config()
    assert tokens.get("traversal K=2 L=3", 0) > 0 and sum(tokens.values()) == 43
