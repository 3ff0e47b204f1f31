"""The cost model's arithmetic on synthetic latencies and acceptance, against hand-computed values.

Nothing here is timed: the latencies are made-up numbers, so the expected predictions can be worked
out by hand (shown in the comments).
"""

from __future__ import annotations

import pytest

from pipeline.benchmark_cost import (
    ACCEPT_ALL,
    DRAFT,
    REJECT_ALL,
    TARGET,
    LatencyTable,
    active_rows,
    interpolate,
    predict_seconds,
    reach_probabilities,
)


def synthetic_table() -> LatencyTable:
    table = LatencyTable()
    for batch, scale in ((1, 1.0), (2, 1.5)):
        table.add(TARGET, batch, (1,), 0.010 * scale)
        table.add(TARGET, batch, (5,), 0.020 * scale)  # K=2, L=2: 1 + 4 nodes
        table.add(DRAFT, batch, (1,), 0.001 * scale)
        table.add(DRAFT, batch, (2,), 0.002 * scale)
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


def test_active_rows_and_reach_probabilities():
    assert active_rows([3, 1, 2]) == [3, 2, 1]
    assert active_rows([]) == []
    # histogram over tokens per call n = 0..L+1 (L = 2): 2 calls gave 1 token, 1 gave 2, 1 gave 3
    assert reach_probabilities([0, 2, 1, 1], 2) == [1.0, 0.5, 0.25]


def test_autoregressive_prediction_by_hand():
    table = synthetic_table()
    # one batch of 2 rows, 3 and 2 target calls: iterations with 2, 2, 1 active rows
    prediction = predict_seconds(table, "autoregressive", 0, 0, [[3, 2]], [], [(0.1, 0.0)])
    per_two = 0.015 + 0.00075  # target(2, 1) + selection(2)
    per_one = 0.010 + 0.0005
    assert prediction.target_seconds == pytest.approx(2 * 0.015 + 0.010 + 0.1)
    assert prediction.selection_seconds == pytest.approx(2 * 0.00075 + 0.0005)
    assert prediction.draft_seconds == 0.0
    assert prediction.seconds == pytest.approx(2 * per_two + per_one + 0.1)
    assert prediction.tokens_per_second(10) == pytest.approx(10 / (2 * per_two + per_one + 0.1))


def test_spectr_prediction_by_hand():
    table = synthetic_table()
    # K=2, L=2; one row, 2 target calls; histogram: one call emitted 1 token, one emitted 3 (all accepted)
    histogram = [0, 1, 0, 1]
    # reach: s0 = 1, s1 = 0.5 (>= 1 accepted), s2 = 0.5 (all accepted)
    # per iteration with a = 1 row:
    #   step 0 feeds 2 tokens with probability 1 - (1 - s2)^1 = 0.5:  0.5 * 1 ms + 0.5 * 2 ms = 1.5 ms
    #   L - 1 = 1 branch step over K = 2 tokens: 2 ms                      -> draft 3.5 ms
    #   target over 1 + K L = 5 tokens: 20 ms
    #   walk: positions 0 and 1 reached with 1 and 0.5 -> 1.5 walked; share (1.5 - 1)/(2 - 1) = 0.5
    #   selection 3 ms + (5 - 3) * 0.5 = 4 ms
    # two iterations, plus prefill 30 ms (target) + 5 ms (draft)
    prediction = predict_seconds(table, "spectr", 2, 2, [[2]], histogram, [(0.030, 0.005)])
    assert prediction.draft_seconds == pytest.approx(2 * 0.0035 + 0.005)
    assert prediction.target_seconds == pytest.approx(2 * 0.020 + 0.030)
    assert prediction.selection_seconds == pytest.approx(2 * 0.004)
    assert prediction.seconds == pytest.approx(0.012 + 0.070 + 0.008)
    assert prediction.prefill_seconds == pytest.approx(0.035)


def test_spectr_prediction_interpolates_a_shrinking_batch():
    table = synthetic_table()
    histogram = [0, 4, 0, 0]  # nothing ever accepted: s = [1, 0, 0]
    # rows with 2 and 1 calls: iteration 1 has 2 active rows, iteration 2 has 1
    # a = 2: draft 1.5 ms + 3 ms = 4.5 ms; target 30 ms; selection at the reject extreme 4.5 ms
    # a = 1: draft 1 ms + 2 ms = 3 ms;     target 20 ms; selection 3 ms
    prediction = predict_seconds(table, "spectr", 2, 2, [[2, 1]], histogram, [(0.0, 0.0)])
    assert prediction.seconds == pytest.approx((0.0045 + 0.030 + 0.0045) + (0.003 + 0.020 + 0.003))


def test_missing_latency_names_the_shape():
    with pytest.raises(KeyError, match="target"):
        LatencyTable().at(TARGET, 1, (9,))


def test_calibration_rescales_each_calibrated_shape_and_the_prefill():
    table = synthetic_table()
    histogram = [0, 4, 0, 0]  # never accepted
    # the run's own latencies at B=2 were twice the table's for the target tree and the draft's K=2 step
    calibration = {(TARGET, (5,)): 0.060, (DRAFT, (1,)): 0.0015, (DRAFT, (2,)): 0.006}
    prediction = predict_seconds(
        table, "spectr", 2, 2, [[2, 1]], histogram, [(0.010, 0.001)], calibration=calibration, batch_size=2
    )
    # factors: target(5) x2, draft(1) x1, draft(2) x2 (at every batch size); selection unscaled
    # a = 2: draft 1.5 + 2 * 3 = 7.5 ms; target 2 * 30 = 60 ms; selection 4.5 ms
    # a = 1: draft 1 + 2 * 2 = 5 ms;     target 2 * 20 = 40 ms; selection 3 ms
    # prefill: target x2 (its widest calibrated forward), draft x2 (widest calibrated draft shape: T=2)
    assert prediction.draft_seconds == pytest.approx(0.0075 + 0.005 + 2 * 0.001)
    assert prediction.target_seconds == pytest.approx(0.060 + 0.040 + 2 * 0.010)
    assert prediction.selection_seconds == pytest.approx(0.0045 + 0.003)
