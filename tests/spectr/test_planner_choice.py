"""The planner's choice on synthetic latency tables and acceptance, and re-planning on drift."""

from __future__ import annotations

import pytest
import torch

from spectr.planner.acceptance import AcceptanceModel
from spectr.planner.choose import (
    SELECTION,
    SPECULATION_MARGIN,
    Candidate,
    CostModel,
    EngineTiming,
    Planner,
    bounded,
    default_candidates,
    make_plan,
)
from spectr.planner.table import COMMIT, DRAFT, DRAFT_SAMPLE, TARGET, LatencyTable
from spectr.selection import kseq_acceptance

WIDTHS = (1, 2, 4, 8, 16, 33, 65)


def synthetic_table(target_seconds, draft_seconds, batches=(1, 8), overhead=1e-5) -> LatencyTable:
    """A table from two functions of (batch, tokens per row), plus small per-iteration overheads."""
    table = LatencyTable()
    for b in batches:
        for w in WIDTHS:
            table.add(TARGET, b, (w,), target_seconds(b, w))
            table.add(DRAFT, b, (w,), draft_seconds(b, w))
        for k in (1, 8):
            table.add(DRAFT_SAMPLE, b, (k,), overhead * b * k)
        for length in (0, 8):
            table.add(COMMIT, b, (length,), overhead)
        table.add(f"{SELECTION}_autoregressive", b, (0,), overhead * b)
        for method in ("speculative", "block", "spectr", "specinfer"):
            for nodes in (1, 64):
                table.add(f"{SELECTION}_{method}", b, (nodes,), overhead * b * nodes)
    return table


def constant_acceptance(alpha: float, positions: int = 64) -> AcceptanceModel:
    """Every position accepts one draft with probability alpha; K drafts: 1 - (1 - alpha)^K."""
    single = torch.full((positions,), alpha, dtype=torch.float64)
    first = {
        method: {k: torch.full((positions,), 1 - (1 - alpha) ** k, dtype=torch.float64) for k in (2, 4, 8)}
        for method in ("spectr", "specinfer")
    }
    return AcceptanceModel(single, first, (positions,))


def test_compute_bound_hardware_picks_autoregressive():
    # every token a forward processes costs the same (a CPU, or a GPU at a large batch)
    cost = CostModel(synthetic_table(lambda b, w: 1e-3 * b * w, lambda b, w: 1e-4 * b * w))
    plan = make_plan(default_candidates(), constant_acceptance(0.6), cost, batch=8)
    assert plan.best.candidate == Candidate("autoregressive")
    assert plan.speedup == 1.0
    assert "auto chose autoregressive" in plan.describe()


def test_memory_bound_hardware_with_high_acceptance_picks_a_large_tree():
    # a forward costs the same for 1 or 65 tokens per row (a GPU at a small batch): drafting pays
    cost = CostModel(synthetic_table(lambda b, w: 10e-3, lambda b, w: 0.3e-3))
    plan = make_plan(default_candidates(), constant_acceptance(0.9), cost, batch=1)
    best = plan.best.candidate
    assert best.method != "autoregressive" and best.num_drafts * best.draft_length >= 6, best
    assert plan.speedup > 3.0
    assert plan.best.tokens_per_second == pytest.approx(
        max(e.tokens_per_second for e in plan.entries)
    )


def test_a_speculative_plan_must_beat_autoregressive_by_the_margin():
    candidates = [Candidate("autoregressive"), Candidate("speculative", 1, 2)]
    acceptance = constant_acceptance(0.5)  # 1.75 tokens per call with L = 2
    ar_seconds = 10e-3

    def plan_for(speculative_iteration_seconds, margin=SPECULATION_MARGIN):
        table = synthetic_table(lambda b, w: ar_seconds if w == 1 else speculative_iteration_seconds,
                                lambda b, w: 0.0, overhead=0.0)
        return make_plan(candidates, acceptance, CostModel(table), batch=1, margin=margin)

    # 1.75 tokens in 1.75 / 1.03 of autoregressive's time: predicted 3% faster, inside the margin
    close = plan_for(ar_seconds * 1.75 / 1.03)
    assert close.best.candidate.method == "autoregressive"
    assert close.entries[1].tokens_per_second > close.entries[0].tokens_per_second  # kept, just not chosen
    assert plan_for(ar_seconds * 1.75 / 1.03, margin=0.0).best.candidate.method == "speculative"
    assert plan_for(ar_seconds * 1.75 / 1.20).best.candidate.method == "speculative"  # clearly faster


def test_engine_timings_scale_the_component_model():
    cost = CostModel(synthetic_table(lambda b, w: 1e-3 * w, lambda b, w: 1e-4 * w))
    acceptance = constant_acceptance(0.7)
    measured, sibling = Candidate("speculative", 1, 2), Candidate("speculative", 1, 3)
    spectr = Candidate("spectr", 2, 2)
    reach = tuple(acceptance.reach("speculative", 1, 2))
    base = {c: cost.iteration_seconds(c, 4, acceptance.reach(c.method, c.num_drafts, c.draft_length))
            for c in (measured, sibling, spectr, Candidate("autoregressive"))}
    timings = [EngineTiming(measured, 2.0 * base[measured], 0.01, reach),
               EngineTiming(Candidate("autoregressive"), 1.5 * base[Candidate("autoregressive")], 0.004)]
    scaled = cost.with_engine_timings(timings, batch=4)
    for candidate, factor in ((measured, 2.0), (sibling, 2.0), (spectr, 2.0), (Candidate("autoregressive"), 1.5)):
        reach_c = acceptance.reach(candidate.method, candidate.num_drafts, candidate.draft_length)
        assert scaled.iteration_seconds(candidate, 4, reach_c) == pytest.approx(factor * base[candidate])
    assert scaled.prefill_seconds(measured) == 0.01 and scaled.prefill_seconds(Candidate("autoregressive")) == 0.004
    # with a budget of 20 tokens per row, each iteration also pays for the prefill of the rows it completes
    plain = make_plan([measured], acceptance, scaled, batch=4, margin=0.0).best
    priced = make_plan([measured], acceptance, scaled, batch=4, new_tokens=20, margin=0.0).best
    expected = plain.iteration_seconds + 4 * plain.tokens_per_call / 20 * 0.01
    assert priced.iteration_seconds == pytest.approx(expected)
    assert priced.tokens_per_second < plain.tokens_per_second


def test_time_engine_times_whole_iterations_of_any_candidate():
    from hf_tiny import tiny_model

    from spectr.planner.calibrate import time_engine
    from spectr.warps import SamplingWarp

    target, draft = tiny_model(seed=0), tiny_model(seed=0, num_layers=1)
    for candidate in (Candidate("autoregressive"), Candidate("spectr", 2, 3)):
        timing = time_engine(target, draft, candidate, [[1, 2, 3], [4, 5]], batch=3, warp=SamplingWarp(1.0, 0, 1.0),
                             seed=0, iterations=3)
        assert timing.candidate == candidate
        assert timing.iteration_seconds > 0 and timing.prefill_seconds_per_row > 0
    # a model with few positions: fewer iterations fit, or none (then the component model stands)
    short = tiny_model(seed=0, max_positions=24)
    warp = SamplingWarp(1.0, 0, 1.0)
    assert time_engine(short, draft, Candidate("spectr", 2, 3), [[1, 2, 3]], 2, warp, 0, iterations=5) is not None
    assert time_engine(short, draft, Candidate("spectr", 2, 8), [[1, 2, 3] * 4], 2, warp, 0) is None


def test_single_draft_reach_is_the_closed_form_for_context_free_acceptance():
    alpha = 0.7
    model = constant_acceptance(alpha)
    for length in (1, 2, 4, 8):
        expected = (1 - alpha ** (length + 1)) / (1 - alpha)
        assert model.expected_tokens("speculative", 1, length) == pytest.approx(expected, rel=1e-9)


def test_first_position_of_spectr_uses_the_exact_kseq_acceptance():
    generator = torch.Generator().manual_seed(0)
    p = torch.softmax(2 * torch.randn(40, 12, generator=generator, dtype=torch.float64), -1)
    q = torch.softmax(2 * torch.randn(40, 12, generator=generator, dtype=torch.float64), -1)
    model = AcceptanceModel.from_distributions(p, q, segments=(20, 20), num_drafts=(2, 4))
    reach = model.reach("spectr", 4, 3)
    assert reach[1] == pytest.approx(float(kseq_acceptance(p, q, 4).mean()), rel=1e-9)
    assert reach[0] == 1.0 and reach[1] >= reach[2] >= reach[3]
    # K-SEQ with more drafts accepts at least as often as one draft
    assert model.reach("spectr", 4, 1)[1] >= model.reach("speculative", 1, 1)[1] - 1e-12
    with pytest.raises(ValueError, match="segments sum"):
        AcceptanceModel.from_distributions(p, q, segments=(10,))


def test_calibration_matches_the_measured_tokens_per_call():
    model = constant_acceptance(0.9)
    calls = 100
    accepted = [50, 30, 10, 5]  # 0.95 accepted draft tokens per call measured
    calibrated = model.calibrated("speculative", 1, 4, accepted, calls)
    assert calibrated.expected_tokens("speculative", 1, 4) == pytest.approx(1 + sum(accepted) / calls)
    # one pair, one factor: the other candidates are scaled alike
    ratio = (calibrated.expected_tokens("spectr", 4, 4) - 1) / (model.expected_tokens("spectr", 4, 4) - 1)
    assert ratio == pytest.approx(0.95 / (model.expected_tokens("speculative", 1, 4) - 1))


def test_replans_when_the_measured_acceptance_drifts():
    cost = CostModel(synthetic_table(lambda b, w: 10e-3 + 0.5e-3 * w, lambda b, w: 0.5e-3))
    planner = Planner(default_candidates(), constant_acceptance(0.9), cost, batch=4)
    first = planner.choice
    assert first.method != "autoregressive"
    # the run accepted far less than predicted: almost every call rejects at the first position
    calls = 200
    accepted = [10] + [1] * (first.draft_length - 1)
    assert planner.observe(first, accepted, calls, mean_active_rows=4)
    assert planner.replans == 1
    second = planner.choice
    assert second.num_drafts * second.draft_length < first.num_drafts * first.draft_length or (
        second.method == "autoregressive"
    )
    # a run that matches the plan changes nothing
    entry = planner.plan.entry(second)
    if second.method != "autoregressive":
        matching = [round(calls * r) for r in planner.acceptance.reach(second.method, second.num_drafts,
                                                                         second.draft_length)[1:]]
        assert not planner.observe(second, matching, calls, mean_active_rows=4)
    assert planner.plan.entry(second) == entry


def test_replans_for_the_measured_occupancy():
    cost = CostModel(synthetic_table(lambda b, w: 1e-3 * b * w + 5e-3, lambda b, w: 1e-4 * b * w + 5e-4))
    planner = Planner(default_candidates(), constant_acceptance(0.8), cost, batch=8)
    assert planner.observe(Candidate("autoregressive"), [], 0, mean_active_rows=2.0)
    assert planner.plan.batch == 2.0


def test_candidates_and_bounds():
    candidates = default_candidates(max_num_drafts=4, max_draft_length=3)
    assert Candidate("autoregressive") in candidates
    assert {c.draft_length for c in candidates if c.method != "autoregressive"} == {1, 2, 3}
    assert max(c.num_drafts for c in candidates) == 4
    assert all(c.num_drafts <= 2 and c.draft_length <= 2 for c in bounded(candidates, 2, 2))
    with pytest.raises(ValueError, match="max_num_drafts"):
        default_candidates(max_num_drafts=0)


def test_calibration_on_real_models_prices_every_candidate():
    from hf_tiny import tiny_model

    from spectr.hf import HFCausalLM
    from spectr.planner.calibrate import forward_widths, measure_acceptance, measure_cost_model
    from spectr.warps import SamplingWarp

    target, draft = tiny_model(seed=0), tiny_model(seed=0, num_layers=1)
    candidates = default_candidates(max_num_drafts=4, max_draft_length=3)
    warp = SamplingWarp(1.0, 0, 1.0)
    cost = measure_cost_model(HFCausalLM(target, "target"), HFCausalLM(draft, "draft"), candidates,
                              batch=4, context=16, warp=warp)
    acceptance = measure_acceptance(target, draft, [[1, 2, 3, 4], [5, 6, 7]], 12, warp, seed=0, num_drafts=(2, 4))
    plan = make_plan(candidates, acceptance, cost, batch=4)
    assert len(plan.entries) == len(candidates)
    assert all(e.iteration_seconds > 0 and e.tokens_per_second > 0 for e in plan.entries)
    for c in candidates:
        reach = acceptance.reach(c.method, c.num_drafts, c.draft_length)
        assert all(0.0 <= r <= 1.0 for r in reach) and reach == sorted(reach, reverse=True)
    # a lower occupancy interpolates between the measured 1 and 4 rows
    assert make_plan(candidates, acceptance, cost, batch=2).batch == 2
    assert forward_widths(13) == [1, 2, 3, 5, 9, 13] and forward_widths(2) == [1, 2]
    # every candidate's own width up to 17 (forwards are not smooth in their width), doubling beyond
    assert forward_widths(65, [1, 4, 7, 17, 25, 65]) == [1, 2, 4, 7, 17, 33, 65]


def test_auto_planner_on_real_models_chooses_a_bounded_exact_candidate():
    from hf_tiny import tiny_model

    from spectr.planner.auto import auto_planner
    from spectr.warps import SamplingWarp

    target, draft = tiny_model(seed=0), tiny_model(seed=0, num_layers=1)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    planner, calibration = auto_planner(target, draft, prompts, batch_size=2, warp=SamplingWarp(1.0, 0, 1.0),
                                        max_num_drafts=2, max_draft_length=2)
    assert calibration.seconds > 0
    assert all(c.num_drafts <= 2 and c.draft_length <= 2 for c in planner.candidates)
    assert planner.choice in planner.candidates
    greedy, _ = auto_planner(target, draft, prompts, batch_size=2, warp=SamplingWarp(0.0, 0, 1.0),
                             max_draft_length=2)
    assert {c.method for c in greedy.candidates} == {"autoregressive", "speculative"}


def test_generate_auto_uses_the_planners_choice_and_says_so():
    from hf_tiny import tiny_model

    import spectr

    target, draft = tiny_model(seed=0), tiny_model(seed=0, num_layers=1)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10]]
    out = spectr.generate(target, draft, prompts, method="auto", num_drafts=2, draft_length=2,
                          max_new_tokens=6, seed=3)
    stats = out.stats
    assert stats.plan.startswith("auto chose ")
    assert stats.method in spectr.known_methods() and stats.num_drafts <= 2 and stats.draft_length <= 2
    # the same rows as the chosen method run directly: auto only picks, the law is the chosen method's
    direct = spectr.generate(target, draft if stats.method != "autoregressive" else None, prompts,
                             method=stats.method, num_drafts=max(stats.num_drafts, 1),
                             draft_length=max(stats.draft_length, 1), max_new_tokens=6, seed=3)
    assert out.tokens == direct.tokens
    assert all(len(t) == 6 for t in out.tokens)


def test_forwards_too_slow_for_any_candidate_are_extrapolated_not_timed():
    from spectr.planner.calibrate import _hopeless

    assert not _hopeless([(1, 1.0)], bound=3.0)  # two points are needed to extrapolate
    assert not _hopeless([(1, 1.0), (5, 2.9)], bound=3.0)
    assert _hopeless([(1, 1.0), (5, 3.0)], bound=3.0)  # a 5-token forward costs 3 one-token ones: wider is hopeless
