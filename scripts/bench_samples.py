"""Benchmark: n samples per prompt (shared prefill) against n copies of the prompts, in one run.

Workload: the first --prompts prompts of assets/prompts.jsonl (the embedded pair's tokenizer), each to be
completed --samples times with --max-tokens new tokens (EOS off, so every row does the same work), on the
embedded pair (float32, CPU by default), `spectr.ContinuousBatcher` with --batch-size slots. Three arms,
the same rows and seeds in each:
- samples:   each prompt's n rows admitted one after the other, as `spectr.num_samples=n` does: the copies
             of a prompt share its prefill (one forward per model for the prompt, the cache slots copied);
- copies:    the prompt list repeated n times, as a user duplicating prompts by hand would (a copy shares
             a prefill only when an earlier copy of its prompt is still in the batch);
- unshared:  the samples arm with `share_prefill=False` (every row runs its own prefill).
Reported per arm (medians over --repeats, arms interleaved in each repeat): rows prefilled (prompt
forwards), rows that copied a prefill, batched target calls (iterations), generated tokens, wall seconds
and tokens/s (wall and process CPU). A benchmark, not a test: nothing here asserts a speed.

    .venv/bin/python scripts/bench_samples.py --samples 4 --prompts 32 --threads 1 --repeats 3 --json bench_samples.json
    .venv/bin/python scripts/bench_samples.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import transformers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))
from harness import Report, interleaved, summary, table, timed  # noqa: E402

from spectr import ContinuousBatcher  # noqa: E402

ARMS = ("samples", "copies", "unshared")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=os.path.join(REPO, "assets/models/target"))
    parser.add_argument("--draft", default=os.path.join(REPO, "assets/models/draft"))
    parser.add_argument("--prompt-file", default=os.path.join(REPO, "assets/prompts.jsonl"))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--method", default="spectr")
    parser.add_argument("--num-drafts", type=int, default=2)
    parser.add_argument("--draft-length", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="smoke run: 6 prompts, 8 tokens, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.max_tokens, args.repeats = 6, 8, 1
    return args


def workload(args):
    dtype = getattr(torch, args.dtype)
    target = transformers.AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(args.device).eval()
    draft = transformers.AutoModelForCausalLM.from_pretrained(args.draft, dtype=dtype).to(args.device).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.target)
    with open(args.prompt_file) as f:
        texts = [json.loads(line)["prompt"] for line in f if line.strip()][: args.prompts]
    return target, draft, [list(map(int, ids)) for ids in tokenizer(texts)["input_ids"]]


def rows_of(arm: str, prompts: list[list[int]], samples: int) -> list[tuple[list[int], int]]:
    """(prompt, seed) per row; the same rows in every arm, only their order differs."""
    by_prompt = [(prompt, 1000 * p + s) for p, prompt in enumerate(prompts) for s in range(samples)]
    if arm == "copies":
        return [(prompt, 1000 * p + s) for s in range(samples) for p, prompt in enumerate(prompts)]
    return by_prompt


def run_arm(target, draft, prompts, args, arm: str) -> dict:
    rows = rows_of(arm, prompts, args.samples)
    longest = max(len(p) for p in prompts) + args.max_tokens
    batcher = ContinuousBatcher(target, draft, batch_size=args.batch_size, max_length=longest, method=args.method,
                                num_drafts=args.num_drafts, draft_length=args.draft_length,
                                share_prefill=arm != "unshared")
    batcher.admit([p for p, _ in rows], max_new_tokens=args.max_tokens, seed=[s for _, s in rows])
    run = timed(lambda: sum(len(row.tokens) for row in batcher.finished()))
    tokens, wall = run["result"], run["wall_s"]
    stats = batcher.stats
    return dict(arm=arm, rows=len(rows), prefilled_rows=stats.prefilled_rows,
                shared_prefill_rows=stats.shared_prefill_rows, target_calls=stats.iterations, tokens=tokens,
                wall_s=wall, tokens_per_s=tokens / wall, tokens_per_cpu_s=tokens / run["cpu_s"])


def main(argv=None) -> None:
    args = parse_args(argv)
    report = Report("bench_samples", argv=None if argv is None else ["scripts/bench_samples.py", *argv], args=args)
    print(report.header())
    torch.set_num_threads(args.threads)
    target, draft, prompts = workload(args)
    arms = {arm: (lambda arm=arm: run_arm(target, draft, prompts, args, arm)) for arm in ARMS}
    with torch.inference_mode():
        results = interleaved(arms, rounds=args.repeats)  # load drifts over every arm alike
    summary_rows = []
    for arm in ARMS:
        runs = results[arm]
        row = {k: runs[0][k] for k in ("arm", "rows", "prefilled_rows", "shared_prefill_rows", "target_calls",
                                       "tokens")}
        for key in ("wall_s", "tokens_per_s", "tokens_per_cpu_s"):
            row[key] = summary(r[key] for r in runs)["median"]
        row["tokens_per_s_interval"] = summary(r["tokens_per_s"] for r in runs)
        summary_rows.append(row)
        print(f"{arm:9s} rows {row['rows']:4d}  prefilled {row['prefilled_rows']:4d}  shared "
              f"{row['shared_prefill_rows']:4d}  target calls {row['target_calls']:5d}  tokens {row['tokens']:6d}  "
              f"{row['tokens_per_s']:8.1f} tok/s  {row['tokens_per_cpu_s']:8.1f} tok/CPU s")
    if args.json:
        columns = ["arm", "rows", "prefilled_rows", "shared_prefill_rows", "target_calls", "tokens", "tokens_per_s",
                   "tokens_per_cpu_s"]
        report.write(args.json, {"summary": summary_rows, "runs": results}, markdown=table(summary_rows, columns))


if __name__ == "__main__":
    main()
