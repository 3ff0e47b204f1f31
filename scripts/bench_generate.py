"""`spectr.generate` in one process, some configurations against each other on the embedded pair, interleaved.

    python scripts/bench_generate.py --batch-size 1 --rounds 3 \
        autoregressive block:1:2 block:1:3 block:1:4 speculative:1:1 spectr:2:2 auto:8:8
    python scripts/bench_generate.py --batch-size 16 --prompts 32 --rounds 2 --warmup 1 \
        autoregressive autoregressive:1:1:compiled speculative:1:3 speculative:1:3:compiled

Each configuration is `METHOD[:K:L[:compiled]]`. Workload: the first --prompts prompts of
assets/prompts.jsonl with the pair's tokenizer, --max-new-tokens each (EOS stops a row), row i seeded
round + i (so the rounds draw differently and every configuration sees the same seeds in a round).
Reported per configuration: tokens/s (median and interval over rounds), target calls per generated token,
and the engine's own per-iteration split (draft, target, selection, other; ms). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from harness import Report, interleaved, summary, table  # noqa: E402

import spectr  # noqa: E402


def parse_config(text: str) -> dict:
    method, *rest = text.split(":")
    num_drafts, draft_length = (int(rest[0]), int(rest[1])) if len(rest) >= 2 else (1, 1)
    return dict(method=method, num_drafts=num_drafts, draft_length=draft_length,
                compile="compiled" in rest[2:])


def run(target, draft, prompts, config: dict, args, round_index: int, eos) -> dict:
    out = spectr.generate(target, draft, prompts, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                          seed=[round_index + i for i in range(len(prompts))], eos_token_id=eos, **config)
    stats, tokens = out.stats, sum(len(t) for t in out.tokens)
    per_iteration = {f"{phase}_ms": 1e3 * getattr(stats, f"{phase}_seconds") / max(stats.iterations, 1)
                     for phase in ("draft", "target", "selection", "other")}
    return dict(tokens=tokens, tokens_per_s=tokens / stats.wall_seconds, iterations=stats.iterations,
                tokens_per_iteration=tokens / max(stats.iterations, 1), **per_iteration)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+", help="METHOD[:K:L[:compiled]]")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=0, help="rounds run first and dropped (compiles)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="write <out>.json and .md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = Report("bench_generate", argv=None if argv is None else [__file__, *argv], args=args)
    print(report.header(), flush=True)
    models = REPO / "assets" / "models"
    load = transformers.AutoModelForCausalLM.from_pretrained
    target, draft = load(models / "target", dtype=torch.float32).eval(), load(models / "draft", dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(models / "target")
    with open(REPO / "assets" / "prompts.jsonl") as lines:
        texts = [json.loads(line)["prompt"] for line, _ in zip(lines, range(args.prompts))]
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    rounds_done = {name: 0 for name in args.configs}

    def arm(name: str) -> dict:
        rounds_done[name] += 1
        return run(target, draft, prompts, parse_config(name), args, rounds_done[name], tokenizer.eos_token_id)

    def progress(round_index, name, result):
        print(f"round {round_index + 1} {name:<28} {result['tokens_per_s']:7.1f} tok/s  "
              f"{result['tokens_per_iteration']:.2f} tok/it", flush=True)

    runs = interleaved({name: (lambda name=name: arm(name)) for name in args.configs}, rounds=args.rounds,
                       warmup=args.warmup, on_run=progress)
    rows = []
    for name, results in runs.items():
        speed = summary(r["tokens_per_s"] for r in results)
        rows.append(dict(config=name, tokens_per_s=speed["median"], low=speed["low"], high=speed["high"],
                         **{k: summary(r[k] for r in results)["median"] for k in results[0] if k.endswith("_ms")},
                         tokens_per_iteration=summary(r["tokens_per_iteration"] for r in results)["median"]))
    print(table(rows))
    if args.out:
        report.write(args.out, dict(rows=rows, runs=runs), markdown=table(rows))


if __name__ == "__main__":
    main()
