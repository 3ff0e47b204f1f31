"""Time to first row: the default job's startup against the floor, whole processes, interleaved.

    python scripts/bench_startup.py                          # 3 pairs: floor, job, floor, job, ...
    python scripts/bench_startup.py --pairs 4 --out benchmarks/results/startup/after.json
    python scripts/bench_startup.py -- data.limit=16         # extra Hydra overrides for the job
    python scripts/bench_startup.py --before /tmp/old-tree   # also the job of another tree (a `git archive`)

The floor is what no job can go under: a fresh Python process that starts a bare local Ray, and one actor
(`ShardGenerator`, the job's own actor class, so it imports what the job's actors import) that loads the
embedded pair; its time runs from spawning the process to the actor's `ready()` answer. The job is the
default job as `make run` starts it (`python -m jobs.generate`, no overrides but a fresh MLflow store and
output directory per run); its time runs from spawning the process to its "actors loaded the pair" line,
read as the line arrives. Both also give their own figures: the job its startup phase line and wall time,
the floor its `ray.init` and actor seconds. Runs alternate floor, job, floor, job, ... so that a drifting
machine load hits both alike; the load average is recorded with each sample. With `--before DIR`, each round
also runs the job from that tree (same interpreter, `PYTHONPATH=DIR`), the two jobs' order swapped every
other round: floor, job, before, floor, before, job, ... Time it alone:
`flock /tmp/timing.lock python scripts/bench_startup.py ...` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from harness import Report, load_average, summary, table  # noqa: E402

LOADED_LINE = "actors loaded the pair"
STARTUP_LINE = re.compile(r"^startup (?P<total>[0-9.]+) s = (?P<parts>.*?)( \(mlflow start (?P<mlflow>[0-9.]+) s.*)?$")


def floor_process() -> None:
    """The floor, run in a fresh process (`--as-floor`): a bare local Ray, one actor loading the pair."""
    started = time.perf_counter()
    import ray

    from pipeline.config import ModelConfig
    from pipeline.generate.config import SpectrConfig
    from pipeline.generate.worker import ShardGenerator

    imported = time.perf_counter()
    ray.init(include_dashboard=False, logging_level="WARNING")
    ray_ready = time.perf_counter()
    model = ModelConfig(target=str(ROOT / "assets/models/target"), draft=str(ROOT / "assets/models/draft"))
    actor = ray.remote(ShardGenerator).options(num_cpus=1).remote(model, SpectrConfig(), 1, "cpu")
    ready = ray.get(actor.ready.remote())
    loaded = time.perf_counter()
    print(json.dumps({"floor": {"imports_s": imported - started, "ray_init_s": ray_ready - imported,
                                "actor_s": loaded - ray_ready, "actor_load_s": ready["startup"]["load_s"],
                                "in_process_s": loaded - started}}), flush=True)
    ray.shutdown()


def run_floor(python: str) -> dict:
    """The floor in a fresh process; its time to the actor's answer, read as the process prints it."""
    seconds, total_s, lines = _timed_process([python, __file__, "--as-floor"], '{"floor"')
    own = json.loads(next(line for line in lines if line.startswith('{"floor"')))["floor"]
    return {"kind": "floor", "startup_s": seconds, "process_s": total_s, **own}


def run_job(python: str, work: Path, name: str, overrides: list[str], tree: Path = ROOT) -> dict:
    """The default job in a fresh process; its time to the "actors loaded" line, read as the line arrives."""
    run_dir = work / name
    run_dir.mkdir(parents=True)
    command = [python, "-m", "jobs.generate", f"output_dir={run_dir / 'out'}",
               f"mlflow.tracking_uri=sqlite:///{run_dir / 'mlflow.db'}", *overrides]
    seconds, total_s, lines = _timed_process(command, LOADED_LINE, tree)
    sample = {"kind": "job" if tree == ROOT else "before", "startup_s": seconds, "process_s": total_s}
    for line in lines:
        match = STARTUP_LINE.match(line)
        if match:
            sample.update(startup_line=line, job_startup_s=float(match["total"]))
            sample.update({f"{name.replace(' ', '_')}_s": float(value)
                           for name, value in re.findall(r"([a-z ]+?) ([0-9.]+)(?: \+|$)", match["parts"])})
            if match["mlflow"]:
                sample["mlflow_start_s"] = float(match["mlflow"])
            break
    sample["output"] = [line for line in lines if not line.startswith(" ")][:12]
    return sample


def _timed_process(command: list[str], marker: str, tree: Path = ROOT) -> tuple[float, float, list[str]]:
    """(seconds from the spawn to the first line holding `marker`, seconds to the process's end, its lines)."""
    env = _env() if tree == ROOT else dict(_env(), PYTHONPATH=str(tree))
    spawned = time.perf_counter()
    process = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, bufsize=1)
    seen, lines = None, []
    for line in process.stdout:
        lines.append(line.rstrip("\n"))
        if seen is None and marker in line:
            seen = time.perf_counter() - spawned
    code = process.wait()
    total_s = time.perf_counter() - spawned
    if code or seen is None:
        raise RuntimeError(f"{' '.join(command[:3])} failed ({code}) or never printed {marker!r}:\n"
                           + "\n".join(lines[-40:]))
    return seen, total_s, lines


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="(floor, job) pairs, run alternately")
    parser.add_argument("--out", type=Path, default=Path("bench_out/startup.json"))
    parser.add_argument("--before", type=Path, help="another tree whose job also runs in each round")
    parser.add_argument("--as-floor", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for the job (the default job: none)")
    args = parser.parse_args()
    if args.as_floor:
        floor_process()
        return
    python = sys.executable
    report = Report("startup", args=args)
    print(report.header(), flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench_startup_"))
    samples = []
    for pair in range(args.pairs):
        jobs = ["job", "before"] if args.before else ["job"]
        for kind in ["floor", *(jobs if pair % 2 == 0 else jobs[::-1])]:
            load = load_average()[0]
            if kind == "floor":
                sample = run_floor(python)
            else:
                sample = run_job(python, work, f"{kind}{pair}", args.overrides, args.before if kind == "before" else ROOT)
            sample.update(pair=pair, load_before=load, load_after=load_average()[0])
            samples.append(sample)
            print(f"{kind:6s} {sample['startup_s']:6.1f} s  load {load:.2f}"
                  + (f"  {sample.get('startup_line', '')}" if kind != "floor" else ""), flush=True)
    floors = [s["startup_s"] for s in samples if s["kind"] == "floor"]
    jobs = [s["startup_s"] for s in samples if s["kind"] == "job"]
    before = [s["startup_s"] for s in samples if s["kind"] == "before"]
    result = {
        "intervals_s": {kind: summary(s["startup_s"] for s in samples if s["kind"] == kind)
                        for kind in ("floor", "job", "before") if any(s["kind"] == kind for s in samples)},
        "floor_median_s": statistics.median(floors),
        "job_median_s": statistics.median(jobs),
        "ratio": statistics.median(jobs) / statistics.median(floors),
        "pair_ratios": [j / f for f, j in zip(floors, jobs)],
        **({"before": str(args.before), "before_median_s": statistics.median(before),
            "before_ratio": statistics.median(before) / statistics.median(floors)} if before else {}),
        "samples": samples,
    }
    report.write(args.out, result, markdown=table([{"kind": k, **v} for k, v in result["intervals_s"].items()]))
    print(f"floor {result['floor_median_s']:.1f} s, job {result['job_median_s']:.1f} s (medians): "
          f"{result['ratio']:.2f}x the floor" + (f"; before {result['before_median_s']:.1f} s: "
                                                 f"{result['before_ratio']:.2f}x" if before else "") + f"; {args.out}")


if __name__ == "__main__":
    main()
