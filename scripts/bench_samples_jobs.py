"""Many samples per prompt as whole jobs: `spectr.num_samples=n` against the same rows written out, interleaved.

    flock /tmp/timing.lock .venv/bin/python scripts/bench_samples_jobs.py --rounds 3
    .venv/bin/python scripts/bench_samples_jobs.py --scenarios 16x4 --rounds 1 --out bench_out/samples_jobs

Each run is the real job in a fresh process (`python -m jobs.generate`, a fresh output directory, MLflow off,
progress bar off) on the embedded pair; its throughput is the job's own `throughput_tokens_per_s` (the
summary's `throughput` line: generated tokens over this run's generation time; Ray's start and model loading
excluded). Scenarios (the issue's settings: speculative L=3):

- `16x4`: the first 16 prompts of assets/prompts.jsonl x 4 samples, 2 actors;
- `4x16`: the first 4 prompts x 16 samples, 2 actors;
- `long1000x8`: one prompt of 1,000+ tokens (assets' prompts joined) x 8 samples, 1 actor, 16 new tokens.

Arms, the same settings otherwise:
- `samples`: the prompts with `spectr.num_samples=n`;
- `rows`: the same prompts written out n times (each prompt's copies one after the other, own ids), n=1;
- `distinct` (long1000x8 only): n different prompts of the same length (no prompt to share).
With `--seed-per-round`, round r runs both arms with `spectr.seed=r`: with one seed for every round, an arm's
draws (its lengths, its acceptances) are the same each round, so a ratio can be that seed's luck; a seed per
round averages it out. The arms of a scenario alternate within each round (ABAB..., the first arm alternating between rounds), so the
machine's drift hits them alike; the report gives each arm's median throughput and the median over rounds of
samples / rows (and samples / distinct) from the same round, with the prefills each arm ran and shared.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT / "scripts"))
from harness import Report, interleaved, job_summary, summary, table  # noqa: E402

COMMON = ["spectr.method=speculative", "spectr.draft_length=3", "mlflow.enabled=false", "progress=false"]
SCENARIOS = {
    "16x4": {"prompts": 16, "samples": 4, "actors": 2, "extra": []},
    "4x16": {"prompts": 4, "samples": 16, "actors": 2, "extra": []},
    "long1000x8": {"prompts": 1, "samples": 8, "actors": 1, "extra": ["spectr.max_new_tokens=16"], "long": 1000},
}


def base_prompts() -> list[str]:
    lines = (PROJECT_ROOT / "assets/prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines]


def long_prompts(count: int, tokens: int) -> list[str]:
    """`count` different prompts of `tokens` tokens or a few more (assets' prompts joined, cut, re-checked)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(PROJECT_ROOT / "assets/models/target")
    pool, found, start = base_prompts(), [], 0
    while len(found) < count:
        text, ids = "", []
        k = start
        while len(ids) < tokens:
            text += pool[k % len(pool)] + "\n\n"
            ids = tokenizer(text)["input_ids"]
            k += 1
        candidate = tokenizer.decode(ids[:tokens], skip_special_tokens=True)
        if tokens <= len(tokenizer(candidate)["input_ids"]) <= tokens + 7:
            found.append(candidate)
        start = k
    return found


def write_inputs(scenario: dict, workdir: Path) -> dict[str, Path]:
    """The arms' input files: prompts (samples), the rows written out, and distinct prompts (long only)."""
    n, count = scenario["samples"], scenario["prompts"]
    prompts = long_prompts(count * n if "long" in scenario else count, scenario.get("long", 0)) \
        if "long" in scenario else base_prompts()[:count]
    files = {}

    def write(name: str, rows: list[dict]) -> None:
        path = workdir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        files[name] = path

    write("samples", [{"id": f"p{i}", "prompt": prompts[i]} for i in range(count)])
    write("rows", [{"id": f"p{i}-{s}", "prompt": prompts[i]} for i in range(count) for s in range(n)])
    if "long" in scenario:
        write("distinct", [{"id": f"d{i}", "prompt": p} for i, p in enumerate(prompts[: count * n])])
    return files


def parse_summary(text: str) -> dict[str, object]:
    """The job summary's numbers (`harness.job_summary`), its prefills, shards and first line."""
    found: dict[str, object] = job_summary(text)
    prefills = re.search(r"prefills\s+(\d+) run, (\d+) shared", text)
    found["prefilled_rows"], found["shared_prefill_rows"] = (int(prefills.group(1)), int(prefills.group(2))) \
        if prefills else (None, 0)
    shards = re.search(r"\((\d+) shards\)", text)
    if shards:
        found["shards"] = int(shards.group(1))
    first = re.search(r"checked config, models and (.*?) in [\d.]+ s; (\d+) of (\d+) shards", text)
    if first:
        found["first_line"] = first.group(0)
    return found


def run_job(name: str, arm: str, data: Path, scenario: dict, workdir: Path, timeout_s: float,
            extra: tuple[str, ...] = ()) -> dict[str, object]:
    output = Path(tempfile.mkdtemp(prefix=f"{name}-{arm}-", dir=workdir))
    samples = scenario["samples"] if arm == "samples" else 1
    command = [sys.executable, "-m", "jobs.generate", f"data.path={data}", f"output_dir={output}",
               f"ray.num_actors={scenario['actors']}", f"spectr.num_samples={samples}", *COMMON, *scenario["extra"],
               *extra]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=timeout_s)
    text = done.stdout + done.stderr
    record: dict[str, object] = {"scenario": name, "arm": arm, "returncode": done.returncode,
                                 "wall_s": time.perf_counter() - started, **parse_summary(text)}
    if done.returncode != 0 or "throughput_tokens_per_s" not in record:
        record["error"] = text[-2000:]
    return record


def paired(records: list[dict], name: str, arm: str, other: str) -> float | None:
    by_round: dict[int, dict[str, float]] = {}
    for r in records:
        if r["scenario"] == name and "throughput_tokens_per_s" in r:
            by_round.setdefault(int(r["round"]), {})[str(r["arm"])] = float(r["throughput_tokens_per_s"])
    ratios = [runs[arm] / runs[other] for runs in by_round.values() if arm in runs and other in runs]
    return summary(ratios)["median"] if ratios else None


def report(records: list[dict]) -> dict[str, dict]:
    found = {}
    for name in dict.fromkeys(str(r["scenario"]) for r in records):
        mine = [r for r in records if r["scenario"] == name and "throughput_tokens_per_s" in r]
        arms = list(dict.fromkeys(str(r["arm"]) for r in mine))
        entry = {arm: {"median_tokens_per_s": summary(float(r["throughput_tokens_per_s"])
                                                      for r in mine if r["arm"] == arm)["median"],
                       "shards": sorted({r.get("shards") for r in mine if r["arm"] == arm}, key=str),
                       "prefilled_rows": [r.get("prefilled_rows") for r in mine if r["arm"] == arm],
                       "shared_prefill_rows": [r.get("shared_prefill_rows") for r in mine if r["arm"] == arm]}
                 for arm in arms}
        entry["samples_over_rows"] = paired(records, name, "samples", "rows")
        if "distinct" in arms:
            entry["samples_over_distinct"] = paired(records, name, "samples", "distinct")
        entry["rounds"] = sorted({int(r["round"]) for r in mine})
        found[name] = entry
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--out", default="benchmarks/results/samples_jobs")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override for every arm (e.g. spectr.ignore_eos=true: every row runs its budget)")
    parser.add_argument("--first-round", type=int, default=1,
                        help="the first round's number (with --seed-per-round, its seed): a later set continues a set")
    parser.add_argument("--seed-per-round", action="store_true",
                        help="round r runs both arms with spectr.seed=r: the draws (lengths, acceptances) change "
                             "between rounds, so the median ratio is not one seed's luck")
    args = parser.parse_args()
    COMMON.extend(args.set)
    out = PROJECT_ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    run_report = Report("bench_samples_jobs", args=args)
    print(run_report.header(), flush=True)
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-samples-jobs-") as tmp:
        workdir = Path(tmp)
        inputs = {name: write_inputs(SCENARIOS[name], workdir / name) for name in args.scenarios.split(",")
                  if (workdir / name).mkdir() is None}
        rounds_done: dict[tuple[str, str], int] = {}

        def one_job(name: str, arm: str) -> dict:
            number = args.first_round + rounds_done.setdefault((name, arm), 0)
            rounds_done[(name, arm)] += 1
            seed = (f"spectr.seed={number}",) if args.seed_per_round else ()
            return {"round": number, **({"seed": number} if seed else {}),
                    **run_job(name, arm, inputs[name][arm], SCENARIOS[name], workdir, args.timeout_s, seed)}

        def keep(_round: int, _arm: tuple, record: dict) -> None:
            records.append(record)
            print(json.dumps({k: v for k, v in record.items() if k != "error"}), flush=True)
            if "error" in record:
                print(record["error"], file=sys.stderr, flush=True)
            (out / "runs.json").write_text(json.dumps(records, indent=1))

        arms = {(name, arm): (lambda key=(name, arm): one_job(*key)) for name, files in inputs.items() for arm in files}
        # every other round in reverse (ABAB...: a scenario's first arm alternates between rounds)
        interleaved(arms, rounds=args.rounds, alternate=True, on_run=keep)
    result = {"settings": COMMON + (["spectr.seed=<round>"] if args.seed_per_round else []),
              "scenarios": {k: SCENARIOS[k] for k in inputs}, "report": report(records), "runs": records}
    rows = [{"scenario": name, "arm": arm, "median_tokens_per_s": values["median_tokens_per_s"]}
            for name, entry in result["report"].items() for arm, values in entry.items() if isinstance(values, dict)]
    run_report.write(out / "result.json", result, markdown=table(rows))
    print(json.dumps(result["report"], indent=1))

if __name__ == "__main__":
    main()
