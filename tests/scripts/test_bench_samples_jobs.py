"""scripts/bench_samples_jobs.py without running jobs: its arms' inputs hold the same prompts, and it reads the
numbers it reports from the job's own summary table (the real `JobSummary.table`)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from pipeline.generate.stats import empty_stats
from pipeline.generate.summary import JobSummary

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_samples_jobs.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_samples_jobs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arms_hold_the_same_prompts_and_the_summary_is_read(tmp_path):
    bench = load()
    files = bench.write_inputs(bench.SCENARIOS["16x4"], tmp_path)
    samples = [json.loads(line) for line in files["samples"].read_text().splitlines()]
    rows = [json.loads(line) for line in files["rows"].read_text().splitlines()]
    assert len(samples) == 16 and len(rows) == 64 and len({r["id"] for r in rows}) == 64
    assert [r["prompt"] for r in rows] == [s["prompt"] for s in samples for _ in range(4)]

    stats = {**empty_stats(), "generated_tokens": 640, "target_calls": 200, "prompts_completed": 64,
             "prefilled_rows": 16, "shared_prefill_rows": 48}
    summary = JobSummary.build([stats], [stats], num_prompts=64, wall_time_s=30.0, generation_s=10.0,
                               startup_s=20.0, num_actors=2, actor_device="cpu", output_dir="out", num_shards=4)
    text = "checked config, models and 16 prompts x 4 samples = 64 rows in 1.0 s; 4 of 4 shards to generate\n"
    found = bench.parse_summary(text + summary.table())
    assert found["throughput_tokens_per_s"] == 64.0 and found["generated_tokens"] == 640
    assert (found["prefilled_rows"], found["shared_prefill_rows"], found["shards"]) == (16, 48, 4)
    assert found["first_line"].startswith("checked config, models and 16 prompts x 4 samples = 64 rows")
