"""Speed on a real model: SmolLM2-135M-Instruct, a draft made by `jobs.train_draft` with its defaults, and whole
default jobs against autoregressive, interleaved, on prompts held out from training.

    make real-model                                   # once: builds models/SmolLM2-135M-Instruct (outside git)
    python scripts/bench_real_model.py --draft-out DIR   # train the draft (kept in DIR), then 2 rounds of both settings
    python scripts/bench_real_model.py --draft DIR --rounds 3    # an existing draft: the jobs only

1. The prompts: `assets/prompts.jsonl` split in two files, the first lines to train on and the last
   `--heldout` (64) to generate from: the jobs never see a prompt the draft was trained on.
2. The draft: `python -m jobs.train_draft model.target=M data.path=TRAIN out=DIR` with the job's defaults
   (its wall time, and the acceptance it prints, measured on its own held-out completions).
3. Whole jobs (`python -m jobs.generate`, a fresh process, output directory and plan cache each; MLflow and the
   progress bar off), the default job (`spectr.method=auto`, with the draft) against
   `spectr.method=autoregressive`, in an order shuffled per round, for two settings:
   - `batch1`: `spectr.batch_size=1`, 16 prompts x 64 new tokens;
   - `default`: the default batch (8), 64 prompts x 128 new tokens.
   Each job's throughput is its summary's (generated tokens over its generation time); its wall time is the
   whole process's. Ratios are per round (auto / autoregressive), then the median over rounds.

Writes `runs.json` (every record), `report.json` and `report.md` (the table, the command, the machine, the
date) under `--out` (default `benchmarks/results/real_model`).
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

from build_real_model import DEFAULT_OUT, build
from harness import Report, interleaved, job_summary, machine_line

PROJECT_ROOT = Path(__file__).resolve().parents[1]
PROMPTS = PROJECT_ROOT / "assets" / "prompts.jsonl"
SETTINGS = {
    "batch1": ["spectr.batch_size=1", "data.limit=16", "spectr.max_new_tokens=64"],
    "default": ["spectr.max_new_tokens=128"],
}
ARMS = {"auto": ["spectr.method=auto"], "autoregressive": ["spectr.method=autoregressive"]}


def split_prompts(workdir: Path, heldout: int) -> tuple[Path, Path]:
    lines = PROMPTS.read_text().splitlines()
    train, bench = workdir / "train_prompts.jsonl", workdir / "bench_prompts.jsonl"
    train.write_text("\n".join(lines[:-heldout]) + "\n")
    bench.write_text("\n".join(lines[-heldout:]) + "\n")
    return train, bench


def train_draft(model: Path, prompts: Path, out: Path, extra: list[str]) -> dict[str, object]:
    command = [sys.executable, "-m", "jobs.train_draft", f"model.target={model}", f"data.path={prompts}",
               f"out={out}", "mlflow.enabled=false", "show_progress=false", *extra]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True)
    record: dict[str, object] = {"command": " ".join(command[1:]), "returncode": done.returncode,
                                 "wall_s": time.perf_counter() - started, "last_line": done.stdout.strip()[-600:]}
    found = re.search(r"acceptance sum_x min\(p, q\) on (\d+) held-out positions ([\d.]+)", done.stdout)
    if found:
        record["heldout_positions"], record["acceptance"] = int(found.group(1)), float(found.group(2))
    if done.returncode != 0:
        record["error"] = (done.stderr or done.stdout)[-3000:]
    return record


def run_job(model: Path, draft: Path, prompts: Path, setting: str, arm: str, workdir: Path,
            timeout_s: float) -> dict[str, object]:
    output = Path(tempfile.mkdtemp(prefix="job-", dir=workdir))
    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=workdir))
    command = [sys.executable, "-m", "jobs.generate", f"model.target={model}", f"model.draft={draft}",
               f"data.path={prompts}", *SETTINGS[setting], *ARMS[arm], f"output_dir={output}",
               "mlflow.enabled=false", "progress=false"]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=PROJECT_ROOT, env={**os.environ, "SPECTR_CACHE_DIR": str(cache)},
                          capture_output=True, text=True, timeout=timeout_s)
    record: dict[str, object] = {"setting": setting, "arm": arm, "returncode": done.returncode,
                                 "wall_s": time.perf_counter() - started, **job_summary(done.stdout)}
    if done.returncode != 0 or "throughput_tokens_per_s" not in record:
        record["error"] = (done.stderr or done.stdout)[-2000:]
    return record


def report(records: list[dict[str, object]]) -> dict[str, dict[str, object]]:
    out = {}
    for setting in SETTINGS:
        rounds = sorted({r["round"] for r in records if r["setting"] == setting})
        ratios, wall_ratios = [], []
        for index in rounds:
            got = {r["arm"]: r for r in records if r["setting"] == setting and r["round"] == index
                   and "throughput_tokens_per_s" in r}
            if len(got) == 2:
                ratios.append(got["auto"]["throughput_tokens_per_s"] / got["autoregressive"]["throughput_tokens_per_s"])
                wall_ratios.append(got["autoregressive"]["wall_s"] / got["auto"]["wall_s"])
        if not ratios:
            continue

        def arm_median(arm, key, setting=setting):
            values = [r[key] for r in records if r["setting"] == setting and r["arm"] == arm and key in r]
            return statistics.median(values) if values else None

        out[setting] = {"rounds": len(ratios), "throughput_ratio": statistics.median(ratios),
                        "throughput_ratios": ratios, "wall_ratio": statistics.median(wall_ratios),
                        "wall_ratios": wall_ratios,
                        **{f"{arm}_{key}": arm_median(arm, key) for arm in ARMS
                           for key in ("throughput_tokens_per_s", "wall_s", "block_efficiency")}}
    return out


def markdown(summary: dict, train: dict | None) -> str:
    lines = []
    if train:
        lines += [f"Draft: `python {train.get('command', '')}`: {train.get('wall_s', 0) / 60:.1f} min, "
                  f"acceptance {train.get('acceptance', float('nan')):.3f} on {train.get('heldout_positions', 0)} "
                  "held-out positions", ""]
    lines += ["| setting | rounds | auto tokens/s | autoregressive tokens/s | throughput ratio (median; each round) "
              "| whole-job wall ratio (median) | auto block efficiency |", "|---|---|---|---|---|---|---|"]
    for setting, row in summary.items():
        each = ", ".join(f"{r:.2f}" for r in row["throughput_ratios"])
        lines.append(f"| {setting} | {row['rounds']} | {row['auto_throughput_tokens_per_s']:.1f} | "
                     f"{row['autoregressive_throughput_tokens_per_s']:.1f} | **{row['throughput_ratio']:.2f}x** "
                     f"({each}) | {row['wall_ratio']:.2f}x | {row['auto_block_efficiency'] or 0:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--heldout", type=int, default=64)
    parser.add_argument("--draft", type=Path, default=None, help="an existing draft: skip training")
    parser.add_argument("--draft-out", type=Path, default=None,
                        help="train the draft into this directory (kept for later --draft runs and profiling)")
    parser.add_argument("--train-set", nargs="*", default=[], help="extra overrides for jobs.train_draft")
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "benchmarks" / "results" / "real_model")
    args = parser.parse_args()
    bench = Report("report", args=args)
    print(bench.header(), flush=True)
    model = build(DEFAULT_OUT)
    workdir = Path(tempfile.mkdtemp(prefix="bench-real-"))
    train_prompts, bench_prompts = split_prompts(workdir, args.heldout)
    train = None
    draft = args.draft
    if draft is None:
        draft = args.draft_out or workdir / "draft"
        train = train_draft(model, train_prompts, draft, args.train_set)
        print(json.dumps(train), flush=True)
        if train["returncode"] != 0:
            sys.exit(f"jobs.train_draft failed: {train.get('error')}")

    def arm(setting: str, name: str):
        return lambda: run_job(model, draft, bench_prompts, setting, name, workdir, args.timeout_s)

    def show(index: int, key: str, record: dict) -> None:
        record["round"] = index
        print(json.dumps({k: v for k, v in record.items() if k != "error"}), flush=True)
        if "error" in record:
            print(record["error"], file=sys.stderr)

    arms = {f"{setting}/{name}": arm(setting, name) for setting in args.settings for name in ARMS}
    runs = interleaved(arms, rounds=args.rounds, shuffle=random.Random(0), on_run=show)
    records = sorted((r for results in runs.values() for r in results), key=lambda r: r["round"])
    summary = report(records)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "runs.json").write_text(json.dumps({"command": bench.meta["command"], "date": bench.meta["date"],
                                                     "machine": machine_line(bench.meta["machine"]),
                                                     "train": train, "records": records}, indent=2) + "\n")
    text = markdown(summary, train)
    bench.write(args.out / "report.json", summary, markdown=text)
    print(text)
    print(f"the draft: {draft} (again: --draft {draft})")


if __name__ == "__main__":
    main()
