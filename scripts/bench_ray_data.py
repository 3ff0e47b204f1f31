"""The Ray Data stage against the Hydra job: the same prompts, pair, settings and number of actors, interleaved.

    python scripts/bench_ray_data.py                          # 256 prompts, 2 actors, spectr K=2 L=3, 3 rounds
    python scripts/bench_ray_data.py --prompts 16 --max-new-tokens 8 --rounds 1 --shard-size 8   # a check

Each round runs, in a shuffled order, each side in a fresh process:
- `job`: `python -m jobs.generate` on the embedded pair (MLflow off, progress off), `ray.num_actors=N`,
  `ray.cpus_per_actor=C`, `shard_size` rows per shard;
- `stage`: this script's `stage` command: a local Ray (the actors' CPUs and one more, for Ray Data's own
  tasks), `ray.data.read_parquet` of the file as a user would (no block settings) -> `pipeline.ray_data`'s
  stage with its defaults (`concurrency=(N, N)`, a fixed pool as the job's, `num_cpus=C`, `batch_size` = the job's shard size) ->
  `write_parquet`. Its actor is `SpecTrStage` with a timeline (`TimedStage`: when it was ready, and each
  batch's end with the engine's iteration count), written to a folder and read back here.

Both sides' figures are measured the same way:
- wall clock: generated tokens over the whole process (start, Ray, model loading, generation, writing);
- generation: generated tokens over the seconds from the last actor ready (loaded the pair) to the last row
  written: the job's own `throughput` line (actors ready -> last part committed); the stage's from its
  actors' ready times to `write_parquet` returning (Ray Data hands the first actor work before the second is
  ready, so this slightly favours the stage; the wall clock does not);
- slots: the engine's mean rows in flight per iteration (the rows' target calls over the actors' engine
  iterations; `--batch-size` means every slot full), whether the slots stay full across shard or batch
  boundaries.
Both read the same Parquet file (the first `--prompts` rows of assets/prompts.jsonl, repeated if needed,
with unique ids); a row's seed is the job's (`row_seed(spectr.seed, id)`) on both sides. The report counts
the rows whose tokens differ between the stage and the job, and, as the control, between two runs of the
job itself: a row's logits depend on its batch at the level of float rounding (a CPU matmul's result for
one row changes with the number of rows in the call), so a sampled token at a near-tie can flip with the
batch's composition, in either side and between two runs of the same side (about 1 token in 16,000 on
the embedded pair); equal settings show as differences no more frequent than the job's own.

The report: each side's median over the rounds (wall clock and generation tokens/s, slots) and the ratio
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
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]
PAIR = PROJECT_ROOT / "assets" / "models"
sys.path.insert(0, str(PROJECT_ROOT))  # this checkout's code (TimedStage subclasses its stage)

from pipeline.ray_data.stage import SpecTrStage  # noqa: E402

sys.path.insert(0, str(PROJECT_ROOT / "scripts"))
from harness import Report, interleaved, ratio_summary, table  # noqa: E402


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


def run_job(args: argparse.Namespace, data: Path, out: Path) -> dict[str, Any]:
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
    commits = [json.loads(line)["stats"] for line in (out / "_commits.jsonl").read_text().splitlines()]
    calls, iterations = sum(c["target_calls"] for c in commits), sum(c["iterations"] for c in commits)
    tokens = output_tokens(out, "completion_token_ids", "id")
    return {"tokens_per_s": float(found.group(1)) if found else float("nan"), "wall_s": wall,
            "generated_tokens": sum(len(t) for t in tokens.values()), "slots": calls / max(iterations, 1),
            "tokens": tokens}


def run_stage(args: argparse.Namespace, data: Path, out: Path) -> dict[str, Any]:
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


class TimedStage(SpecTrStage):
    """`SpecTrStage` with a timeline: one JSON line per event in `events_dir/<pid>.jsonl` (the actor ready;
    each batch's end, with the engine's iterations so far). Pickled by value with the class attribute set."""

    events_dir = ""

    def __init__(self, config: Any):
        import psutil

        self._events = open(Path(self.events_dir) / f"{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115
        self._events.write(json.dumps({"event": "process", "time": psutil.Process().create_time()}) + "\n")
        self._event("init")  # Ray Data calls the constructor: the stage's own loading starts
        super().__init__(config)
        self._event("ready")

    def _event(self, name: str, **values: Any) -> None:
        self._events.write(json.dumps({"event": name, "time": time.time(), **values}) + "\n")

    def generate(self, batch: Any) -> Any:
        out = super().generate(batch)
        self._event("batch", rows=len(out), iterations=self.generator.feed.steps)
        return out


def stage_command(argv: list[str]) -> None:
    """In a fresh process: the Ray Data pipeline; prints one JSON line (tokens, generation seconds, slots)."""
    parser = argparse.ArgumentParser()
    for name in ("--data", "--out", "--engine"):
        parser.add_argument(name, required=True)
    parser.add_argument("--actors", type=int, required=True)
    parser.add_argument("--cpus-per-actor", type=float, required=True)
    parser.add_argument("--batch-rows", type=int, required=True)
    args = parser.parse_args(argv)
    import psutil
    import pyarrow.parquet as pq
    import ray

    from pipeline.ray_data import SpecTrProcessorConfig, build_processor

    events = Path(f"{args.out}-events")
    events.mkdir(parents=True)
    TimedStage.events_dir = str(events)
    # the actors' CPUs, and one more for Ray Data's read, repartition and write tasks
    started = psutil.Process().create_time()
    ray.init(num_cpus=int(args.actors * args.cpus_per_actor) + 1, include_dashboard=False, log_to_driver=False)
    ray_ready = time.time()
    config = SpecTrProcessorConfig(model_source=str(PAIR / "target"), draft_model_source=str(PAIR / "draft"),
                                   batch_size=args.batch_rows, num_cpus=args.cpus_per_actor,
                                   concurrency=(args.actors, args.actors),  # a fixed pool, as the job's (n: 1..n)
                                   engine_kwargs=json.loads(args.engine))
    processor = build_processor(config)
    processor.stage_class = TimedStage
    processor(ray.data.read_parquet(args.data)).write_parquet(args.out)
    finished = time.time()
    ray.shutdown()
    timeline = [[json.loads(line) for line in path.read_text().splitlines()] for path in sorted(events.iterdir())]
    print_timeline(timeline, started, ray_ready, finished)
    ready = max(e["time"] for actor in timeline for e in actor if e["event"] == "ready")
    iterations = sum(max([e["iterations"] for e in actor if e["event"] == "batch"], default=0) for actor in timeline)
    table = pq.read_table(args.out, columns=["num_generated_tokens", "target_calls"])
    tokens = sum(table.column("num_generated_tokens").to_pylist())
    calls = sum(table.column("target_calls").to_pylist())
    print(json.dumps({"tokens_per_s": tokens / (finished - ready), "generation_s": finished - ready,
                      "generated_tokens": tokens, "slots": calls / max(iterations, 1),
                      "batches_per_actor": [sum(e["event"] == "batch" for e in actor) for actor in timeline]}))


def print_timeline(timeline: list[list[dict]], started: float, ray_ready: float, finished: float) -> None:
    """Seconds from the stage process's start (on stderr): Ray up, each actor's process start, constructor
    start, ready and batch ends, and the pipeline's end."""
    lines = [f"ray up {ray_ready - started:.1f}"]
    for actor in timeline:
        marks = [f"{e['event']} {e['time'] - started:.1f}" for e in actor]
        lines.append("actor: " + ", ".join(marks))
    lines.append(f"finished {finished - started:.1f}")
    print("timeline (s from the start): " + "; ".join(lines), file=sys.stderr)


def differing(a: dict[str, list[int]], b: dict[str, list[int]]) -> int:
    """Rows (by id) whose tokens differ between two runs (a row missing from either counts)."""
    return sum(a.get(key) != b.get(key) for key in set(a) | set(b))


def report(results: dict[str, list[dict]]) -> list[tuple]:
    rows = []
    for side in ("job", "stage"):
        runs = results[side]
        rows.append((side, statistics.median(r["generated_tokens"] / r["wall_s"] for r in runs),
                     statistics.median(r["wall_s"] for r in runs), statistics.median(r["tokens_per_s"] for r in runs),
                     statistics.median(r["slots"] for r in runs)))
    print(f"{'side':<6} {'wall tok/s':>11} {'wall s':>8} {'generation tok/s':>17} {'slots':>6}")
    for side, wall, seconds, generation, slots in rows:
        print(f"{side:<6} {wall:>11.1f} {seconds:>8.1f} {generation:>17.1f} {slots:>6.2f}")
    (_, job_wall, _, job_gen, _), (_, stage_wall, _, stage_gen, _) = rows
    print(f"stage / job: wall clock {stage_wall / job_wall:.3f}x (goal >= 0.9x), generation {stage_gen / job_gen:.3f}x")
    jobs, stages = results["job"], results["stage"]
    print("rows whose tokens differ, stage vs job in each round:",
          ", ".join(str(differing(j["tokens"], s["tokens"])) for j, s in zip(jobs, stages)),
          f"of {len(jobs[0]['tokens'])}; the control, job vs job (round 1 vs each later round):",
          ", ".join(str(differing(jobs[0]["tokens"], j["tokens"])) for j in jobs[1:]) or "none (one round)")
    print("stage batches per actor:", "; ".join(str(s["batches_per_actor"]) for s in stages))
    return rows


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
    parser.add_argument("--out", type=Path, help="write the report here (.json and .md)")
    args = parser.parse_args()
    run_report = Report("ray_data", args=args)
    print(run_report.header(), flush=True)
    folder = Path(tempfile.mkdtemp(prefix="bench_ray_data_"))
    data = folder / "prompts.parquet"
    write_prompts(data, args.prompts)
    done = {"job": 0, "stage": 0}

    def side_run(side: str) -> dict:
        done[side] += 1
        run = run_job if side == "job" else run_stage
        return run(args, data, folder / f"{side}-{done[side] - 1}")

    def progress(round_index: int, side: str, last: dict) -> None:
        print(f"round {round_index + 1} {side}: {last['generated_tokens'] / last['wall_s']:.1f} wall-clock tokens/s "
              f"({last['wall_s']:.1f} s), generation {last['tokens_per_s']:.1f} tokens/s, slots {last['slots']:.2f}",
              flush=True)

    results = interleaved({side: (lambda side=side: side_run(side)) for side in ("job", "stage")},
                          rounds=args.rounds, shuffle=random.Random(args.seed), on_run=progress)
    rows = report(results)
    if args.out:
        medians = [dict(zip(("side", "wall_tokens_per_s", "wall_s", "generation_tokens_per_s", "slots"), row))
                   for row in rows]
        paired = ratio_summary(results["stage"], results["job"], "tokens_per_s")
        kept = {side: [{k: v for k, v in r.items() if k != "tokens"} for r in runs] for side, runs in results.items()}
        run_report.write(args.out, {"medians": medians, "stage_over_job_generation": paired, "runs": kept},
                         markdown=table(medians) + f"\nstage / job generation (paired rounds): {paired}\n")

if __name__ == "__main__":
    main()
