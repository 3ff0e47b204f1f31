"""The cost model's arithmetic on synthetic latencies and acceptance, against hand-computed values.

Nothing here is timed: the latencies are made-up numbers, so the expected predictions can be worked
out by hand (shown in the comments).
"""

from __future__ import annotations

import pytest

from spectr.planner.latency import pooled
from spectr.planner.predict import active_rows, predict_seconds, reach_probabilities
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
    batch_context,
    interpolate,
)


def synthetic_table() -> LatencyTable:
    """Forwards at contexts 10 and 20 (x1 and x1.5); everything else context-free."""
    table = LatencyTable()
    for batch, scale in ((1, 1.0), (2, 1.5)):
        for context, longer in ((10, 1.0), (20, 1.5)):
            table.add(TARGET, batch, (1,), 0.010 * scale * longer, context)
            table.add(TARGET, batch, (5,), 0.020 * scale * longer, context)  # K=2, L=2: 1 + 4 nodes
            table.add(DRAFT, batch, (1,), 0.001 * scale * longer, context)
            table.add(DRAFT, batch, (2,), 0.002 * scale * longer, context)
        table.add(DRAFT_SAMPLE_FIRST, batch, (2,), 0.0002 * scale)
        table.add(DRAFT_SAMPLE, batch, (2,), 0.0001 * scale)
        table.add(COMMIT, batch, (0,), 0.0001 * scale)
        table.add(COMMIT, batch, (2,), 0.0004 * scale)
        table.add("selection_autoregressive", batch, (), 0.0005 * scale)
        table.add(f"selection_spectr_{REJECT_ALL}", batch, (2, 2), 0.003 * scale)
        table.add(f"selection_spectr_{ACCEPT_ALL}", batch, (2, 2), 0.005 * scale)
    return table


def test_interpolate_is_piecewise_linear_and_extrapolates_from_the_end_segments():
    points = [(1, 10.0), (2, 15.0), (4, 35.0)]
    assert interpolate(points, 1) == 10.0
    assert interpolate(points, 1.5) == 12.5
    assert interpolate(points, 3) == 25.0
    assert interpolate(points, 6) == 55.0  # slope 10 of the last segment
    assert interpolate([(2, 4.0)], 3) == 6.0  # one point: proportional


def test_table_interpolates_in_batch_then_context():
    table = synthetic_table()
    assert table.at(TARGET, 1, (1,), 10) == pytest.approx(0.010)
    assert table.at(TARGET, 1.5, (1,), 15) == pytest.approx(0.0125 * 1.25)  # B halfway, context halfway
    assert table.at(TARGET, 2, (1,), 30) == pytest.approx(0.015 * 2.0)  # extrapolated from 10 and 20
    assert table.at(TARGET, 1, (1,)) == pytest.approx(0.015)  # no context: the widest measured
    assert table.at(COMMIT, 2, (2,), 99) == pytest.approx(0.0006)  # context-free component
    assert table.contexts(TARGET) == [10, 20]
    assert table.grid(DRAFT, 10) == {(1, (1,)): 0.001, (1, (2,)): 0.002, (2, (1,)): 0.0015, (2, (2,)): 0.003}


def test_batch_shape_follows_the_longest_prompt():
    prompts = [[1] * 5, [1] * 9]
    assert batch_context(prompts, 24) == 8 + 12  # longest prompt but its pending token, + half the new tokens


def test_pooled_calibration_is_the_mean_over_runs():
    assert pooled([{"a": 1.0, "b": 2.0}, {"a": 3.0}]) == {"a": 2.0, "b": 2.0}


def test_active_rows_and_reach_probabilities():
    assert active_rows([3, 1, 2]) == [3, 2, 1]
    assert active_rows([]) == []
    # histogram over tokens per call n = 0..L+1 (L = 2): 2 calls gave 1 token, 1 gave 2, 1 gave 3
    assert reach_probabilities([0, 2, 1, 1], 2) == [1.0, 0.5, 0.25]


def test_autoregressive_prediction_by_hand():
    table = synthetic_table()
    # one batch of 2 rows, 3 and 2 target calls: iterations with 2, 2, 1 active rows, context 10
    batch = BatchRun([3, 2], (0.1, 0.0), 10)
    prediction = predict_seconds(table, "autoregressive", 0, 0, [batch], [])
    per_two = 0.015 + 0.00075 + 0.00015  # target(2, 1) + selection(2) + commit(2)
    per_one = 0.010 + 0.0005 + 0.0001
    assert prediction.target_seconds == pytest.approx(2 * 0.015 + 0.010 + 0.1)
    assert prediction.selection_seconds == pytest.approx(2 * 0.00075 + 0.0005)
    assert prediction.other_seconds == pytest.approx(2 * 0.00015 + 0.0001)
    assert prediction.draft_seconds == 0.0
    assert prediction.seconds == pytest.approx(2 * per_two + per_one + 0.1)
    assert prediction.tokens_per_second(10) == pytest.approx(10 / prediction.seconds)


def test_spectr_prediction_by_hand():
    table = synthetic_table()
    # K=2, L=2; one row, 2 target calls; histogram: one call emitted 1 token, one emitted 3 (all accepted)
    histogram = [0, 1, 0, 1]
    # reach: s0 = 1, s1 = 0.5 (>= 1 accepted), s2 = 0.5 (all accepted)
    # per iteration with a = 1 row, context 10:
    #   step 0 feeds 2 tokens with probability 1 - (1 - s2)^1 = 0.5:  0.5 * 1 ms + 0.5 * 2 ms = 1.5 ms
    #   L - 1 = 1 branch step over K = 2 tokens: 2 ms
    #   sampling: first step 0.2 ms + 1 later step 0.1 ms                   -> draft 3.8 ms
    #   target over 1 + K L = 5 tokens: 20 ms
    #   walk: positions 0 and 1 reached with 1 and 0.5 -> 1.5 walked; share (1.5 - 1)/(2 - 1) = 0.5
    #   selection 3 ms + (5 - 3) * 0.5 = 4 ms
    #   commit 0.4 ms
    # two iterations, plus prefill 30 ms (target) + 5 ms (draft)
    batch = BatchRun([2], (0.030, 0.005), 10)
    prediction = predict_seconds(table, "spectr", 2, 2, [batch], histogram)
    assert prediction.draft_seconds == pytest.approx(2 * 0.0038 + 0.005)
    assert prediction.target_seconds == pytest.approx(2 * 0.020 + 0.030)
    assert prediction.selection_seconds == pytest.approx(2 * 0.004)
    assert prediction.other_seconds == pytest.approx(2 * 0.0004)
    assert prediction.seconds == pytest.approx(0.0126 + 0.070 + 0.008 + 0.0008)
    assert prediction.prefill_seconds == pytest.approx(0.035)


def test_spectr_prediction_interpolates_a_shrinking_batch_and_a_longer_context():
    table = synthetic_table()
    histogram = [0, 4, 0, 0]  # nothing ever accepted: s = [1, 0, 0]
    # rows with 2 and 1 calls: iteration 1 has 2 active rows, iteration 2 has 1; context 15: forwards x1.25
    # a = 2: draft 1.25 * (1.5 + 3) + 0.3 + 0.15 = 6.075 ms; target 1.25 * 30 ms; selection 4.5 ms; commit 0.6 ms
    # a = 1: draft 1.25 * (1 + 2) + 0.2 + 0.1 = 4.05 ms;     target 1.25 * 20 ms; selection 3 ms;   commit 0.4 ms
    batch = BatchRun([2, 1], (0.0, 0.0), 15)
    prediction = predict_seconds(table, "spectr", 2, 2, [batch], histogram)
    first = 0.006075 + 0.0375 + 0.0045 + 0.0006
    second = 0.00405 + 0.025 + 0.003 + 0.0004
    assert prediction.seconds == pytest.approx(first + second)


def test_missing_latency_names_the_shape():
    with pytest.raises(KeyError, match="target"):
        LatencyTable().at(TARGET, 1, (9,))


def test_calibration_rescales_each_calibrated_shape_and_the_prefill():
    table = synthetic_table()
    histogram = [0, 4, 0, 0]  # never accepted
    # the run's own latencies at B=2, context 10, were twice the table's for the target tree and the
    # draft's K=2 step
    calibration = {(TARGET, (5,)): 0.060, (DRAFT, (1,)): 0.0015, (DRAFT, (2,)): 0.006}
    batch = BatchRun([2, 1], (0.010, 0.001), 10)
    prediction = predict_seconds(
        table, "spectr", 2, 2, [batch], histogram, calibration=calibration, batch_size=2, calibration_context=10
    )
    # factors: target(5) x2, draft(1) x1, draft(2) x2 (at every batch size); sampling, selection, commit unscaled
    # a = 2: draft 1.5 + 2 * 3 + 0.45 = 7.95 ms; target 2 * 30 = 60 ms; selection 4.5 ms; commit 0.6 ms
    # a = 1: draft 1 + 2 * 2 + 0.3 = 5.3 ms;     target 2 * 20 = 40 ms; selection 3 ms;   commit 0.4 ms
    # prefill: target x2 (its widest calibrated forward), draft x2 (widest calibrated draft shape: T=2)
    assert prediction.draft_seconds == pytest.approx(0.00795 + 0.0053 + 2 * 0.001)
    assert prediction.target_seconds == pytest.approx(0.060 + 0.040 + 2 * 0.010)
    assert prediction.selection_seconds == pytest.approx(0.0045 + 0.003)
    assert prediction.other_seconds == pytest.approx(0.0006 + 0.0004)


def test_later_draft_steps_attend_the_earlier_branch_tokens():
    from spectr.planner.predict import iteration_seconds

    table = synthetic_table()
    table.add(f"selection_spectr_{REJECT_ALL}", 1, (2, 3), 0.003)
    table.add(f"selection_spectr_{ACCEPT_ALL}", 1, (2, 3), 0.003)
    table.add(COMMIT, 1, (3,), 0.0004)
    table.add(TARGET, 1, (7,), 0.030, 10)
    # K=2, L=3, one row, nothing accepted (one pending token), context 10:
    # step 0: draft(1) at context 10 = 1 ms; step 1: draft(2) at context 10 = 2 ms; step 2 attends the
    # K = 2 branch tokens of step 1 too: draft(2) at context 12 = 2 * 1.1 = 2.2 ms; sampling 0.2 + 2 * 0.1
    draft, target, _, _ = iteration_seconds(table, "spectr", 1, 2, 3, [1.0, 0.0, 0.0, 0.0], context=10)
    assert draft == pytest.approx(0.001 + 0.002 + 0.0022 + 0.0004)
    assert target == pytest.approx(0.030)


def test_single_position_drafts_interpolate_by_the_batch_reaching_the_bonus():
    from spectr.planner.predict import iteration_seconds

    table = LatencyTable()
    for batch in (1, 2):
        table.add(f"selection_spectr_{REJECT_ALL}", batch, (2, 1), 0.002)
        table.add(f"selection_spectr_{ACCEPT_ALL}", batch, (2, 1), 0.004)
        table.add(COMMIT, batch, (1,), 0.0)
        table.add(TARGET, batch, (3,), 0.0)
        for tokens in (1, 2):
            table.add(DRAFT, batch, (tokens,), 0.0)
        table.add(DRAFT_SAMPLE_FIRST, batch, (2,), 0.0)
        table.add(DRAFT_SAMPLE, batch, (2,), 0.0)
    # L = 1, half the calls accept: with 2 rows, some row reaches the bonus with 1 - 0.5^2 = 0.75
    _, _, selection, _ = iteration_seconds(table, "spectr", 2, 2, 1, [1.0, 0.5], context=None)
    assert selection == pytest.approx(0.002 + 0.002 * 0.75)
