"""The planner's speed goal of the benchmark, on hand-made results (no runs)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.benchmark.auto import AutoChoice
from pipeline.benchmark.config import BenchCase
from pipeline.benchmark.goals import auto_speed_goal
from spectr.planner.choose import Candidate


@dataclass
class Result:
    case: BenchCase
    tokens_per_second: float
    auto: AutoChoice | None = None
    speedup_vs_autoregressive: float | None = None
    ok: bool = True


@dataclass
class Report:
    results: list


def report_with(auto_candidate: Candidate, auto_tps: float, ar_tps=100.0, spec_tps=90.0) -> Report:
    choice = AutoChoice(auto_candidate, auto_tps, 1.0, 1.0, "auto chose ...")
    return Report([
        Result(BenchCase("autoregressive", 8), ar_tps),
        Result(BenchCase("speculative", 8, 1, 2), spec_tps),
        Result(BenchCase("auto", 8), auto_tps, choice, auto_tps / ar_tps),
    ])


def test_auto_below_the_best_fixed_or_autoregressive_misses():
    goal = auto_speed_goal(report_with(Candidate("speculative", 1, 2), 90.0))
    assert goal.status == "MISS" and "0.90x the best fixed" in goal.detail


def test_auto_running_the_comparators_own_configuration_meets_it_by_identity():
    # auto chose autoregressive, whose own run measured 2% faster: one configuration timed twice
    goal = auto_speed_goal(report_with(Candidate("autoregressive"), 98.0))
    assert goal.status == "PASS" and "run-to-run noise" in goal.detail
    # a different configuration within the noise of autoregressive is still below it
    assert auto_speed_goal(report_with(Candidate("speculative", 1, 2), 98.0, spec_tps=98.0)).status == "MISS"
    assert auto_speed_goal(report_with(Candidate("speculative", 1, 2), 101.0, spec_tps=90.0)).status == "PASS"
