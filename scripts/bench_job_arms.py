"""Whole default jobs against each other: arms that differ by Hydra overrides or by the code's tree, interleaved.

    python scripts/bench_job_arms.py --arm eager spectr.compile=false --arm compiled spectr.compile=true \
        --rounds 2 --cold-inductor --out benchmarks/results/compile/jobs/run
    python scripts/bench_job_arms.py --arm with --tree with=/tmp/trav/with --arm without \
        --tree without=/tmp/trav/without --rounds 3 --alternate

Each run is `python -m jobs.generate` in a fresh process (the `make run` defaults plus the arm's overrides,
a fresh output directory and SQLite MLflow store, progress off). `--tree NAME=DIR` runs that arm's job from
another checkout (`PYTHONPATH=DIR`, working directory DIR: e.g. a `git worktree` of another commit). Each arm
keeps its own SPECTR_CACHE_DIR across rounds (the plan cache's warm start, as a user's later jobs get);
`--env NAME=KEY=VALUE` sets an environment variable for that arm's jobs (`--env mkl=SPECTR_CPU_LINEAR=0`);
`--cold-inductor` gives every compiled arm a fresh TORCHINDUCTOR_CACHE_DIR on its first run (the compile a
fresh machine pays) and keeps it for later rounds. Rounds run the arms in the given order, or ABBA with
`--alternate`. Reported per arm: the job's own `throughput` line (generated tokens over its generation
time), its wall seconds, and medians with intervals over rounds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from harness import Report, interleaved, job_summary, summary, table  # noqa: E402


def run_job(name: str, overrides: list[str], tree: Path, work: Path, number: int, inductor: Path | None,
            extra_env: dict | None = None) -> dict:
    out = work / f"{name}-{number}"
    env = {"PYTHONPATH": str(tree), "SPECTR_CACHE_DIR": str(work / f"cache-{name}"), **(extra_env or {})}
    if inductor is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)
    command = [sys.executable, "-m", "jobs.generate", *overrides, f"output_dir={out}", "progress=false",
               f"mlflow.tracking_uri=sqlite:///{work}/mlflow-{name}.db", f"hydra.run.dir={work}/hydra-{name}-{number}"]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=tree, env={**os.environ, **env}, capture_output=True, text=True)
    record = {"arm": name, "round": number, "returncode": done.returncode, "wall_s": time.perf_counter() - started,
              **job_summary(done.stdout + done.stderr)}
    (work / f"{name}-{number}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        record["error"] = (done.stderr or done.stdout)[-2000:]
    return record


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", nargs="+", action="append", required=True, metavar="NAME [OVERRIDE ...]")
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=KEY=VALUE",
                        help="an environment variable for that arm's jobs (e.g. off=SPECTR_CPU_LINEAR=0)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--alternate", action="store_true", help="every other round in reverse order (ABBA)")
    parser.add_argument("--cold-inductor", action="store_true")
    parser.add_argument("--out", help="write <out>.json and .md (and keep the job logs beside them)")
    args = parser.parse_args(argv)
    report = Report("job_arms", argv=None if argv is None else [__file__, *argv], args=args)
    print(report.header(), flush=True)
    trees = dict(item.split("=", 1) for item in args.tree)
    envs: dict = {}
    for item in args.env:
        name, key, value = item.split("=", 2)
        envs.setdefault(name, {})[key] = value
    work = Path(args.out).with_suffix("") if args.out else Path(tempfile.mkdtemp(prefix="job_arms_"))
    work.mkdir(parents=True, exist_ok=True)
    rounds = {}

    def arm(name: str, overrides: list[str]) -> dict:
        rounds[name] = rounds.get(name, 0) + 1
        inductor = work / f"inductor-{name}" if args.cold_inductor else None
        if inductor is not None and rounds[name] == 1:
            shutil.rmtree(inductor, ignore_errors=True)  # cold on the first run, warm after
        return run_job(name, overrides, Path(trees.get(name, REPO)).resolve(), work, rounds[name], inductor,
                       envs.get(name))

    def progress(_round, name, record):
        print(f"round {record['round']} {name:<20} {record.get('throughput_tokens_per_s', 'failed')} tokens/s, "
              f"{record['wall_s']:.1f} s wall", flush=True)

    arms = {name: (lambda name=name, o=overrides: arm(name, o)) for name, *overrides in args.arm}
    runs = interleaved(arms, rounds=args.rounds, alternate=args.alternate, on_run=progress)
    rows = []
    for name, records in runs.items():
        ok = [r for r in records if "throughput_tokens_per_s" in r]
        speed = summary(r["throughput_tokens_per_s"] for r in ok) if ok else {}
        blocks = [r["block_efficiency"] for r in ok if "block_efficiency" in r]
        rows.append(dict(arm=name, tokens_per_s=speed.get("median"), low=speed.get("low"), high=speed.get("high"),
                         block_efficiency=summary(blocks)["median"] if blocks else None,
                         wall_s=summary(r["wall_s"] for r in records)["median"], runs=len(ok)))
    print(table(rows))
    if args.out:
        report.write(Path(args.out).with_suffix(".json"), dict(rows=rows, runs=runs), markdown=table(rows))


if __name__ == "__main__":
    main()
