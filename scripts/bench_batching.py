"""Benchmark: continuous vs static batching of `spectr.generate`, tokens/s, in one interleaved run.

Workload: the first --prompts prompts of assets/prompts.jsonl, tokenized with the embedded pair's
tokenizer, each with its own budget drawn uniformly from --min-tokens..--max-tokens (seeded), EOS
off, so every row generates exactly its budget and both modes do the same work. Models: the
embedded pair (assets/models/target, assets/models/draft) in float32 on the CPU by default.

At each batch size B and for each method:
- static:     the prompts cut into consecutive batches of B, each run until its longest row is
              done, one after another (`spectr.generate` per batch, `batch_size=None`);
- continuous: `spectr.generate(all prompts, batch_size=B)`: a finished row's slot takes the next
              waiting prompt.
Both use the engine's default live-row policy. With --sections policy, the live-row policy itself is
timed too: one static batch of B (a run that is all tail) with `pack_below` 0 (slots below the
highest live one run, finished ones masked), 0.5 (live rows packed into the emptied slots once at
most half are live) and 1 (packed as soon as one row is done).

Timings: every repeat runs every cell once, the cells in a fixed interleaved order (mode
innermost), so machine load drifts over all cells alike. Reported: the median tokens/s of wall
time and of process CPU time (with --threads 1, CPU time is the work done, which other load on a
shared machine disturbs far less), and the median over repeats of each repeat's own
continuous/static ratio. This is a benchmark script, not a test; nothing here asserts a speed.

    .venv/bin/python scripts/bench_batching.py --threads 1 --repeats 3 --json bench_batching.json
    .venv/bin/python scripts/bench_batching.py --quick      # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import transformers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))
from harness import Report, interleaved, ratio_summary, summary, table, timed  # noqa: E402

import spectr  # noqa: E402
from spectr.generate import Generation, _run, known_methods  # noqa: E402

MODES = ("static", "continuous")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=os.path.join(REPO, "assets/models/target"))
    parser.add_argument("--draft", default=os.path.join(REPO, "assets/models/draft"))
    parser.add_argument("--prompt-file", default=os.path.join(REPO, "assets/prompts.jsonl"))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--min-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", default="8,16")
    default_methods = [m for m in ("autoregressive", "speculative", "spectr", "specinfer", "block")
                       if m in known_methods()]
    parser.add_argument("--methods", default=",".join(default_methods))
    parser.add_argument("--num-drafts", type=int, default=2)
    parser.add_argument("--draft-length", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sections", default="batching",
                        help="comma list: batching (continuous vs static), policy (the live-row policy)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="smoke run: 12 prompts, 8..24 tokens, B=4, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.min_tokens, args.max_tokens, args.batch_sizes, args.repeats = 12, 8, 24, "4", 1
    return args


def workload(args):
    """(target, draft, prompts, budgets): the embedded pair, tokenized prompts, seeded budgets."""
    dtype = getattr(torch, args.dtype)
    target = transformers.AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(args.device).eval()
    draft = transformers.AutoModelForCausalLM.from_pretrained(args.draft, dtype=dtype).to(args.device).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.target)
    with open(args.prompt_file) as f:
        texts = [json.loads(line)["prompt"] for line in f if line.strip()][: args.prompts]
    prompts = [list(map(int, ids)) for ids in tokenizer(texts)["input_ids"]]
    generator = torch.Generator().manual_seed(args.seed)
    budgets = torch.randint(args.min_tokens, args.max_tokens + 1, (len(prompts),), generator=generator).tolist()
    return target, draft, prompts, budgets


def counted(fn) -> dict:
    """`fn()` -> (tokens, iterations), timed: the run's timing dict."""
    run = timed(fn)
    tokens, iterations = run["result"]
    return dict(wall_s=run["wall_s"], cpu_s=run["cpu_s"], tokens=tokens, iterations=iterations,
                tokens_per_s=tokens / run["wall_s"], tokens_per_cpu_s=tokens / run["cpu_s"])


def run_cell(target, draft, prompts, budgets, args, method, batch, mode, pack_below=None):
    """One timed run; returns its timing dict (tokens = generated tokens, iterations = target calls)."""
    settings = dict(method=method, num_drafts=args.num_drafts, draft_length=args.draft_length)
    seeds = list(range(len(prompts)))

    def generate(rows, batch_size):
        generation = Generation(target, draft, [prompts[i] for i in rows], max_new_tokens=[budgets[i] for i in rows],
                                seed=[seeds[i] for i in rows], batch_size=batch_size, pack_below=pack_below,
                                **settings)
        out = _run(generation)
        return out.stats.total_generated_tokens, out.stats.iterations

    def static():
        results = [generate(range(s, min(s + batch, len(prompts))), None) for s in range(0, len(prompts), batch)]
        return sum(t for t, _ in results), sum(i for _, i in results)

    if mode == "static":
        return counted(static)
    if mode == "continuous":
        return counted(lambda: generate(range(len(prompts)), batch))
    return counted(lambda: generate(range(batch), None))  # the policy cells: one static batch, all tail


def cells(args):
    methods = args.methods.split(",")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    sections = args.sections.split(",")
    grid = [(m, b, mode, None) for b in batches for m in methods for mode in MODES] if "batching" in sections else []
    if "policy" in sections:
        grid += [(m, b, f"policy {g}", g) for b in batches for m in methods for g in (0.0, 0.5, 1.0)]
    return grid


def summarize(results, args) -> list[dict]:
    rows = []
    for (method, batch, mode, pack), runs in results.items():
        rows.append(dict(method=method, batch_size=batch, mode=mode, pack_below=pack, runs=runs,
                         tokens_per_s=summary(r["tokens_per_s"] for r in runs)["median"],
                         tokens_per_cpu_s=summary(r["tokens_per_cpu_s"] for r in runs)["median"],
                         iterations=runs[0]["iterations"], tokens=runs[0]["tokens"]))
    for row in rows:
        if row["mode"] != "continuous" or (row["method"], row["batch_size"], "static", None) not in results:
            continue
        static = results[(row["method"], row["batch_size"], "static", None)]
        mine = results[(row["method"], row["batch_size"], "continuous", None)]
        row["ratio_wall"] = ratio_summary(mine, static, "tokens_per_s")["median"]
        row["ratio_cpu"] = ratio_summary(mine, static, "tokens_per_cpu_s")["median"]
        row["ratio_iterations"] = static[0]["iterations"] / mine[0]["iterations"]
    return rows


def print_table(rows, args, budgets) -> None:
    print(f"\n{len(budgets)} prompts, budgets {args.min_tokens}..{args.max_tokens} (mean {statistics.mean(budgets):.1f}),"
          f" K={args.num_drafts} L={args.draft_length}, {args.repeats} repeats, {args.threads} thread(s), {args.device}"
          + ("; policy cells: the first B prompts as one static batch" if "policy" in args.sections else ""))
    print(f"{'method':<15}{'B':>3}  {'mode':<12}{'target calls':>13}{'tok/s wall':>12}{'tok/CPU-s':>11}"
          f"{'cont/static wall':>18}{'cpu':>7}{'calls':>7}")
    for r in rows:
        ratio = (f"{r['ratio_wall']:>18.2f}{r['ratio_cpu']:>7.2f}{r['ratio_iterations']:>7.2f}"
                 if "ratio_wall" in r else "")
        print(f"{r['method']:<15}{r['batch_size']:>3}  {r['mode']:<12}{r['iterations']:>13}{r['tokens_per_s']:>12.1f}"
              f"{r['tokens_per_cpu_s']:>11.1f}{ratio}")


def main(argv=None) -> None:
    args = parse_args(argv)
    report = Report("bench_batching", argv=None if argv is None else ["scripts/bench_batching.py", *argv], args=args)
    print(report.header())
    torch.set_num_threads(args.threads)
    target, draft, prompts, budgets = workload(args)
    grid = cells(args)
    arms = {cell: (lambda cell=cell: run_cell(target, draft, prompts, budgets, args, *cell)) for cell in grid}

    def progress(repeat, cell, result):
        method, batch, mode, _ = cell
        print(f"repeat {repeat} {method:<14} B={batch:<3} {mode:<11} {result['tokens_per_s']:8.1f} tok/s "
              f"{result['tokens_per_cpu_s']:8.1f} tok/CPU-s  {result['iterations']} calls", flush=True)

    run_cell(target, draft, prompts[:4], budgets[:4], args, grid[0][0], 2, "continuous")  # warm-up
    results = interleaved(arms, rounds=args.repeats, on_run=progress)
    rows = summarize(results, args)
    print_table(rows, args, budgets)
    if args.json:
        columns = ["method", "batch_size", "mode", "iterations", "tokens_per_s", "tokens_per_cpu_s", "ratio_wall",
                   "ratio_cpu"]
        report.write(args.json, dict(meta=dict(budgets=budgets, prompt_tokens=[len(p) for p in prompts],
                                               spectr=os.path.dirname(spectr.__file__)), results=rows),
                     markdown=table(rows, columns))


if __name__ == "__main__":
    main()
