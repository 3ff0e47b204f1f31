"""Block efficiency (generated tokens / target calls) of traversal verification against spectr's K-SEQ.

For each (K, L) of the grid, `spectr.generate` runs the same prompts with the same seeds (row i of the
held prompts gets seed i) with method "spectr" and with method "traversal", and the script reports each
method's tokens per target call, their ratio, and a 95% interval of the ratio from a paired bootstrap over
the prompts. It counts calls, it does not time them (the seconds are reported only to size the grid), so
machine load does not change its figures.

Pair and prompts: the embedded pair (assets/models, float32, CPU) and the first --prompts of
assets/prompts.jsonl, tokenized with the pair's tokenizer; every row generates exactly --new-tokens
tokens (EOS ignored: the same work per row for both methods; --eos stops rows at EOS instead).

Order: the cells named by --first (default K=2 L=8 and K=4 L=8), then the rest of the K x L grid by
growing K L; the grid stops once --budget-s seconds have been spent, and the report says which cells ran.

    .venv/bin/python scripts/bench_traversal.py --threads 1 [--drafts 2 3 4 5 6 7 8 --lengths 2 3 4 5 6 7 8
        --prompts 16 --new-tokens 48 --budget-s 900 --out benchmarks/results/traversal]

Writes block_efficiency.md (a table, with a row pooled over K: tokens / calls summed over the cells of
each L) and block_efficiency.json (every cell, the settings, the command) under --out; --from-json rewrites
the table from an earlier run's JSON. Not a test: nothing is asserted (the slow test in tests/spectr/test_traversal_e2e.py asserts
the 1.03x goal).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Report  # noqa: E402

import spectr  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
METHODS = ("spectr", "traversal")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=str(REPO / "assets" / "models"))
    parser.add_argument("--prompts-file", default=str(REPO / "assets" / "prompts.jsonl"))
    parser.add_argument("--drafts", type=int, nargs="+", default=[2, 3, 4, 5, 6, 7, 8])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2, 3, 4, 5, 6, 7, 8])
    parser.add_argument("--first", nargs="*", default=["2x8", "4x8"], help="cells KxL to run first")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--eos", action="store_true", help="stop rows at EOS (default: ignore EOS)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=900.0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--bootstrap", type=int, default=2000)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "traversal"))
    parser.add_argument("--from-json", help="only rewrite the markdown of this block_efficiency.json")
    return parser.parse_args(argv)


def grid_order(drafts, lengths, first) -> list[tuple[int, int]]:
    cells = [(k, n) for k in drafts for n in lengths]
    head = [tuple(int(x) for x in cell.split("x")) for cell in first]
    head = [cell for cell in head if cell in cells]
    return head + sorted((c for c in cells if c not in head), key=lambda c: (c[0] * c[1], c))


def ratio_interval(tokens, calls, seed: int, resamples: int) -> tuple[float, float]:
    """95% paired bootstrap interval over prompts of (sum traversal tokens / calls) / (same for spectr)."""
    rng = random.Random(seed)
    n = len(tokens["spectr"])
    ratios = []
    for _ in range(resamples):
        pick = [rng.randrange(n) for _ in range(n)]
        rate = {m: sum(tokens[m][i] for i in pick) / sum(calls[m][i] for i in pick) for m in METHODS}
        ratios.append(rate["traversal"] / rate["spectr"])
    ratios.sort()
    return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def run_cell(target, draft, prompts, num_drafts, length, args, eos) -> dict:
    cell: dict = {"num_drafts": num_drafts, "draft_length": length}
    tokens, calls = {}, {}
    for method in METHODS:
        start = time.perf_counter()
        out = spectr.generate(target, draft, prompts, method=method, num_drafts=num_drafts, draft_length=length,
                              max_new_tokens=args.new_tokens, seed=args.seed, eos_token_id=eos)
        stats = out.stats
        tokens[method], calls[method] = list(stats.generated_tokens), list(stats.target_calls)
        cell[method] = {"block_efficiency": stats.block_efficiency, "generated_tokens": sum(tokens[method]),
                        "target_calls": sum(calls[method]), "acceptance_rate": stats.acceptance_rate,
                        "seconds": time.perf_counter() - start}
    cell["ratio"] = cell["traversal"]["block_efficiency"] / cell["spectr"]["block_efficiency"]
    cell["ratio_95"] = ratio_interval(tokens, calls, args.seed, args.bootstrap)
    return cell


def markdown(cells, drafts, lengths, settings: dict) -> str:
    done = {(c["num_drafts"], c["draft_length"]): c for c in cells}
    lines = [
        "# Traversal verification vs spectr: tokens per target call",
        "",
        f"Embedded pair (float32, CPU), {settings['prompts']} prompts of assets/prompts.jsonl, "
        f"{settings['new_tokens']} new tokens per row ({'EOS stops rows' if settings['eos'] else 'EOS ignored'}), "
        f"seed {settings['seed']} (row i: seed + i), the same prompts and seeds for both methods.",
        "",
        f"Command: `{settings['command']}`",
        "",
        "Each cell: traversal / spectr block efficiency (traversal's own); `-`: not run within the budget.",
        "",
        "| K \\ L | " + " | ".join(str(n) for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for k in drafts:
        row = []
        for n in lengths:
            c = done.get((k, n))
            row.append("-" if c is None else f"{c['ratio']:.3f}x ({c['traversal']['block_efficiency']:.2f})")
        lines.append(f"| {k} | " + " | ".join(row) + " |")
    pooled = []
    for n in lengths:  # tokens / calls summed over the K that ran at this L
        here = [c for c in cells if c["draft_length"] == n]
        rate = {m: sum(c[m]["generated_tokens"] for c in here) / max(1, sum(c[m]["target_calls"] for c in here))
                for m in METHODS}
        pooled.append(f"{rate['traversal'] / rate['spectr']:.3f}x" if here else "-")
    lines.append("| all K (pooled) | " + " | ".join(pooled) + " |")
    lines += ["", "| K | L | spectr | traversal | ratio | 95% (bootstrap over prompts) | calls spectr / traversal |",
              "|---|---|---|---|---|---|---|"]
    for c in cells:
        lo, hi = c["ratio_95"]
        lines.append(f"| {c['num_drafts']} | {c['draft_length']} | {c['spectr']['block_efficiency']:.3f} | "
                     f"{c['traversal']['block_efficiency']:.3f} | {c['ratio']:.3f}x | {lo:.3f}-{hi:.3f} | "
                     f"{c['spectr']['target_calls']} / {c['traversal']['target_calls']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        cells = saved["cells"]
        drafts = sorted({c["num_drafts"] for c in cells})
        lengths = sorted({c["draft_length"] for c in cells})
        Path(args.from_json).with_suffix(".md").write_text(markdown(cells, drafts, lengths, saved["settings"]))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    report = Report("block_efficiency", argv=None if argv is None else [__file__, *argv], args=args)
    print(report.header(), flush=True)
    models = Path(args.models)
    tokenizer = transformers.AutoTokenizer.from_pretrained(models / "target")
    target = transformers.AutoModelForCausalLM.from_pretrained(models / "target", dtype=torch.float32)
    draft = transformers.AutoModelForCausalLM.from_pretrained(models / "draft", dtype=torch.float32)
    with open(args.prompts_file) as lines:
        texts = [json.loads(line)["prompt"] for line, _ in zip(lines, range(args.prompts))]
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    eos = tokenizer.eos_token_id if args.eos else None
    settings = {"prompts": len(prompts), "new_tokens": args.new_tokens, "eos": args.eos, "seed": args.seed,
                "threads": torch.get_num_threads(), "command": report.meta["command"]}
    start, cells = time.perf_counter(), []
    order = grid_order(args.drafts, args.lengths, args.first)
    for num_drafts, length in order:
        if time.perf_counter() - start > args.budget_s:
            break
        cell = run_cell(target, draft, prompts, num_drafts, length, args, eos)
        cells.append(cell)
        lo, hi = cell["ratio_95"]
        print(f"K={num_drafts} L={length}: spectr {cell['spectr']['block_efficiency']:.3f}, traversal "
              f"{cell['traversal']['block_efficiency']:.3f}, ratio {cell['ratio']:.3f}x [{lo:.3f}, {hi:.3f}] "
              f"({cell['spectr']['seconds'] + cell['traversal']['seconds']:.0f} s)", flush=True)
    settings["seconds"] = time.perf_counter() - start
    settings["cells_run"] = f"{len(cells)} of {len(order)}"
    out = Path(args.out)
    report.write(out / "block_efficiency.json", {"settings": settings, "cells": cells},
                 markdown=markdown(cells, args.drafts, args.lengths, settings))
    print(f"{len(cells)} of {len(order)} cells in {settings['seconds']:.0f} s -> {out}/block_efficiency.md")


if __name__ == "__main__":
    main()
