"""Structured outputs' cost (issue 50): the same rows with and without their grammars, on the embedded pair.

Same prompts (the first N of assets/prompts.jsonl), seeds and budget; one third each `json` (a schema with an enum,
a bounded integer and a bounded string), `regex` and `choice`. For each method (autoregressive, and the speculative
ones with K drafts of L tokens) it runs the rows unconstrained and constrained, alternating, `--repeat` times, and
prints each run's whole-run tokens per second (generated tokens / wall seconds, prefill included), tokens per
CPU-second of the process (`time.process_time`: steadier than the wall clock on a machine other work shares),
block efficiency, mean completion length and the grammar work's share. CPU by default (`--device`).

    .venv/bin/python scripts/bench_structured.py [--rows 96] [--batch-size 32] [--max-new-tokens 64] [--repeat 2]
        [--json out.json]

`--jobs OUT` measures whole default jobs instead (`python -m jobs.generate`, through `bench_job_arms.py`): the same
rows with a per-row `sampling_params.structured_outputs`, and without it at the same per-row lengths (see
`whole_jobs`), under `auto` and forced autoregressive, `--repeat` rounds ABBA; OUT.json / OUT.md get each arm's
throughput and block efficiency.
`--single`: one actor at `spectr.batch_size=1`, where speculation pays on a CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from harness import Report, interleaved, table, timed  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "label": {"enum": ["positive", "negative", "neutral"]},
    "score": {"type": "integer", "minimum": 0, "maximum": 100},
    "reason": {"type": "string", "minLength": 1, "maxLength": 24}},
    "required": ["label", "score", "reason"], "additionalProperties": False}
KINDS = [{"json": SCHEMA, "whitespace_pattern": "[ ]?"}, {"regex": r"[A-Z][a-z]{2,10} (is|was) [a-z]{3,12}\."},
         {"choice": ["happy", "sad", "angry", "calm"]}]
METHODS = [("autoregressive", 1, 1), ("spectr", 2, 4), ("block", 1, 4)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="write the medians here (and .md)")
    parser.add_argument("--jobs", metavar="OUT", help="whole default jobs instead, results to OUT.json / OUT.md")
    parser.add_argument("--single", action="store_true",
                        help="with --jobs: one actor at spectr.batch_size=1 (as bench_jobs.py's `single`)")
    args = parser.parse_args()
    if args.jobs:
        return whole_jobs(args)
    report = Report("bench_structured", args=args)
    print(report.header(), flush=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spectr.generate import generate
    from spectr.structured import RowGrammars, StructuredCompiler

    tokenizer = AutoTokenizer.from_pretrained(REPO / "assets/models/target")
    target = AutoModelForCausalLM.from_pretrained(REPO / "assets/models/target").to(args.device)
    draft = AutoModelForCausalLM.from_pretrained(REPO / "assets/models/draft").to(args.device)
    lines = (REPO / "assets/prompts.jsonl").read_text().splitlines()[: args.rows]
    prompts = [tokenizer(json.loads(line)["prompt"])["input_ids"] for line in lines]
    specs = [KINDS[i % 3] for i in range(len(prompts))]
    compiler = StructuredCompiler(tokenizer, vocab_size=target.config.vocab_size)
    grammar_seconds = [0.0]
    allowed = RowGrammars.allowed

    def timed_allowed(self, *a, **k):
        start = time.perf_counter()
        try:
            return allowed(self, *a, **k)
        finally:
            grammar_seconds[0] += time.perf_counter() - start

    RowGrammars.allowed = timed_allowed
    print(f"# {torch.get_num_threads()} torch threads, device {args.device}; {len(prompts)} rows, batch "
          f"{args.batch_size}, max_new_tokens {args.max_new_tokens}")

    def one_run(method: str, num_drafts: int, draft_length: int, constrained: bool) -> tuple:
        grammar_seconds[0] = 0.0
        run = timed(lambda: generate(target, None if method == "autoregressive" else draft, prompts, method=method,
                                     num_drafts=num_drafts, draft_length=draft_length,
                                     max_new_tokens=args.max_new_tokens, eos_token_id=tokenizer.eos_token_id, seed=0,
                                     batch_size=args.batch_size, structured_outputs=specs if constrained else None,
                                     tokenizer=compiler))
        out, wall, cpu = run["result"], run["wall_s"], run["cpu_s"]
        tokens = sum(map(len, out.tokens))
        row = (tokens / wall, out.stats.block_efficiency, tokens / len(prompts), grammar_seconds[0] / wall,
               tokens / cpu)
        st = out.stats  # other: prefill and admission, outside the iterations' phases
        print(f"{method:14s} K={num_drafts} L={draft_length} constrained={constrained!s:5s} "
              f"{row[0]:7.1f} tok/s  {row[4]:6.1f} tok/CPU-s  block efficiency {row[1]:.2f}  "
              f"mean length {row[2]:.1f}  "
              f"masks {100 * row[3]:.1f}% of wall  (s: draft {st.draft_seconds:.1f} target "
              f"{st.target_seconds:.1f} selection {st.selection_seconds:.1f} other {st.other_seconds:.1f}; "
              f"iterations {st.iterations})", flush=True)
        return row

    arms = {(method, k, length, constrained): (lambda c=(method, k, length, constrained): one_run(*c))
            for method, k, length in METHODS for constrained in (False, True)}
    results = interleaved(arms, rounds=args.repeat)  # unconstrained and constrained alternate
    print("# medians")
    medians = []
    for (method, k, length, constrained), rows in results.items():
        medians.append(dict(method=method, K=k, L=length, constrained=constrained,
                            tokens_per_s=statistics.median(r[0] for r in rows),
                            tokens_per_cpu_s=statistics.median(r[4] for r in rows),
                            block_efficiency=statistics.median(r[1] for r in rows),
                            mask_share=statistics.median(r[3] for r in rows)))
    print(table(medians))
    if args.json:
        report.write(args.json, dict(medians=medians, runs={str(k): v for k, v in results.items()}),
                     markdown=table(medians))


def whole_jobs(args) -> None:
    """Whole jobs: the rows constrained, and unconstrained at the same lengths, under `auto` and autoregressive,
    interleaved ABBA. Constrained rows end early (a label, a short JSON object): left free they would run to
    their budget, and tokens per second would then compare a few long rows against many short ones (each row's
    prefill and admission spread over fewer tokens). So a first constrained job (autoregressive) sets each row's
    length, and the unconstrained rows get that many tokens (`max_tokens`, `ignore_eos`): the same work in
    tokens, with and without the grammar."""
    import bench_job_arms

    from pipeline.generate.reader import read_output

    work = Path(args.jobs).with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in (REPO / "assets/prompts.jsonl").read_text().splitlines()[: args.rows]]
    common = [f"spectr.max_new_tokens={args.max_new_tokens}", "data.sampling_params_column=sampling_params"]
    common += ["ray.num_actors=1", "spectr.batch_size=1"] if args.single else []
    constrained = work / "constrained.jsonl"
    constrained.write_text("".join(json.dumps({**row, "sampling_params": {"structured_outputs": KINDS[i % 3]}}) + "\n"
                                   for i, row in enumerate(rows)))
    first = bench_job_arms.run_job("lengths", [f"data.path={constrained}", "spectr.method=autoregressive", *common],
                                   REPO, work, 0, None)
    assert first["returncode"] == 0, first.get("error")
    table = read_output(work / "lengths-0").to_pydict()
    lengths = {i: len(t) for i, t in zip(table["id"], table["completion_token_ids"], strict=True)}
    free = work / "free_same_lengths.jsonl"
    free.write_text("".join(json.dumps({**row, "sampling_params": {"max_tokens": max(1, lengths[row["id"]]),
                                                                    "ignore_eos": True}}) + "\n" for row in rows))
    print(f"# constrained rows' lengths (autoregressive job): mean {statistics.mean(lengths.values()):.1f}, "
          f"{sum(lengths.values())} tokens; the free rows get the same", flush=True)
    arms = []
    for method in ("auto", "autoregressive"):
        for name, path in (("free", free), ("constrained", constrained)):
            arms += ["--arm", f"{name}-{method}", f"data.path={path}", f"spectr.method={method}", *common]
    bench_job_arms.main([*arms, "--rounds", str(args.repeat), "--alternate", "--out", str(work / "jobs")])

if __name__ == "__main__":
    main()
