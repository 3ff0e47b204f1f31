"""The planner in the benchmark: `auto` calibrates at each batch size, and its choice is timed like the rest.

For each batch size with an `auto` configuration, `plan_auto` runs `spectr.planner.auto.auto_planner` on
the pair, with the grid's bounds on K and L and that batch size's first prompt batch, before any timed
run; the calibration's seconds are reported, not timed as generation. The timed runs of `auto` then
generate with the chosen method, K and L (`pipeline.benchmark.methods`), so its tokens/s is what the
generation job's default would reach, and it sits next to every fixed configuration of the grid.

Not here: the goals on it (`pipeline.benchmark.goals`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.benchmark.config import AUTO, BenchCase, BenchConfig
from spectr.planner.auto import auto_planner
from spectr.planner.choose import Candidate
from spectr.warps import SamplingWarp


@dataclass(frozen=True)
class AutoChoice:
    """What the planner chose at one batch size, what it predicted, and what calibrating cost."""

    candidate: Candidate
    predicted_tokens_per_second: float
    predicted_speedup: float
    calibration_seconds: float
    description: str
    calibration_split: str = ""  # "cost model X s, acceptance Y s, whole iterations Z s"


def plan_auto(config: BenchConfig, pair, cases: list[BenchCase], batches_of) -> dict[int, AutoChoice]:
    """batch size -> the planner's choice, for every `auto` configuration of the grid."""
    g = config.bench
    warp = SamplingWarp(g.temperature, g.top_k, g.top_p)
    choices = {}
    for case in cases:
        if case.method != AUTO or case.batch_size in choices:
            continue
        planner, calibration = auto_planner(
            pair.target,
            pair.draft,
            batches_of(case)[0],
            batch_size=case.batch_size,
            warp=warp,
            seed=g.seed,
            max_num_drafts=max(g.num_drafts),
            max_draft_length=max(g.draft_lengths),
            max_new_tokens=g.max_new_tokens,
        )
        best = planner.plan.best
        choices[case.batch_size] = AutoChoice(
            best.candidate, best.tokens_per_second, planner.plan.speedup, calibration.seconds,
            planner.plan.describe(),
            f"cost model {calibration.cost_seconds:.1f} s, acceptance {calibration.acceptance_seconds:.1f} s, "
            f"whole iterations {calibration.engine_seconds:.1f} s",
        )
    return choices
