"""The Ray Data stage against the Hydra job: the same prompts, pair, settings and number of actors, interleaved.

    python scripts/bench_ray_data.py                          # 256 prompts, 2 actors, spectr K=2 L=3, 3 rounds
    python scripts/bench_ray_data.py --prompts 16 --max-new-tokens 8 --rounds 1 --shard-size 8   # a check

Each round runs, in a shuffled order, each side in a fresh process:
- `job`: `python -m jobs.generate` on the embedded pair (MLflow off, progress off), `ray.num_actors=N`,
  `ray.cpus_per_actor=C`; its throughput is the job's own (the summary's `throughput` line: generated tokens
  over its generation time, Ray's start and model loading excluded);
- `stage`: this script's `stage` command: a local Ray, `ray.data.read_parquet` -> `pipeline.ray_data`'s stage
  (`concurrency=N`, `num_cpus=C`, `batch_size` = the job's shard size, the input cut into blocks of that
  many rows so that every actor gets work) -> `write_parquet`; its generation time runs from the first
  row admitted to the engine to the last row out of the stage (each row's `time_taken_llm` and the moment
  a postprocess saw it). The job's runs from its actors being ready to its last part committed, so it also
  holds the first shard's read and tokenizing and the part files' writes, which the stage's leaves out (a
  few milliseconds a batch; they matter only on tiny runs, where the fixed costs dominate both).
Both read the same Parquet file (the first `--prompts` rows of assets/prompts.jsonl, repeated if needed,
with unique ids); a row's seed is the job's (`row_seed(spectr.seed, id)`), so a fixed method gives both
the same tokens (the report says whether they did). Also the wall-clock throughput of each whole process
(start, Ray, model loading, generation, writing), measured here the same way for both.

The report: each side's median tokens/s over the rounds (generation and wall clock) and the ratio
stage / job (goal >= 0.9). Run it on a quiet machine; nothing else should share the CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
PAIR = PROJECT_ROOT / "assets" / "models"


def child_env() -> dict[str, str]:
    """This checkout's code first, for the job, the stage and their Ray workers (not an installed copy)."""
    paths = [str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def write_prompts(path: Path, count: int) -> None:
    """The first `count` prompts of assets/prompts.jsonl (repeated, with new ids, past its end) as Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = [json.loads(line) for line in (PROJECT_ROOT / "assets" / "prompts.jsonl").read_text().splitlines()]
    rows = [{"id": f"{source[i % len(source)]['id']}#{i // len(source)}" if i >= len(source) else source[i]["id"],
             "prompt": source[i % len(source)]["prompt"]} for i in range(count)]
    pq.write_table(pa.Table.from_pylist(rows), path)


def engine_overrides(args: argparse.Namespace) -> dict[str, object]:
    return {"method": args.method, "num_drafts": args.num_drafts, "draft_length": args.draft_length,
            "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens}


def run_job(args: argparse.Namespace, data: Path, out: Path) -> dict[str, float]:
    overrides = [f"spectr.{k}={v}" for k, v in engine_overrides(args).items()] + [
        f"model.target={PAIR / 'target'}", f"model.draft={PAIR / 'draft'}", f"data.path={data}",
        f"output_dir={out}", "data.limit=null", "mlflow=disabled", "progress=false", f"ray.num_actors={args.actors}",
        f"ray.cpus_per_actor={args.cpus_per_actor}", f"shard_size={args.shard_size}"]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "jobs.generate", *overrides], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, env=child_env())
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"the job failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    found = re.search(r"throughput\s+([\d.]+) tokens/s", done.stdout)
    tokens = output_tokens(out, "completion_token_ids", "id")
    return {"tokens_per_s": float(found.group(1)) if found else float("nan"), "wall_s": wall,
            "generated_tokens": sum(len(t) for t in tokens.values()), "tokens": tokens}


def run_stage(args: argparse.Namespace, data: Path, out: Path) -> dict[str, float]:
    command = [sys.executable, str(Path(__file__).resolve()), "stage", "--data", str(data), "--out", str(out),
               "--actors", str(args.actors), "--cpus-per-actor", str(args.cpus_per_actor),
               "--batch-rows", str(args.shard_size),
               "--engine", json.dumps(engine_overrides(args))]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, env=child_env())
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"the stage failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    tokens = output_tokens(out, "generated_tokens", "id")
    return {**result, "wall_s": wall, "tokens": tokens}


def output_tokens(out: Path, column: str, key: str) -> dict[str, list[int]]:
    import pyarrow.parquet as pq

    table = pq.read_table(out, columns=[key, column])
    return dict(zip(table.column(key).to_pylist(), table.column(column).to_pylist()))


def stage_command(argv: list[str]) -> None:
    """In a fresh process: the Ray Data pipeline; prints one JSON line (tokens, generation seconds)."""
    parser = argparse.ArgumentParser()
    for name in ("--data", "--out", "--engine"):
        parser.add_argument(name, required=True)
    parser.add_argument("--actors", type=int, required=True)
    parser.add_argument("--cpus-per-actor", type=float, required=True)
    parser.add_argument("--batch-rows", type=int, required=True)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(PROJECT_ROOT))
    import pyarrow.parquet as pq
    import ray

    from pipeline.ray_data import SpecTrProcessorConfig, build_processor

    # the actors' CPUs, and one more for Ray Data's read and write tasks
    ray.init(num_cpus=int(args.actors * args.cpus_per_actor) + 1, include_dashboard=False, log_to_driver=False)
    config = SpecTrProcessorConfig(model_source=str(PAIR / "target"), draft_model_source=str(PAIR / "draft"),
                                   batch_size=args.batch_rows, concurrency=args.actors, num_cpus=args.cpus_per_actor,
                                   engine_kwargs=json.loads(args.engine))
    processor = build_processor(config, postprocess=lambda row: {**row, "finished_at": time.time()})
    rows = pq.ParquetFile(args.data).metadata.num_rows
    # one small file is one block, i.e. one task for one actor: cut it into Ray Data batches for every actor
    dataset = ray.data.read_parquet(args.data, override_num_blocks=max(1, -(-rows // config.batch_size)))
    processor(dataset).write_parquet(args.out)
    table = pq.read_table(args.out, columns=["num_generated_tokens", "time_taken_llm", "finished_at"])
    finished, taken = table.column("finished_at").to_pylist(), table.column("time_taken_llm").to_pylist()
    span = max(finished) - min(f - t for f, t in zip(finished, taken))
    tokens = sum(table.column("num_generated_tokens").to_pylist())
    print(json.dumps({"tokens_per_s": tokens / span, "generation_s": span, "generated_tokens": tokens}))
    ray.shutdown()


def report(results: dict[str, list[dict]], same_tokens: bool) -> None:
    rows = []
    for side in ("job", "stage"):
        runs = results[side]
        rows.append((side, statistics.median(r["tokens_per_s"] for r in runs),
                     statistics.median(r["generated_tokens"] / r["wall_s"] for r in runs),
                     statistics.median(r["wall_s"] for r in runs)))
    print(f"{'side':<6} {'generation tok/s':>17} {'wall tok/s':>11} {'wall s':>8}")
    for side, generation, wall, seconds in rows:
        print(f"{side:<6} {generation:>17.1f} {wall:>11.1f} {seconds:>8.1f}")
    (_, job_gen, job_wall, _), (_, stage_gen, stage_wall, _) = rows
    print(f"stage / job: generation {stage_gen / job_gen:.3f}x, wall clock {stage_wall / job_wall:.3f}x "
          f"(goal >= 0.9x); same tokens for every row: {'yes' if same_tokens else 'no'}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "stage":
        stage_command(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--cpus-per-actor", type=int, default=1)
    parser.add_argument("--method", default="spectr")
    parser.add_argument("--num-drafts", type=int, default=2)
    parser.add_argument("--draft-length", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8, help="engine rows in flight per actor")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--shard-size", type=int, default=32, help="the job's rows per shard and the stage's rows per Ray Data batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="the order of the runs in each round")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench_ray_data_"))
    data = folder / "prompts.parquet"
    write_prompts(data, args.prompts)
    results: dict[str, list[dict]] = {"job": [], "stage": []}
    order = random.Random(args.seed)
    same = True
    for round_index in range(args.rounds):
        sides = ["job", "stage"]
        order.shuffle(sides)
        for side in sides:
            out = folder / f"{side}-{round_index}"
            run = run_job if side == "job" else run_stage
            results[side].append(run(args, data, out))
            print(f"round {round_index + 1} {side}: {results[side][-1]['tokens_per_s']:.1f} tokens/s", flush=True)
        same = same and results["job"][-1]["tokens"] == results["stage"][-1]["tokens"]
    report(results, same)


if __name__ == "__main__":
    main()
