"""Where an iteration's time goes at a given batch size: autoregressive against speculative L=1 and L=2 with a
draft (feature or independent), through `spectr.generate`, with the engine's own phase timers (draft, target,
selection, other) per iteration. Interleaved rounds; the last lines compare within this run only.

    python scripts/bench_iteration_costs.py --draft DRAFT [--target models/SmolLM2-135M-Instruct] [--batch 1]

Used for the per-iteration table in benchmarks/results/real_model/README.md: what a drafted token and a wider
verify cost against one autoregressive step, which bounds the speed-up a given acceptance can buy.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

ARMS = {"autoregressive": {"method": "autoregressive"},
        "speculative L=1": {"method": "speculative", "draft_length": 1, "num_drafts": 1},
        "speculative L=2": {"method": "speculative", "draft_length": 2, "num_drafts": 1}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="models/SmolLM2-135M-Instruct")
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompts", default="assets/prompts.jsonl", help="the last --count prompts are used")
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the runs here (JSON, and the table as .md)")
    a = parser.parse_args()

    from harness import Report, interleaved, table
    from transformers import AutoTokenizer

    import spectr
    from pipeline.config import ModelConfig
    from pipeline.models import load_model

    report = Report("iteration_costs", args=a)
    print(report.header())
    pair = ModelConfig(target=a.target, draft=a.draft, dtype="float32")
    target = load_model(pair.target, pair, "cpu")
    draft = load_model(pair.draft, pair, "cpu")
    tokenizer = AutoTokenizer.from_pretrained(a.target)
    rows = [json.loads(line) for line in open(a.prompts)][-a.count:]
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in rows]
    for arm in ARMS.values():  # warm-up: kernels, packed weights
        spectr.generate(target, draft, prompts[:2], max_new_tokens=8, batch_size=a.batch, **arm)

    rounds = {name: itertools.count() for name in ARMS}  # round r runs every arm with seed r

    def run(name: str) -> dict:
        start = time.perf_counter()
        stats = spectr.generate(target, draft, prompts, max_new_tokens=a.max_new_tokens, batch_size=a.batch,
                                seed=next(rounds[name]), **ARMS[name]).stats
        return {"wall_s": time.perf_counter() - start, "tokens": sum(stats.generated_tokens),
                "iterations": stats.iterations, "draft_s": stats.draft_seconds, "target_s": stats.target_seconds,
                "selection_s": stats.selection_seconds, "other_s": stats.other_seconds}

    runs = interleaved({name: (lambda name=name: run(name)) for name in ARMS}, a.rounds)
    lines, base = [], None
    for name, mine in runs.items():
        rate = median([r["tokens"] / r["wall_s"] for r in mine])
        base = base or rate
        row = {"arm": name, "tokens/s": f"{rate:.1f} ({rate / base:.2f}x)",
               "tokens / iteration": f"{median([r['tokens'] / r['iterations'] for r in mine]):.2f}"}
        for key, column in (("wall_s", "ms / iteration"), ("draft_s", "draft"), ("target_s", "target"),
                            ("selection_s", "selection"), ("other_s", "other")):
            row[column] = f"{1e3 * median([r[key] / r['iterations'] for r in mine]):.1f}"
        lines.append(row)
    body = (f"batch {a.batch}, {len(prompts)} prompts x {a.max_new_tokens} tokens, {a.rounds} rounds (medians)\n\n"
            + table(lines))
    print(body)
    if a.out:
        report.write(a.out, {"runs": runs}, markdown=body)

if __name__ == "__main__":
    main()
