"""scripts/harness.py, the benchmark scripts' shared parts: round order, the median's interval, the report files.
Nothing here times anything."""

from __future__ import annotations

import json
import random
import statistics

import pytest
from script_support import load_script

harness = load_script("harness")


def test_interleaved_runs_every_arm_once_per_round_after_the_warmup():
    calls = []
    arms = {name: (lambda name=name: calls.append(name) or len(calls)) for name in "abc"}
    seen = []
    runs = harness.interleaved(arms, rounds=3, warmup=1, on_run=lambda r, name, result: seen.append((r, name)))
    assert calls == list("abc") * 4  # one warm-up round, then three
    assert runs == {"a": [4, 7, 10], "b": [5, 8, 11], "c": [6, 9, 12]}  # warm-up results dropped
    assert seen == [(r, name) for r in range(3) for name in "abc"]


def test_interleaved_alternates_or_shuffles_the_order_of_a_round():
    order = []
    arms = {name: (lambda name=name: order.append(name)) for name in "abc"}
    harness.interleaved(arms, rounds=3, alternate=True)
    assert "".join(order) == "abccbaabc"
    order.clear()
    harness.interleaved(arms, rounds=20, shuffle=random.Random(0))
    rounds = ["".join(order[i:i + 3]) for i in range(0, 60, 3)]
    assert all(sorted(r) == list("abc") for r in rounds)  # each round runs every arm once
    assert len(set(rounds)) > 1  # in more than one order


def test_median_interval_brackets_the_median_and_narrows_with_more_values():
    rng = random.Random(1)
    few = [rng.gauss(10, 1) for _ in range(5)]
    assert harness.median_interval(few) == (statistics.median(few), min(few), max(few))  # n < 6: min..max
    many = [rng.gauss(10, 1) for _ in range(101)]
    median, low, high = harness.median_interval(many)
    assert median == statistics.median(many) and low < median < high
    ordered = sorted(many)
    assert ordered[0] < low and high < ordered[-1]  # strictly inside the range at n = 101
    # the order statistics of the binomial 95 % interval at n = 101: ranks 41 and 61
    assert (low, high) == (ordered[40], ordered[60])
    with pytest.raises(ValueError):
        harness.median_interval([])


def test_ratio_summary_pairs_rounds():
    a = [{"x": 2.0}, {"x": 6.0}, {"x": 3.0}]
    b = [{"x": 1.0}, {"x": 3.0}, {"x": 3.0}]
    assert harness.ratio_summary(a, b, "x")["median"] == 2.0  # per-round ratios 2, 2, 1
    with pytest.raises(ValueError):
        harness.ratio_summary(a, b[:2], "x")


def test_report_writes_json_and_markdown_with_command_date_and_machine(tmp_path):
    report = harness.Report("bench_x", argv=["scripts/bench_x.py", "--rounds", "2"])
    assert report.header().startswith("command: python scripts/bench_x.py --rounds 2\nmachine: ")
    rows = [{"arm": "a", "tokens_per_s": 12.5}, {"arm": "b", "tokens_per_s": 25.0}]
    path = report.write(tmp_path / "out.json", {"rows": rows, "meta": {"budgets": [1, 2]}},
                        markdown=harness.table(rows))
    saved = json.loads(path.read_text())
    assert saved["rows"] == rows
    meta = saved["meta"]
    assert meta["command"] == "python scripts/bench_x.py --rounds 2" and meta["budgets"] == [1, 2]
    assert meta["date"].endswith("UTC") and meta["machine"]["cpus"] >= 1 and len(meta["machine"]["load_average"]) == 3
    assert "cpu" in meta["machine"] and "load_average_end" in meta and meta["seconds"] >= 0
    text = path.with_suffix(".md").read_text()
    assert text.startswith("# bench_x\n\n`python scripts/bench_x.py --rounds 2`")
    assert "| arm | tokens_per_s |" in text and "| b | 25 |" in text
    folder = report.write(tmp_path / "folder", {"rows": rows})  # a path without a suffix is a folder
    assert folder == tmp_path / "folder" / "bench_x.json" and not folder.with_suffix(".md").exists()


def test_timed_returns_the_result_and_both_clocks():
    run = harness.timed(lambda: sum(range(1000)))
    assert run["result"] == 499500 and run["wall_s"] >= 0 and run["cpu_s"] >= 0
