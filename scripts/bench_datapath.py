"""The data path at scale: driver peak memory and time to the first finished shard at 10k, 100k and 1M prompts,
and rows/s of the data path alone (planning; a worker's read, tokenize and write without the model).

    python scripts/bench_datapath.py                                  # 10k, 100k, 1M prompts
    python scripts/bench_datapath.py --sizes 10000 100000 --window 5 --out bench_out/datapath.json

Each size is the real job, `python -m jobs.generate` in a fresh process on a fresh local Ray, on a JSON-lines
file of that many prompts, with a tiny random model pair (built here) and 1 new token per prompt
(`spectr.max_new_tokens=1`, default `shard_size`, MLflow off). The script polls the commit log for the
first finished shard, lets the job run `--window` more seconds, then stops it (SIGINT, then SIGKILL of its
process group) and reads the driver's peak resident memory (VmHWM in /proc: the driver process only, not
Ray's processes or the actors). Goals: peak memory within 100 MB from the smallest to the largest size;
first shard within 30 s at 1M prompts.

The data path alone runs in this process on one core: planning (`scan_source`: one pass over the file,
row counts, shard offsets, id checks), then `--shards` shards read, tokenized and written as part files
(rows with a one-token completion; no model) as a worker does.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(PROJECT_ROOT / "tests"))  # the tiny random pair the tests use (last: no shadowing)

from tiny_pair_support import WORDS, build_llama, build_tokenizer  # noqa: E402

from pipeline.config import DataConfig  # noqa: E402

sys.path.insert(0, str(PROJECT_ROOT / "scripts"))
from harness import Report, table  # noqa: E402


def build_pair(folder: Path) -> dict[str, Path]:
    pair = {"target": folder / "target", "draft": folder / "draft"}
    tokenizer = build_tokenizer(WORDS, pair["target"])
    build_tokenizer(WORDS, pair["draft"])
    build_llama(pair["target"], len(tokenizer), hidden=32, layers=2, seed=1, max_positions=128)
    build_llama(pair["draft"], len(tokenizer), hidden=16, layers=1, seed=2, max_positions=128)
    return pair


def write_prompts(path: Path, count: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(count):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
            f.write(f'{{"id": "p{i:08d}", "prompt": "{words}"}}\n')


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def first_commit(out: Path) -> bool:
    log = out / "_commits.jsonl"
    return log.exists() and log.stat().st_size > 0


def run_job(pair: dict[str, Path], data: Path, out: Path, window: float, timeout: float) -> dict:
    command = [
        sys.executable, "-m", "jobs.generate", f"model.target={pair['target']}", f"model.draft={pair['draft']}",
        f"data.path={data}", "data.limit=null", f"output_dir={out}", "spectr.max_new_tokens=1",
        "mlflow.enabled=false", "progress=false",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(PROJECT_ROOT))
    started = time.monotonic()
    log_path = out.parent / f"{out.name}.log"
    with open(log_path, "w") as log:
        job = subprocess.Popen(command, cwd=PROJECT_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)  # fmt: skip
        first = None
        try:
            while time.monotonic() - started < timeout and job.poll() is None:
                if first is None and first_commit(out):
                    first = time.monotonic() - started
                if first is not None and time.monotonic() - started > first + window:
                    break
                time.sleep(0.05)
            peak = peak_rss_mb(job.pid) if job.poll() is None else float("nan")
        finally:
            _stop(job)
    text = log_path.read_text()
    planned = " | ".join(
        line.strip() for line in text.splitlines() if any(k in line for k in ("checked config", "ray ready", "actors loaded"))
    )
    shards = len((out / "_commits.jsonl").read_text().splitlines()) if first_commit(out) else 0
    return {"first_shard_s": first, "driver_peak_rss_mb": peak, "shards_done": shards, "driver_log": planned}


def _stop(job: subprocess.Popen) -> None:
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGINT)
        try:
            job.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def data_path_alone(pair: dict[str, Path], data: Path, out: Path, shards: int) -> dict:
    """Planning rows/s, and a worker's read + tokenize + write rows/s (no model), in this process."""
    from pipeline import fs
    from pipeline.generate.output import output_schema, write_shard
    from pipeline.generate.shards import load_shard, shard_task
    from pipeline.models import load_tokenizer
    from pipeline.prompts import ReadCache
    from pipeline.readers import scan_source
    from pipeline.source import list_source

    config = DataConfig(path=str(data))
    started = time.perf_counter()
    source = scan_source(config, list_source(config), 16)
    plan_s = time.perf_counter() - started
    tokenizer = load_tokenizer(pair["target"], "model.target", False)
    schema, cache, location = output_schema(source.id_kind), ReadCache(), fs.resolve(str(out), "output_dir")
    fs.make_dirs(location)
    rows = 0
    started = time.perf_counter()
    for index in range(0, source.num_rows // 16, max(1, source.num_rows // 16 // shards))[:shards]:
        shard = load_shard(shard_task(index, source.num_rows, 16), source, tokenizer, config, 0, cache)
        written = [_row(shard, i) for i in range(len(shard))]
        write_shard(location, index, written, schema, 6)
        rows += len(written)
    worker_s = time.perf_counter() - started
    return {"plan_rows_per_s": source.num_rows / plan_s, "plan_s": plan_s, "worker_rows_per_s": rows / worker_s,
            "worker_rows": rows}  # fmt: skip


def _row(shard, i: int) -> dict:
    return {
        "id": shard.ids[i], "prompt": shard.prompts[i], "completion": "x", "completion_token_ids": [5],
        "prompt_tokens": len(shard.prompt_token_ids[i]), "completion_tokens": 1, "finish_reason": "length",
        "target_calls": 1, "block_efficiency": 1.0, "seed": shard.seeds[i], "error": None,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--window", type=float, default=5.0, help="seconds the job runs after its first shard")
    parser.add_argument("--timeout", type=float, default=180.0, help="per job, before giving up")
    parser.add_argument("--shards", type=int, default=200, help="shards of the worker data path alone")
    parser.add_argument("--out", type=Path, default=Path("bench_out/datapath.json"))
    args = parser.parse_args()
    run_report = Report("datapath", args=args)
    print(run_report.header(), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_datapath_") as tmp:
        folder = Path(tmp)
        pair = build_pair(folder / "pair")
        results = {"sizes": {}}
        for size in args.sizes:
            data = folder / f"prompts_{size}.jsonl"
            write_prompts(data, size)
            results["sizes"][size] = run_job(pair, data, folder / f"out_{size}", args.window, args.timeout)
            print(size, json.dumps(results["sizes"][size]), flush=True)
        largest = folder / f"prompts_{max(args.sizes)}.jsonl"
        results["data_path_alone"] = data_path_alone(pair, largest, folder / "alone", args.shards)
    report(results, args, run_report)


def report(results: dict, args: argparse.Namespace, run_report: Report) -> None:
    sizes = results["sizes"]
    print("\nprompts     first shard   driver peak RSS   shards done")
    for size, r in sizes.items():
        first = f"{r['first_shard_s']:.1f} s" if r["first_shard_s"] is not None else "none"
        print(f"{size:>9,}   {first:>11}   {r['driver_peak_rss_mb']:>12.0f} MB   {r['shards_done']:>11}")
    peaks = [r["driver_peak_rss_mb"] for r in sizes.values()]
    spread = max(peaks) - min(peaks)
    largest = sizes[max(sizes)]
    alone = results["data_path_alone"]
    print(f"\nplanning alone: {alone['plan_rows_per_s']:,.0f} rows/s ({alone['plan_s']:.1f} s for {max(sizes):,} rows)")
    print(f"worker data path alone (read + tokenize + write, no model): {alone['worker_rows_per_s']:,.0f} rows/s")
    print(f"{'PASS' if spread <= 100 else 'MISS'} driver peak memory flat: {spread:.0f} MB from "
          f"{min(sizes):,} to {max(sizes):,} prompts (goal <= 100 MB)")  # fmt: skip
    first = largest["first_shard_s"]
    print(f"{'PASS' if first is not None and first <= 30 else 'MISS'} first shard at {max(sizes):,} prompts: "
          f"{first if first is None else round(first, 1)} s (goal <= 30 s)")  # fmt: skip
    rows = [{"prompts": size, **r} for size, r in sizes.items()]
    run_report.write(args.out, results, markdown=table(rows) + "\n" + table([alone]))


if __name__ == "__main__":
    main()
