"""Part files at scale: the planned part files, the commit log's size and the driver's memory on resume.

    python scripts/measure_scale.py                          # 1M prompts (the lead's measurement)
    python scripts/measure_scale.py --prompts 20000 --out bench_out/scale.json

For `--prompts` synthetic JSON-lines prompts, with the default `shard_size` (null: `auto_shard_size`):
1. plan: the real planning pass (`list_source`, `scan_source`, `with_shard_size`) in a fresh process: the
   shard size, the number of part files, the driver's peak resident memory (ru_maxrss) and the time;
2. commit log: one realistic commit record per shard (the statistics of a real shard, `empty_stats` filled
   in), written `--rounds` times (every shard redone: retries, `retry_failed`), its size, then compacted
   (`compact_commit_log`, what a resumed job does first) and its size again;
3. resume: in a fresh process, `load_state` on that directory (every part file present with its listed
   size): the driver's peak resident memory and the time.

Each phase runs in its own process so that its peak memory is its own. Nothing here starts Ray or a model.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT))
sys.path.insert(0, str(PROJECT_ROOT / "scripts"))
from harness import Report, table  # noqa: E402


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_prompts(path: Path, count: int) -> None:
    words = "def return value list map open file line read write".split()
    with open(path, "w") as f:
        for i in range(count):
            prompt = " ".join(words[(i + k) % len(words)] for k in range(4 + i % 9))
            f.write(json.dumps({"id": f"p{i:08d}", "prompt": prompt}) + "\n")


def phase_plan(prompts: Path) -> dict:
    from pipeline.config import DataConfig
    from pipeline.generate.shards import SHARD_GRANULE, auto_shard_size, num_shards
    from pipeline.readers import scan_source
    from pipeline.source import list_source, with_shard_size

    started = time.perf_counter()
    data = DataConfig(path=str(prompts), id_column="id")
    source = scan_source(data, list_source(data), SHARD_GRANULE)
    source = with_shard_size(source, auto_shard_size(source.num_rows))
    return {
        "prompts": source.num_rows,
        "shard_size": source.shard_size,
        "part_files": num_shards(source.num_rows, source.shard_size),
        "plan_s": round(time.perf_counter() - started, 2),
        "plan_peak_mb": round(peak_mb(), 1),
    }


def shard_record(shard: int, rows: int, run: int) -> dict:
    """A commit record the size of a real one (a finished shard's statistics and worker)."""
    from pipeline.generate.stats import empty_stats

    stats = empty_stats()
    stats.update(generated_tokens=rows * 64, target_calls=rows * 20, prompts_completed=rows, prompts_failed=0,
                 accepted_per_position=[rows * 10] * 4, tokens_per_call_histogram=[rows] * 9,
                 shard_seconds=12.5, resources={"cpu_percent": 99.0, "rss_mb": 2048.0})  # fmt: skip
    worker = {"host": "node-17", "node_id": "f" * 56, "pid": 4242, "device": "cuda", "device_kind": "H100"}
    return {"shard": shard, "file": f"part-{shard:06d}-r{run:07d}-1.parquet", "rows": rows, "bytes": 100,
            "failed": 0, "attempt": 1, "stats": stats, "worker": worker, "run": "0" * 32, "time": 0.0}  # fmt: skip


def phase_log(out: Path, shards: int, shard_size: int, rounds: int) -> dict:
    from pipeline import fs
    from pipeline.generate.commit_log import AppendLog, compact_commit_log

    location = fs.resolve(str(out), "output_dir")
    log = AppendLog(location)
    for run in range(rounds):
        for shard in range(shards):
            log.append(shard_record(shard, shard_size, run))
    log.close()
    before = (out / "_commits.jsonl").stat().st_size
    compact_commit_log(location)
    for shard in range(shards):  # the parts the last records list, at their listed size
        (out / f"part-{shard:06d}-r{rounds - 1:07d}-1.parquet").write_bytes(b"\0" * 100)
    return {"commit_log_bytes": before, "compacted_commit_log_bytes": (out / "_commits.jsonl").stat().st_size}


def phase_resume(out: Path, shards: int) -> dict:
    from pipeline import fs
    from pipeline.generate.manifest import load_state

    started = time.perf_counter()
    state = load_state(fs.resolve(str(out), "output_dir"), shards, retry_failed=True)
    return {
        "resume_shards_done": state.shards_done,
        "resume_s": round(time.perf_counter() - started, 2),
        "resume_peak_mb": round(peak_mb(), 1),
    }


def in_fresh_process(*args: str) -> dict:
    answer = subprocess.run([sys.executable, __file__, "--phase", *args], capture_output=True, text=True, check=True)
    return json.loads(answer.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=2, help="times every shard is committed")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--phase", nargs="+", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        name, *rest = args.phase
        print(json.dumps({"plan": lambda: phase_plan(Path(rest[0])),
                          "resume": lambda: phase_resume(Path(rest[0]), int(rest[1]))}[name]()))  # fmt: skip
        return
    report = Report("scale", args=args)
    print(report.header(), flush=True)
    with tempfile.TemporaryDirectory(prefix="measure-scale-") as tmp:
        prompts, out = Path(tmp) / "prompts.jsonl", Path(tmp) / "out"
        out.mkdir()
        write_prompts(prompts, args.prompts)
        results = {"input_bytes": os.path.getsize(prompts), **in_fresh_process("plan", str(prompts))}
        results.update(phase_log(out, results["part_files"], results["shard_size"], args.rounds))
        results.update(in_fresh_process("resume", str(out), str(results["part_files"])))
    for key, value in results.items():
        print(f"{key:>28}: {value}")
    if args.out:
        report.write(args.out, results, markdown=table([{"measure": k, "value": v} for k, v in results.items()]))


if __name__ == "__main__":
    main()
