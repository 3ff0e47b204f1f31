"""The default job against every fixed configuration, as whole jobs: `python -m jobs.generate`, interleaved.

    python scripts/bench_jobs.py                                   # both settings, the full grid, 3 rounds
    python scripts/bench_jobs.py --settings single --rounds 2 --out bench_out/jobs
    python scripts/bench_jobs.py --select-from benchmarks/results/planner_jobs/runs.json --rounds 3 --top 3
                                   # the best fixed chosen on an earlier run's round 1; every round here scores

Each run is the real job in a fresh process (`python -m jobs.generate`, a fresh output directory, MLflow
off, progress bar off) on the embedded pair; its throughput is the job's own `throughput_tokens_per_s`
(the summary's `throughput` line: generated tokens over this run's generation time, Ray's start and model
loading excluded). Settings:

- `default`: the `make run` defaults (64 prompts, a local Ray with one actor per CPU, `spectr.batch_size=8`);
- `single`: one actor, `spectr.batch_size=1`, 10 prompts (where speculation pays on this CPU).

Configurations: `auto` cold (the default; a fresh user cache directory per run, so it starts from nothing),
`auto-warm` (one cache directory shared by the runs of a setting: the warm start a later job gets), and
the fixed grid autoregressive, speculative L=1..4, block L=2..4, spectr K in {2,4} x L in {2,3,4}. Round 1
runs every configuration; later rounds run auto, auto-warm, autoregressive and the `--top` best fixed
configurations of round 1, in a shuffled order per round (interleaved, so that the machine's drift hits
all of them alike). Round 1 chooses the best fixed configuration; with more rounds every configuration
is scored by its median over the later rounds only (no winner's curse), and `paired_*` ratios take the
median over those rounds of the two configurations' ratio within one round. The report gives, per
setting: auto / the best fixed configuration, auto / autoregressive, and auto's `planner_wasted_s` as a
share of its generation time (goals: >= 0.95, >= 1.0 (> 1.0 for `single`), <= 3%).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT / "scripts"))
from harness import Report, job_summary, summary, table  # noqa: E402

SETTINGS = {
    "default": [],
    "single": ["ray.num_actors=1", "spectr.batch_size=1", "data.limit=10"],
}
FIXED = (
    ["autoregressive"]
    + [f"speculative L={n}" for n in (1, 2, 3, 4)]
    + [f"block L={n}" for n in (2, 3, 4)]
    + [f"spectr K={k} L={n}" for k in (2, 4) for n in (2, 3, 4)]
)
AUTO = ("auto", "auto-warm")


def overrides(config: str) -> list[str]:
    """Hydra overrides that run one configuration label."""
    if config in AUTO:
        return ["spectr.method=auto"]
    method, *rest = config.split()
    values = dict(part.split("=") for part in rest)
    found = [f"spectr.method={method}"]
    if "K" in values:
        found.append(f"spectr.num_drafts={values['K']}")
    if "L" in values:
        found.append(f"spectr.draft_length={values['L']}")
    return found


def run_job(setting: str, config: str, workdir: Path, warm_cache: Path, timeout_s: float) -> dict[str, object]:
    """One whole job in a fresh process; its summary's numbers."""
    output = Path(tempfile.mkdtemp(prefix="job-", dir=workdir))
    cache = warm_cache if config == "auto-warm" else Path(tempfile.mkdtemp(prefix="cache-", dir=workdir))
    command = [sys.executable, "-m", "jobs.generate", *SETTINGS[setting], *overrides(config),
               f"output_dir={output}", "mlflow.enabled=false", "progress=false"]
    env = {**os.environ, "SPECTR_CACHE_DIR": str(cache)}
    started = time.perf_counter()
    done = subprocess.run(command, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    record: dict[str, object] = {"setting": setting, "config": config, "returncode": done.returncode,
                                 "wall_s": time.perf_counter() - started, **job_summary(done.stdout)}
    if done.returncode != 0 or "throughput_tokens_per_s" not in record:
        record["error"] = (done.stderr or done.stdout)[-2000:]
    return record


def report(records: list[dict[str, object]]) -> dict[str, dict[str, object]]:
    """Per setting: each configuration's median throughput, and auto's ratios and wasted share.

    With more than one round, the best fixed configuration is chosen on round 1 and its throughput (and
    everyone's) is the median over the later rounds only: choosing the best of 14 noisy runs and scoring it on
    the same runs would credit it with its luck (the winner's curse). `paired` gives the median over the later
    rounds of auto / the best fixed in the same round (the machine's drift between rounds cancels)."""
    found: dict[str, dict[str, object]] = {}
    for setting in sorted({str(r["setting"]) for r in records}):
        mine = [r for r in records if r["setting"] == setting and "throughput_tokens_per_s" in r]
        first_round = min(int(r.get("round", 1)) for r in mine)
        held_out = [r for r in mine if int(r.get("round", 1)) > first_round]
        scored = held_out or mine
        first = {str(r["config"]): float(r["throughput_tokens_per_s"]) for r in mine
                 if int(r.get("round", 1)) == first_round}
        medians = {config: summary(float(r["throughput_tokens_per_s"]) for r in scored if r["config"] == config)["median"]
                   for config in sorted({str(r["config"]) for r in scored})}
        fixed = {config: value for config, value in medians.items() if config not in AUTO}
        chosen = {config: value for config, value in first.items() if config in fixed} if held_out else fixed
        best = max(chosen, key=chosen.get) if chosen else None
        entry: dict[str, object] = {"median_tokens_per_s": medians, "best_fixed": best,
                                    "scored_rounds": sorted({int(r.get("round", 1)) for r in scored})}
        for config in AUTO:
            runs = [r for r in mine if r["config"] == config]
            if not runs or best is None or config not in medians:
                continue
            wasted = sum(float(r.get("planner_wasted_s", 0.0)) for r in runs)
            generation = sum(float(r.get("generation_s", 0.0)) for r in runs)
            entry[config] = {
                "over_best_fixed": medians[config] / fixed[best],
                "over_autoregressive": medians[config] / fixed["autoregressive"] if "autoregressive" in fixed else None,
                "paired_over_best_fixed": _paired(scored, config, best),
                "paired_over_autoregressive": _paired(scored, config, "autoregressive"),
                "wasted_share": wasted / generation if generation else 0.0,
                "method_lines": [r.get("method_line", "") for r in runs],
            }
        found[setting] = entry
    return found


def _paired(records: list[dict[str, object]], config: str, other: str) -> float | None:
    """Median over rounds of config / other, both from the same round."""
    by_round: dict[int, dict[str, float]] = {}
    for r in records:
        by_round.setdefault(int(r.get("round", 1)), {})[str(r["config"])] = float(r["throughput_tokens_per_s"])
    ratios = [runs[config] / runs[other] for runs in by_round.values() if config in runs and other in runs]
    return summary(ratios)["median"] if ratios else None


def rounds_plan(round_index: int, records: list[dict[str, object]], setting: str, top: int) -> list[str]:
    """Round 1: every configuration; later rounds: auto, auto-warm, autoregressive and the best fixed ones."""
    if round_index == 0 and not any(r["setting"] == setting for r in records):
        return [*AUTO, *FIXED]
    first_round = min((int(r.get("round", 1)) for r in records if r["setting"] == setting), default=1)
    firsts = {str(r["config"]): float(r["throughput_tokens_per_s"]) for r in records
              if r["setting"] == setting and "throughput_tokens_per_s" in r and str(r["config"]) in FIXED
              and int(r.get("round", 1)) == first_round}
    ranked = sorted(firsts, key=firsts.get, reverse=True)
    return list(dict.fromkeys([*AUTO, "autoregressive", *ranked[:top]]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default="default,single")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--top", type=int, default=3, help="fixed configurations re-run after round 1")
    parser.add_argument("--configs", default=None, help="comma-separated labels instead of the grid (every round)")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--out", default="benchmarks/results/planner_jobs")
    parser.add_argument("--select-from", default=None,
                        help="runs.json of an earlier run: its round 1 chooses the best fixed configurations, "
                             "and every round of this run scores them (held-out selection, no full grid here)")
    args = parser.parse_args()
    run_report = Report("bench_jobs", args=args)
    print(run_report.header(), flush=True)
    out = PROJECT_ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    settings = args.settings.split(",")
    rng = random.Random(0)
    records: list[dict[str, object]] = []
    if args.select_from:  # the earlier run's round 1, relabelled round 0: selection only, never scored
        earlier = json.loads(Path(args.select_from).read_text())
        records = [{**r, "round": 0, "selection_from": args.select_from} for r in earlier
                   if r.get("round") == 1 and r.get("setting") in settings]
    with tempfile.TemporaryDirectory(prefix="bench-jobs-") as tmp:
        workdir = Path(tmp)
        warm = {setting: Path(tempfile.mkdtemp(prefix=f"warm-{setting}-", dir=workdir)) for setting in settings}
        for round_index in range(args.rounds):
            queue = [(setting, config) for setting in settings
                     for config in (args.configs.split(",") if args.configs else
                                    rounds_plan(round_index, records, setting, args.top))]
            rng.shuffle(queue)
            for setting, config in queue:
                record = {"round": round_index + 1, **run_job(setting, config, workdir, warm[setting], args.timeout_s)}
                records.append(record)
                print(json.dumps({k: v for k, v in record.items() if k != "error"}), flush=True)
                if "error" in record:
                    print(record["error"], file=sys.stderr, flush=True)
                (out / "runs.json").write_text(json.dumps(records, indent=1))
    result = {"report": report(records), "runs": records}
    rows = [{"setting": setting, "config": config, "median_tokens_per_s": value}
            for setting, entry in result["report"].items() for config, value in entry["median_tokens_per_s"].items()]
    run_report.write(out / "result.json", result, markdown=table(rows))
    print(json.dumps(result["report"], indent=1))


if __name__ == "__main__":
    main()
