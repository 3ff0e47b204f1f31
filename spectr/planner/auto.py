"""`method="auto"`: calibrate a `Planner` for one draft/target pair on its device, then follow its choice.

    planner = auto_planner(target, draft, prompts, batch_size=8, warp=SamplingWarp(1.0, 0, 1.0))
    choice = planner.choice                      # a Candidate: method, K, L
    # or, in one call: spectr.generate(target, draft, prompts, method="auto", ...)
    ... spectr.generate(..., method=choice.method, num_drafts=choice.num_drafts, draft_length=choice.draft_length)
    planner.observe(choice, stats.accepted_per_position, stats.total_target_calls, mean_active_rows)

Calibration measures the forwards and the cheap steps at the batch size and the prompts' context
(`spectr.planner.calibrate.measure_cost_model`, with a low timing floor: it only ranks), the pair's
acceptance along short target-sampled continuations of a few of the prompts (`measure_acceptance`),
then times the likely choices as whole engine iterations (`time_engine`: autoregressive and the
component model's best one-draft and several-draft candidates, then its next-best candidates while
`ENGINE_BUDGET_S` lasts) and scales the model to them: measured candidates are predicted from their
own iterations, the others through their method's (or family's) measured factor. Every candidate is exact, so the choice
only changes the speed. With temperature 0 (greedy) multiple drafts add nothing, so only autoregressive
and single-draft candidates are considered.

Not here: the loop (`spectr.generate`), what the job logs about the choice (`pipeline.generate`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from spectr.hf import HFCausalLM
from spectr.planner.calibrate import ENGINE_ITERATIONS, measure_acceptance, measure_cost_model, time_engine
from spectr.planner.choose import (
    AUTOREGRESSIVE,
    Candidate,
    CostModel,
    Planner,
    bounded,
    default_candidates,
    family,
    make_plan,
)
from spectr.planner.latency import timing_floor
from spectr.warps import SamplingWarp

PROBE_PROMPTS = 4  # prompts whose continuations measure the acceptance
PROBE_TOKENS = 16  # tokens per continuation
# The probe's random streams are the seeds' streams shifted far away, so that the choice never shares
# uniforms with the rows it is chosen for (it must not depend on the randomness of the outputs).
PROBE_SEED_OFFSET = 2**61
COMPONENT_TIMING_FLOOR_S = 0.03  # the component model only ranks; its likely choices are timed whole
ENGINE_BUDGET_S = 1.0  # whole-iteration timings beyond the first candidate of each family stop here
BEST_TOKENS_SLACK = 1.25  # the acceptance probe is short: wider forwards are skipped only with this slack
AR_ITERATION_FACTOR = 2  # autoregressive, the baseline, is timed over this many times more iterations


@dataclass(frozen=True)
class Calibration:
    """How long the planner's measurements took, for the job's report."""

    cost_seconds: float
    acceptance_seconds: float
    engine_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return self.cost_seconds + self.acceptance_seconds + self.engine_seconds


def auto_planner(
    target,
    draft,
    prompts: Sequence[Sequence[int]],
    *,
    batch_size: int,
    warp: SamplingWarp,
    seed: int = 0,
    max_num_drafts: int | None = None,
    max_draft_length: int | None = None,
    max_new_tokens: int | None = None,
) -> tuple[Planner, Calibration]:
    """A planner calibrated on this pair, device, batch size and these prompts' context.

    max_new_tokens: tokens per row, so that each row's prefill is priced into the prediction (None: not)."""
    if not prompts:
        raise ValueError("auto_planner needs at least one prompt to measure the pair's acceptance")
    greedy = warp.temperature == 0
    candidates = default_candidates(methods=("speculative",) if greedy else ("speculative", "block", "spectr", "specinfer"))
    candidates = bounded(candidates, max_num_drafts, max_draft_length)
    target_lm, draft_lm = HFCausalLM(target, role="target"), HFCausalLM(draft, role="draft")
    context = max(len(p) for p in prompts)
    started = time.perf_counter()
    probe = [list(p) for p in prompts[:PROBE_PROMPTS]]
    ks = sorted({c.num_drafts for c in candidates if c.num_drafts > 1}) or [2]
    acceptance = measure_acceptance(target, draft, probe, PROBE_TOKENS, warp, seed + PROBE_SEED_OFFSET, ks)
    accepted = time.perf_counter()
    best = max(acceptance.expected_tokens(c.method, c.num_drafts, c.draft_length) for c in candidates)
    with timing_floor(COMPONENT_TIMING_FLOOR_S):  # forwards too slow for `best` tokens a call are not timed
        cost = measure_cost_model(target_lm, draft_lm, candidates, batch_size, context, warp,
                                  best_tokens_per_call=BEST_TOKENS_SLACK * best)
    measured = time.perf_counter()
    cost = _timed_whole(cost, candidates, acceptance, (target, draft), prompts, batch_size, warp, seed)
    calibration = Calibration(measured - accepted, accepted - started, time.perf_counter() - measured)
    return Planner(candidates, acceptance, cost, batch_size, new_tokens=max_new_tokens), calibration


def likely_choices(plan) -> list[Candidate]:
    """The candidates worth timing whole, in order: autoregressive and the best-predicted candidate of
    each other `family` first, then the rest of the plan, fastest first."""
    firsts, seen = [], set()
    for entry in plan.entries:
        if family(entry.candidate.method) not in seen:
            seen.add(family(entry.candidate.method))
            firsts.append(entry.candidate)
    return firsts + [e.candidate for e in plan.entries if e.candidate not in firsts]


def _timed_whole(cost: CostModel, candidates, acceptance, pair, prompts, batch_size: int, warp, seed: int) -> CostModel:
    """The component model scaled to whole engine iterations of its likely choices: one per family,
    then the next-best candidates while `ENGINE_BUDGET_S` lasts."""
    plan = make_plan(candidates, acceptance, cost, batch_size, margin=0.0)
    families = len({family(c.method) for c in candidates})
    started, timings = time.perf_counter(), []
    for n, candidate in enumerate(likely_choices(plan)):
        if n >= families and time.perf_counter() - started > ENGINE_BUDGET_S:
            break
        # autoregressive is the baseline every other choice must beat: its cheap iterations are timed longer
        iterations = ENGINE_ITERATIONS * (AR_ITERATION_FACTOR if candidate.method == AUTOREGRESSIVE else 1)
        timing = time_engine(*pair, candidate, prompts, batch_size, warp, seed + PROBE_SEED_OFFSET, iterations)
        if timing is None:  # no room in the models' positions: the component model stands for it
            continue
        reach = tuple(acceptance.reach(candidate.method, candidate.num_drafts, candidate.draft_length))
        timings.append(replace(timing, reach=reach))
    return cost.with_engine_timings(timings, batch_size)


def generate_auto(target, draft, prompts: Sequence[Sequence[int]], *, num_drafts: int, draft_length: int,
                  temperature: float, top_k: int, top_p: float, seed, batch_size: int | None = None,
                  planner: Planner | None = None, **arguments):
    """`spectr.generate(method="auto")`: calibrate (unless a planner is given), then generate with its choice."""
    from spectr.generate import generate

    warp = SamplingWarp(float(temperature), int(top_k), float(top_p))
    if planner is None:
        rows = min(batch_size or len(prompts), len(prompts))
        first_seed = seed if isinstance(seed, int) else int(seed[0])
        planner, _ = auto_planner(target, draft, prompts, batch_size=max(rows, 1), warp=warp, seed=first_seed,
                                  max_num_drafts=num_drafts, max_draft_length=draft_length,
                                  max_new_tokens=_mean_budget(arguments.get("max_new_tokens")))
    choice = planner.choice
    output = generate(
        target, None if choice.method == "autoregressive" else draft, prompts, method=choice.method,
        num_drafts=max(choice.num_drafts, 1), draft_length=max(choice.draft_length, 1), temperature=temperature,
        top_k=top_k, top_p=top_p, seed=seed, batch_size=batch_size, **arguments,
    )
    output.stats.plan = planner.plan.describe()
    return output


def _mean_budget(max_new_tokens) -> int | None:
    """The rows' mean token budget (an int or one per prompt), for pricing their prefill."""
    if max_new_tokens is None:
        return None
    if isinstance(max_new_tokens, int):
        return max_new_tokens
    budgets = list(max_new_tokens)
    return max(1, round(sum(budgets) / len(budgets))) if budgets else None
