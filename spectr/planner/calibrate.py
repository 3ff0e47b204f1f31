"""Calibrating the planner on the worker's own device, in a few seconds: a cost model and an acceptance model.

`measure_cost_model` times, through the engine's own pieces (`spectr.planner.latency`), what one
iteration of any candidate costs at the job's batch size and context: target forwards at a few token
counts between 1 and the widest candidate tree (interpolated in between), draft forwards at 1, 2 and K
tokens, the draft's sampling, the selection walk of each method at its smallest and largest tree
(at the all-accept extreme: the walk has no early exit, so its work does not depend on acceptance), and the commit. Forwards are also timed at one row, so
that a plan for a lower occupancy interpolates between measured batch sizes.

`time_engine` runs one candidate through the engine itself (`spectr.ContinuousBatcher`) for a few
iterations with the batch full: what a whole iteration costs, bookkeeping and host sync included, and
what admitting a row (its prefill) costs. The planner times its likely choices this way and scales the
component model to them (`spectr.planner.choose.CostModel.with_engine_timings`).

`measure_acceptance` samples short continuations of the job's first prompts from the target and reads
p and q along them (`spectr.planner.acceptance.collect_distributions`).

Not here: the choice (`spectr.planner.choose`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from spectr.hf import HFCausalLM
from spectr.planner.acceptance import AcceptanceModel, collect_distributions
from spectr.planner.choose import SELECTION, Candidate, CostModel, EngineTiming
from spectr.planner.latency import (
    ForwardTimer,
    _sync,
    autoregressive_selection_latency,
    commit_latency,
    draft_sampling_latency,
    selection_latency,
)
from spectr.planner.table import ACCEPT_ALL, COMMIT, DRAFT, DRAFT_SAMPLE, TARGET, LatencyTable
from spectr.warps import SamplingWarp

ENGINE_ITERATIONS = 5  # timed engine iterations per candidate, after one untimed


EXACT_WIDTHS_UP_TO = 17  # target forwards are timed at every candidate's own width up to here


def forward_widths(widest: int, used: Sequence[int] = ()) -> list[int]:
    """Target forward widths to time: 1, 2, every width in `used` up to EXACT_WIDTHS_UP_TO (a forward's
    cost is not smooth in its width on CPUs: kernels change at some sizes), and beyond that 33, 65, ...
    up to and including `widest`, interpolated in between."""
    widths, w = {1, 2} | {u for u in used if u <= min(widest, EXACT_WIDTHS_UP_TO)}, 3
    while w < widest:
        if w > EXACT_WIDTHS_UP_TO or not used:
            widths.add(w)
        w = 2 * w - 1
    return sorted({x for x in widths if x <= widest} | {widest})


@torch.inference_mode()
def measure_cost_model(
    target: HFCausalLM,
    draft: HFCausalLM,
    candidates: Sequence[Candidate],
    batch: int,
    context: int,
    warp: SamplingWarp,
    repeats: int = 1,
    best_tokens_per_call: float | None = None,
) -> CostModel:
    """Every latency `CostModel.iteration_seconds` reads for `candidates` at `batch` rows and `context`.

    best_tokens_per_call: the most tokens per target call any candidate is expected to yield (default:
    1 + the longest draft); target forwards costing more than that many one-token forwards are not
    timed (see `_hopeless`)."""
    speculative = [c for c in candidates if c.method != "autoregressive"]
    widest = max([c.tree_tokens for c in candidates] + [2])
    max_k = max([c.num_drafts for c in speculative] + [1])
    max_l = max([c.draft_length for c in speculative] + [1])
    table = LatencyTable()
    used = sorted({c.tree_tokens for c in candidates})
    for rows in sorted({1, batch}):
        # at the job's batch every candidate's own width; at one row (lower occupancy) a coarser curve
        widths = forward_widths(widest, used if rows == batch else ())
        bound = best_tokens_per_call or 1 + max_l
        timers = _time_forwards(table, target, draft, rows, context, (widths, max_k, max_l, bound), repeats,
                                bool(speculative))
        if rows != batch:
            continue
        _time_steps(table, timers, rows, target.vocab_size, warp, max_k, max_l, repeats, target.device)
        _time_selection(table, speculative, rows, target.vocab_size, warp, repeats, target.device)
    return CostModel(table, context=None)


def _time_forwards(table, target, draft, rows, context, sizes, repeats, speculative) -> dict:
    widths, max_k, max_l, bound = sizes
    # slots after the context: the widest forward, and the commit's L + 1 slots (timed on these caches)
    timers = {TARGET: ForwardTimer(target, rows, context, max(max(widths), max_l + 2))}
    measured: list[tuple[int, float]] = []
    for w in widths:
        if _hopeless(measured, bound):  # extrapolated: no candidate this wide can beat autoregressive
            (w0, t0), (w1, t1) = measured[-2:]
            table.add(TARGET, rows, (w,), t1 + (t1 - t0) * (w - w1) / (w1 - w0))
            continue
        measured.append((w, timers[TARGET].seconds(w, repeats)))
        table.add(TARGET, rows, (w,), measured[-1][1])
    timers[DRAFT] = None
    if speculative:
        timers[DRAFT] = ForwardTimer(draft, rows, context, max(2, max_k, max_l + 2))
        for w in sorted({1, 2, max_k} | ({max_k // 2} if max_k > 2 else set())):
            table.add(DRAFT, rows, (w,), timers[DRAFT].seconds(w, repeats))
    return timers


def _hopeless(measured: list[tuple[int, float]], bound: float) -> bool:
    """Whether wider target forwards need no timing: one already costs more than `bound` forwards of
    one token, `bound` being the most tokens any candidate's call is expected to yield, so wider trees
    (which cost at least as much) cannot beat autoregressive. Then they are extrapolated linearly (compute-bound: on CPUs, or
    GPUs at large batch; at small batch on a GPU the forwards stay flat and every width is timed)."""
    return len(measured) >= 2 and measured[-1][1] >= bound * measured[0][1]


def _time_steps(table, timers, rows, vocab_size, warp, max_k, max_l, repeats, device) -> None:
    """The draft's sampling at K = 1 and the widest K, and the commit at L = 0 and the longest L."""
    for k in sorted({1, max_k}):
        table.add(DRAFT_SAMPLE, rows, (k,), draft_sampling_latency(rows, k, vocab_size, warp, False, repeats, device))
    table.add(COMMIT, rows, (0,), commit_latency(timers[TARGET], None, 0, repeats))
    if timers[DRAFT] is not None:
        table.add(COMMIT, rows, (max_l,), commit_latency(timers[TARGET], timers[DRAFT], max_l, repeats))
    table.add(f"{SELECTION}_autoregressive", rows, (0,),
              autoregressive_selection_latency(rows, vocab_size, warp, repeats, device))


def _time_selection(table, speculative: Sequence[Candidate], rows, vocab_size, warp, repeats, device) -> None:
    """Each method's selection at its smallest and largest tree, as the mean of the two extremes."""
    for method in sorted({c.method for c in speculative}):
        mine = [c for c in speculative if c.method == method]
        for c in {min(mine, key=lambda c: c.num_drafts * c.draft_length), max(mine, key=lambda c: c.num_drafts * c.draft_length)}:
            # the walk covers every position with masks (no early exit): one extreme is enough
            seconds = selection_latency(method, rows, c.num_drafts, c.draft_length, vocab_size, ACCEPT_ALL, warp,
                                        repeats, device)
            table.add(f"{SELECTION}_{method}", rows, (c.num_drafts * c.draft_length,), seconds)


def measure_acceptance(
    target,
    draft,
    prompts: Sequence[Sequence[int]],
    continuation_tokens: int,
    warp: SamplingWarp,
    seed: int,
    num_drafts: Sequence[int] = (2, 4, 8),
) -> AcceptanceModel:
    """The acceptance model of this pair on these prompts, from one short target-sampled continuation each."""
    draft_probs, target_probs = collect_distributions(target, draft, prompts, continuation_tokens, warp, seed)
    segments = [continuation_tokens] * len(prompts)
    return AcceptanceModel.from_distributions(draft_probs, target_probs, segments, num_drafts)


@torch.inference_mode()
def time_engine(
    target,
    draft,
    candidate: Candidate,
    prompts: Sequence[Sequence[int]],
    batch: int,
    warp: SamplingWarp,
    seed: int,
    iterations: int = ENGINE_ITERATIONS,
) -> EngineTiming | None:
    """Seconds of one engine iteration of `candidate` with `batch` rows in flight (the prompts, cycled),
    and of one row's admission. Budgets are large enough that no row finishes while it is timed; fewer
    iterations are timed when the models' positions leave no room for them (None: not even one)."""
    from spectr.batching import ContinuousBatcher

    speculative = candidate.method != "autoregressive"
    length = max(candidate.draft_length, 1)
    budget = (iterations + 1) * (length + 1) + 1
    rows = [list(prompts[i % len(prompts)]) for i in range(batch)]
    batcher = ContinuousBatcher(
        target, draft if speculative else None, batch_size=batch, max_length=max(map(len, rows)) + budget,
        method=candidate.method, num_drafts=max(candidate.num_drafts, 1), draft_length=length,
        temperature=warp.temperature, top_k=warp.top_k, top_p=warp.top_p, eos_token_id=None,
    )
    room = batcher.max_length - max(map(len, rows))  # the models' positions may allow fewer tokens
    iterations = min(iterations, (room - 1) // (length + 1) - 1)
    if iterations < 1:
        return None
    batcher.admit(rows, max_new_tokens=(iterations + 1) * (length + 1) + 1, seed=seed)
    device = batcher.device
    _sync(device)
    started = time.perf_counter()
    batcher.fill()
    _sync(device)
    prefill = (time.perf_counter() - started) / batch
    batcher.step()  # untimed: the first iteration pays for one-off allocations
    seconds = []
    for _ in range(iterations):
        started = time.perf_counter()
        batcher.step()  # ends with the iteration's host copy: the device is done
        seconds.append(time.perf_counter() - started)
    # the median: a few iterations, one of them preempted on a shared machine, must not decide the plan
    return EngineTiming(candidate, statistics.median(seconds), prefill)
