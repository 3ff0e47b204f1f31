"""Where an iteration's time goes at a given batch size: autoregressive against speculative L=1 and L=2 with a
draft (feature or independent), through `spectr.generate`, with the engine's own phase timers (draft, target,
selection, other) per iteration. Interleaved rounds; the last lines compare within this run only.

    python scripts/bench_iteration_costs.py --draft DRAFT [--target models/SmolLM2-135M-Instruct] [--batch 1]

Used for the per-iteration table in benchmarks/results/real_model/README.md: what a drafted token and a wider
verify cost against one autoregressive step, which bounds the speed-up a given acceptance can buy.
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    a = parser.parse_args()

    from harness import machine_line
    from transformers import AutoTokenizer

    import spectr
    from pipeline.config import ModelConfig
    from pipeline.models import load_model

    pair = ModelConfig(target=a.target, draft=a.draft, dtype="float32")
    target = load_model(pair.target, pair, "cpu")
    draft = load_model(pair.draft, pair, "cpu")
    tokenizer = AutoTokenizer.from_pretrained(a.target)
    rows = [json.loads(line) for line in open(a.prompts)][-a.count:]
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in rows]
    for arm in ARMS.values():  # warm-up: kernels, packed weights
        spectr.generate(target, draft, prompts[:2], max_new_tokens=8, batch_size=a.batch, **arm)
    runs = []
    for round_ in range(a.rounds):
        for name, arm in ARMS.items():
            start = time.perf_counter()
            out = spectr.generate(target, draft, prompts, max_new_tokens=a.max_new_tokens, batch_size=a.batch,
                                  seed=round_, **arm)
            wall = time.perf_counter() - start
            s = out.stats
            runs.append({"arm": name, "round": round_, "wall_s": wall, "tokens": sum(s.generated_tokens),
                         "iterations": s.iterations, "draft_s": s.draft_seconds, "target_s": s.target_seconds,
                         "selection_s": s.selection_seconds, "other_s": s.other_seconds})
    print(f"{machine_line()}; batch {a.batch}, {len(prompts)} prompts x {a.max_new_tokens} tokens, {a.rounds} "
          f"rounds (medians)")
    print("| arm | tokens/s | tokens / iteration | ms / iteration | draft | target | selection | other |")
    print("|---|---|---|---|---|---|---|---|")
    base = None
    for name in ARMS:
        mine = [r for r in runs if r["arm"] == name]
        rate = median([r["tokens"] / r["wall_s"] for r in mine])
        base = base or rate
        ms = {key: 1e3 * median([r[key] / r["iterations"] for r in mine])
              for key in ("wall_s", "draft_s", "target_s", "selection_s", "other_s")}
        per_iteration = median([r["tokens"] / r["iterations"] for r in mine])
        print(f"| {name} | {rate:.1f} ({rate / base:.2f}x) | {per_iteration:.2f} | {ms['wall_s']:.1f} | "
              f"{ms['draft_s']:.1f} | {ms['target_s']:.1f} | {ms['selection_s']:.1f} | {ms['other_s']:.1f} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
