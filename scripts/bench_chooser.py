"""The online chooser offline: record per-iteration traces of every default candidate, then replay the chooser.

    python scripts/bench_chooser.py trace --batch-size 1 --prompts 10 --out trace_b1.json
    python scripts/bench_chooser.py trace --batch-size 8 --prompts 32 --interleaved --out trace_b8_interleaved.json
    python scripts/bench_chooser.py replay benchmarks/results/chooser_replay/trace_b1.json --tokens 640 --seeds 60
    python scripts/bench_chooser.py replay benchmarks/results/chooser_replay/trace_b8.json --tokens 2048 --seeds 30 --rows 8

`trace`: the embedded pair (float32, one thread), the first --prompts prompts of assets/prompts.jsonl, 64
new tokens each (EOS stops a row), a `spectr.ContinuousBatcher` of --batch-size slots. Sequential: each
candidate of `default_candidates(8, 8)` runs the whole batch alone, one after another. `--interleaved`: one
batch, the configuration changing at every iteration in a fixed cycle, so that every candidate's seconds are
measured under the same machine conditions (a loaded machine drifts by tens of percent over minutes; a
sequential trace carries that drift into the ranking); an iteration that follows an autoregressive one paid
the draft's catch-up and is flagged. Output: {label: {"iterations": [[tokens, seconds, prefill_seconds,
rows(, after_autoregressive)], ...]}} plus `meta` (command, date, machine).

`replay`: the chooser (`OnlineChooser` with the prior's latencies) run on iterations drawn (bootstrap) from
a trace until --tokens are generated, --seeds times; reported: its tokens/s over the best candidate's, the
mean, 5th percentile, median and the share of seeds under 0.95. It times nothing.
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from harness import Report  # noqa: E402

from spectr.planner.chooser import OnlineChooser, default_candidates  # noqa: E402
from spectr.planner.prior import PriorLatencies, prior_tokens_per_second  # noqa: E402
from spectr.steps import StepReport  # noqa: E402


def load_workload(count: int):
    import torch
    import transformers

    torch.set_num_threads(1)
    models = REPO / "assets" / "models"
    tokenizer = transformers.AutoTokenizer.from_pretrained(models / "target")
    load = transformers.AutoModelForCausalLM.from_pretrained
    target, draft = load(models / "target", dtype=torch.float32), load(models / "draft", dtype=torch.float32)
    lines = (REPO / "assets" / "prompts.jsonl").read_text().splitlines()[:count]
    return tokenizer, target, draft, [tokenizer(json.loads(line)["prompt"])["input_ids"] for line in lines]


def trace_sequential(batch: int, count: int) -> dict:
    import spectr

    tokenizer, target, draft, prompts = load_workload(count)
    common = dict(batch_size=batch, max_length=512, eos_token_id=tokenizer.eos_token_id, max_num_drafts=8,
                  max_draft_length=8)
    traces = {}
    for config in default_candidates(8, 8):
        batcher = spectr.ContinuousBatcher(target, draft, method=config.method, num_drafts=max(1, config.num_drafts),
                                           draft_length=max(1, config.draft_length), **common)
        batcher.admit(prompts, max_new_tokens=64, seed=list(range(len(prompts))))
        iterations = []
        while not batcher.idle:
            batcher.step(config)
            r = batcher.last_step
            if r is not None:
                iterations.append([r.tokens, r.seconds, r.prefill_seconds, r.rows])
        traces[config.label] = {"iterations": iterations}
        print(f"{config.label:20s} iterations {len(iterations)}", flush=True)
    return traces


def trace_interleaved(batch: int, count: int) -> dict:
    import spectr

    tokenizer, target, draft, prompts = load_workload(count)
    configs = default_candidates(8, 8)
    batcher = spectr.ContinuousBatcher(target, draft, method="spectr", num_drafts=4, draft_length=4,
                                       batch_size=batch, max_length=512, eos_token_id=tokenizer.eos_token_id)
    batcher.admit(prompts, max_new_tokens=64, seed=list(range(len(prompts))))
    traces = {c.label: {"iterations": []} for c in configs}
    step, previous = 0, None
    while not batcher.idle:
        config = configs[step % len(configs)]
        batcher.step(config)
        r = batcher.last_step
        if r is not None:
            after_ar = previous is not None and not previous.speculative and config.speculative
            traces[config.label]["iterations"].append([r.tokens, r.seconds, r.prefill_seconds, r.rows, after_ar])
        previous, step = config, step + 1
    return traces


def replay_once(traces: dict, total_tokens: int, seed: int, rows: int = 1) -> float:
    """The chooser's tokens/s on iterations drawn from `traces` until `total_tokens` are generated."""
    rng = random.Random(seed)
    latencies = PriorLatencies(34087424, 2458560, 8192)  # the embedded pair's parameters and vocabulary
    candidates = [c for c in default_candidates(8, 8) if c.label in traces]  # those the trace recorded
    chooser = OnlineChooser(candidates, lambda c, r, a: prior_tokens_per_second(latencies, c, r, a))
    takes_measure = "measure" in inspect.signature(chooser.observe).parameters
    done, seconds, ar_run = 0, 0.0, 0
    while done < total_tokens:
        config = chooser.choose(rows)
        pools = traces[config.label]
        after_ar = config.speculative and ar_run
        if "after_ar" in pools:  # an interleaved trace: catch-up iterations were recorded as such
            use_after = pools["after_ar"] and (after_ar or not pools["iterations"])
            tokens, step_s, _, r = rng.choice(pools["after_ar"] if use_after else pools["iterations"])[:4]
            extra = 0.0
        else:
            tokens, step_s, _, r = rng.choice(pools["iterations"])[:4]
            extra = 0.003 + 0.0002 * min(ar_run, 80) if after_ar else 0.0  # a modelled catch-up
        measure = not (config.speculative and ar_run)
        ar_run = 0 if config.speculative else ar_run + 1
        accepted, length = tokens - r, max(config.draft_length, 1)
        report = StepReport(config=config, rows=r, tokens=tokens, seconds=step_s + extra, prefill_seconds=0.0,
                            accepted=accepted, tested=min(length * r, accepted + r) if config.speculative else 0)
        chooser.observe(report, measure=measure) if takes_measure else chooser.observe(report)
        done, seconds = done + tokens, seconds + step_s + extra
    return done / seconds


def replay(path: str, total: int, seeds: int, rows: int = 1) -> dict:
    traces = json.loads(Path(path).read_text())
    traces.pop("meta", None)
    if any(len(i) > 4 for v in traces.values() for i in v["iterations"]):  # interleaved: [.., after_ar]
        traces = {k: {"iterations": [i for i in v["iterations"] if i[3] == rows and not i[4]],
                      "after_ar": [i for i in v["iterations"] if i[3] == rows and i[4]]} for k, v in traces.items()}
    elif rows > 1:
        traces = {k: {"iterations": [i for i in v["iterations"] if i[3] == rows]} for k, v in traces.items()}
    rates = {k: sum(i[0] for i in v["iterations"] or v["after_ar"]) / sum(i[1] for i in v["iterations"] or v["after_ar"])
             for k, v in traces.items()}
    best = max(rates.values())
    ratios = [replay_once(traces, total, seed, rows=rows) / best for seed in range(seeds)]
    return dict(mean=statistics.mean(ratios), p5=statistics.quantiles(ratios, n=20)[0],
                median=statistics.median(ratios), under_0_95=sum(r < 0.95 for r in ratios) / len(ratios))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    trace = commands.add_parser("trace")
    trace.add_argument("--batch-size", type=int, default=1)
    trace.add_argument("--prompts", type=int, default=10)
    trace.add_argument("--interleaved", action="store_true")
    trace.add_argument("--out", required=True)
    play = commands.add_parser("replay")
    play.add_argument("trace")
    play.add_argument("--tokens", type=int, default=640)
    play.add_argument("--seeds", type=int, default=60)
    play.add_argument("--rows", type=int, default=1)
    args = parser.parse_args(argv)
    if args.command == "replay":
        print(json.dumps(replay(args.trace, args.tokens, args.seeds, args.rows)))
        return
    report = Report("chooser_trace", argv=None if argv is None else [__file__, *argv], args=args)
    print(report.header(), flush=True)
    record = trace_interleaved if args.interleaved else trace_sequential
    report.write(args.out, record(args.batch_size, args.prompts))


if __name__ == "__main__":
    main()
