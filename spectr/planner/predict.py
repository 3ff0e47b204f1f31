"""Predicting a run's seconds and tokens/s from the latency table and the run's acceptance.

`predict_seconds`, for one measured run: the per-row target calls of that run say how many rows are
active at each iteration i (a_i = #rows with at least i calls). An iteration costs
    draft(a, 1 or 2) + (L - 1) * draft(a, K) + L * sample(a, K)
    + target(a, 1 + K L) + selection(a, K, L, walk) + commit(a, L)
where step 0 feeds 2 tokens when the previous iteration accepted all L drafts of some row
(probability 1 - (1 - f)^a, f = the run's fraction of all-accepted calls) and the selection walk is
interpolated between its extremes by the expected number of positions walked (the walk stops when
no row of the batch accepts: P(reach j) = 1 - (1 - s_j)^a, s_j = the run's fraction of calls that
accepted >= j tokens). Autoregressive: target(a, 1) + selection + commit. Plus one prefill per
batch and model. Predicted tokens/s = generated tokens / predicted seconds.

This is the project's one cost model: the benchmark evaluates it on measured latency tables
(`spectr.planner.latency`), the online chooser on latencies guessed from parameter counts
(`spectr.planner.prior`) to rank what it tries first.

What the model leaves out, and the relative error therefore includes: the engine's Python
bookkeeping per row, the growth of the context within a run beyond linear, and machine noise.
Not here: measuring (`spectr.planner.latency`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spectr.planner.table import (
    ACCEPT_ALL,
    COMMIT,
    DRAFT,
    DRAFT_SAMPLE,
    DRAFT_SAMPLE_FIRST,
    REJECT_ALL,
    TARGET,
    BatchRun,
    LatencyTable,
    ScaledTable,
)


@dataclass(frozen=True)
class Prediction:
    seconds: float
    draft_seconds: float
    target_seconds: float
    selection_seconds: float
    other_seconds: float  # commit
    prefill_seconds: float  # included in draft_seconds / target_seconds

    def tokens_per_second(self, generated_tokens: int) -> float:
        return generated_tokens / self.seconds if self.seconds > 0 else 0.0


def active_rows(row_target_calls: Sequence[int]) -> list[int]:
    """Active batch size at iteration 1, 2, ...: rows that made at least that many target calls."""
    iterations = max(row_target_calls, default=0)
    return [sum(1 for calls in row_target_calls if calls >= i) for i in range(1, iterations + 1)]


def reach_probabilities(histogram: Sequence[int], draft_length: int) -> list[float]:
    """s_j, j = 0..L: fraction of (row, call) pairs whose call accepted >= j draft tokens.

    histogram[n] counts calls that emitted n tokens (accepted + 1, before truncation at the end of a
    row it is a close proxy); s_0 = 1 and s_L is the all-accepted fraction.
    """
    calls = sum(histogram)
    if calls == 0:
        return [1.0] + [0.0] * draft_length
    return [sum(histogram[j + 1 :]) / calls for j in range(draft_length + 1)]


def iteration_seconds(
    table: LatencyTable | ScaledTable,
    method: str,
    active: int,
    num_drafts: int,
    draft_length: int,
    reach: Sequence[float],
    context: float | None = None,
) -> tuple[float, float, float, float]:
    """(draft, target, selection, commit) seconds of one iteration with `active` rows."""
    if method == "autoregressive":
        return (
            0.0,
            table.at(TARGET, active, (1,), context),
            table.at("selection_autoregressive", active, ()),
            table.at(COMMIT, active, (0,)),
        )
    two_pending = 1.0 - (1.0 - reach[draft_length]) ** active  # some row accepted all L last time
    draft = (
        (1.0 - two_pending) * table.at(DRAFT, active, (1,), context)
        + two_pending * table.at(DRAFT, active, (2,), context)
        # branch step d (1..L-1) attends d - 1 earlier branch steps of K slots beyond the context
        + sum(
            table.at(DRAFT, active, (num_drafts,), None if context is None else context + (d - 1) * num_drafts)
            for d in range(1, draft_length)
        )
        + table.at(DRAFT_SAMPLE_FIRST, active, (num_drafts,))
        + (draft_length - 1) * table.at(DRAFT_SAMPLE, active, (num_drafts,))
    )
    target = table.at(TARGET, active, (1 + num_drafts * draft_length,), context)
    low = table.at(f"selection_{method}_{REJECT_ALL}", active, (num_drafts, draft_length))
    high = table.at(f"selection_{method}_{ACCEPT_ALL}", active, (num_drafts, draft_length))
    # positions walked by the batch: position j (0-based) is walked when some row reached it
    walked = sum(1.0 - (1.0 - reach[j]) ** active for j in range(draft_length))
    if draft_length > 1:
        share = (walked - 1.0) / (draft_length - 1)
    else:  # L = 1: one position is always walked; the extremes differ by the bonus sample after it
        share = 1.0 - (1.0 - reach[1]) ** active
    selection = low + (high - low) * min(max(share, 0.0), 1.0)
    return draft, target, selection, table.at(COMMIT, active, (draft_length,))


def predict_seconds(
    table: LatencyTable,
    method: str,
    num_drafts: int,
    draft_length: int,
    batches: Sequence[BatchRun],
    histogram: Sequence[int],
    calibration: dict[tuple[str, tuple], float] | None = None,
    batch_size: int | None = None,
    calibration_context: float | None = None,
) -> Prediction:
    """Predicted wall time of one run: per batch, its prefill plus its iterations (see module docstring).

    The engine times the prefill inside its target / draft phases, and so do the predicted
    draft_seconds / target_seconds. calibration (with batch_size and calibration_context): the
    configuration's own forward latencies at its batch size and context (`Calibrator`), which rescale
    the table (`ScaledTable`).
    """
    latencies = table if not calibration else ScaledTable(table, calibration, batch_size, calibration_context)
    reach = reach_probabilities(histogram, draft_length) if method != "autoregressive" else []
    draft = target = selection = other = 0.0
    prefill_target = prefill_draft = 0.0
    for batch in batches:
        active = active_rows(batch.row_target_calls)
        for rows in active:
            d, t, s, c = iteration_seconds(latencies, method, rows, num_drafts, draft_length, reach, batch.context)
            draft, target, selection, other = draft + d, target + t, selection + s, other + c
        prefill_target += batch.prefill_seconds[0]
        prefill_draft += batch.prefill_seconds[1]
    if calibration:
        prefill_target *= latencies.model_factor(TARGET)
        prefill_draft *= latencies.model_factor(DRAFT)
    draft, target = draft + prefill_draft, target + prefill_target
    return Prediction(
        draft + target + selection + other, draft, target, selection, other, prefill_target + prefill_draft
    )
