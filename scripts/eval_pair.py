"""Measure a draft/target pair: held-out loss, single-draft acceptance, and B=1 forward cost.

What this is: the script whose output fills the model card in ``assets/models/README.md``.

- Held-out loss: mean next-token cross-entropy (nats/token) of each model on the held-out stdlib modules
  listed in the pair's ``manifest.json``, read as in training (``BOS module EOS`` concatenated) and cut
  into non-overlapping windows of ``--window`` predicted tokens. Also on the default prompts.
- Acceptance: at temperature 1, the mean over the same positions of sum_x min(p(x), q(x)), the
  probability that one draft token is accepted by speculative sampling (p = draft, q = target).
- Latency: at batch size 1 in float32, the median wall time of a 128-token prefill and of one cached
  single-token decode step (after a 128-token prefill), for each model, interleaved in the same run.

What this is not: a generation benchmark (see the benchmark job) or a test; nothing here is asserted.

Run: ``python scripts/eval_pair.py --pair assets/models --prompts assets/prompts.jsonl --out eval.json``
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.train_pair.corpus import read_sources
from pipeline.train_pair.tokenizer import tokenize_documents

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Report, interleaved  # noqa: E402


def load_pair(pair_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pair_dir / "target")
    target = AutoModelForCausalLM.from_pretrained(pair_dir / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(pair_dir / "draft", dtype=torch.float32).eval()
    return tokenizer, target, draft


@torch.no_grad()
def score_sequences(target, draft, sequences: list[torch.Tensor], batch_size: int) -> dict:
    """Sum of target CE, draft CE and sum_x min(p, q) over every predicted position of the sequences.

    sequences: list of # [T_i + 1] int64 (inputs plus the final label); equal lengths batch together.
    """
    totals = {"positions": 0, "target_nll": 0.0, "draft_nll": 0.0, "overlap": 0.0}
    by_length: dict[int, list[torch.Tensor]] = {}
    for seq in sequences:
        by_length.setdefault(seq.numel(), []).append(seq)
    for group in by_length.values():
        for start in range(0, len(group), batch_size):
            batch = torch.stack(group[start: start + batch_size])  # [B, T+1]
            inputs, labels = batch[:, :-1], batch[:, 1:]  # [B, T]
            target_log_probs = F.log_softmax(target(input_ids=inputs).logits.float(), dim=-1)  # [B, T, V]
            draft_log_probs = F.log_softmax(draft(input_ids=inputs).logits.float(), dim=-1)  # [B, T, V]
            totals["target_nll"] -= target_log_probs.gather(-1, labels[..., None]).sum().item()
            totals["draft_nll"] -= draft_log_probs.gather(-1, labels[..., None]).sum().item()
            overlap = torch.minimum(target_log_probs.exp(), draft_log_probs.exp()).sum(-1)  # [B, T]
            totals["overlap"] += overlap.sum().item()
            totals["positions"] += labels.numel()
    n = max(totals["positions"], 1)
    return {"positions": totals["positions"], "target_loss": totals["target_nll"] / n,
            "draft_loss": totals["draft_nll"] / n, "acceptance": totals["overlap"] / n}


def heldout_windows(stream: torch.Tensor, window: int, max_tokens: int | None) -> list[torch.Tensor]:
    """Non-overlapping windows of ``window`` predicted tokens (``window + 1`` ids each). # list of [window+1]

    With ``max_tokens``, an evenly spaced subset of the windows, so that every part of the stream is sampled.
    """
    windows = [stream[i: i + window + 1].long() for i in range(0, stream.numel() - window, window)]
    if max_tokens is not None and len(windows) * window > max_tokens:
        keep = max(1, max_tokens // window)
        windows = [windows[round(i * (len(windows) - 1) / max(keep - 1, 1))] for i in range(keep)]
    return windows


@torch.no_grad()
def measure_latency(target, draft, vocab_size: int, prefill_tokens: int, repeats: int,
                    generator: torch.Generator) -> dict:
    """Median seconds per B=1 forward: a ``prefill_tokens`` prefill, and one cached decode step.

    Target and draft alternate inside each repeat so that load from other processes hits both alike.
    """
    prompt = torch.randint(0, vocab_size, (1, prefill_tokens), generator=generator)  # [1, P]
    next_token = torch.randint(0, vocab_size, (1, 1), generator=generator)  # [1, 1]
    def forwards(model) -> dict:
        start = time.perf_counter()
        cache = model(input_ids=prompt, use_cache=True).cache
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        model(input_ids=next_token, cache=cache, use_cache=True)
        return {"prefill": prefill_s, "decode": time.perf_counter() - start}

    runs = interleaved({"target": lambda: forwards(target), "draft": lambda: forwards(draft)}, rounds=repeats,
                       warmup=2)
    times = {name: {phase: [r[phase] for r in runs[name]] for phase in ("prefill", "decode")} for name in runs}
    result = {}
    for name in ("target", "draft"):
        for phase in ("prefill", "decode"):
            result[f"{name}_{phase}_ms"] = 1000 * statistics.median(times[name][phase])
    result["prefill_tokens"] = prefill_tokens
    result["prefill_ratio"] = result["target_prefill_ms"] / result["draft_prefill_ms"]
    result["decode_ratio"] = result["target_decode_ms"] / result["draft_decode_ms"]
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="assets/models", help="directory with target/, draft/, manifest.json")
    parser.add_argument("--prompts", default="assets/prompts.jsonl")
    parser.add_argument("--stdlib-dir", default=None, help="default: the stdlib_dir in the manifest")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--max-heldout-tokens", type=int, default=None, help="cap on scored held-out tokens")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--latency-repeats", type=int, default=30)
    parser.add_argument("--prefill-tokens", type=int, default=128)
    parser.add_argument("--only-latency", action="store_true", help="skip the loss and acceptance passes")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--markdown", default=None, help="write the model card's results table here")
    args = parser.parse_args(argv)
    report = Report("eval_pair", argv=None if argv is None else [__file__, *argv], args=args)

    torch.set_num_threads(args.threads)
    pair = Path(args.pair)
    manifest = json.loads((pair / "manifest.json").read_text())
    tokenizer, target, draft = load_pair(pair)
    results: dict = {
        "pair": str(pair), "python_version": platform.python_version(), "torch_threads": args.threads,
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "draft_parameters": sum(p.numel() for p in draft.parameters()),
        "vocab_size": len(tokenizer),
        "same_vocab": target.config.vocab_size == draft.config.vocab_size == len(tokenizer),
    }
    if platform.python_version() != manifest["python_version"]:
        print(f"warning: trained on Python {manifest['python_version']}'s stdlib, evaluating on "
              f"{platform.python_version()}'s", file=sys.stderr)

    if args.only_latency:
        results["latency"] = measure_latency(target, draft, len(tokenizer), args.prefill_tokens,
                                             args.latency_repeats, torch.Generator().manual_seed(0))
        print(f"latency: {results['latency']}", flush=True)
        if args.out:
            report.write(args.out, results)
        return results

    # 1) held-out modules
    stdlib_dir = Path(args.stdlib_dir or manifest["stdlib_dir"])
    stream = tokenize_documents(tokenizer, read_sources(stdlib_dir, manifest["heldout_modules"]))  # [N]
    start = time.perf_counter()
    heldout = score_sequences(target, draft, heldout_windows(stream, args.window, args.max_heldout_tokens),
                              args.batch_size)
    results["heldout"] = {**heldout, "modules": len(manifest["heldout_modules"]),
                          "stream_tokens": int(stream.numel()),
                          "seconds": round(time.perf_counter() - start, 1)}
    print(f"held-out: {heldout}", flush=True)

    # 2) default prompts: every prompt token after BOS is a predicted position
    if args.prompts and Path(args.prompts).exists():
        rows = [json.loads(line) for line in Path(args.prompts).read_text(encoding="utf-8").splitlines()]
        sequences = [torch.tensor(tokenizer(row["prompt"])["input_ids"]) for row in rows]  # [T_i + 1]
        prompt_scores = score_sequences(target, draft, sequences, args.batch_size)
        lengths = [seq.numel() for seq in sequences]
        results["prompts"] = {**prompt_scores, "count": len(rows), "max_tokens": max(lengths),
                              "mean_tokens": sum(lengths) / len(lengths)}
        print(f"prompts: {results['prompts']}", flush=True)

    # 3) B=1 forward cost, target vs draft, same run
    generator = torch.Generator().manual_seed(0)
    results["latency"] = measure_latency(target, draft, len(tokenizer), args.prefill_tokens,
                                         args.latency_repeats, generator)
    print(f"latency: {results['latency']}", flush=True)

    if args.out:
        report.write(args.out, results)
    if args.markdown:
        Path(args.markdown).write_text(results_table(results, manifest))
    return results


def results_table(results: dict, manifest: dict) -> str:
    """The model card's table of measured numbers."""
    heldout, latency = results["heldout"], results["latency"]
    prompts = results.get("prompts")
    rows = [
        ("parameters", f"{results['target_parameters']:,}", f"{results['draft_parameters']:,}"),
        (f"held-out loss, nats/token ({heldout['positions']:,} scored positions of the {heldout['modules']} "
         f"held-out modules' {heldout.get('stream_tokens', 0):,} tokens)",
         f"{heldout['target_loss']:.3f}", f"{heldout['draft_loss']:.3f}"),
    ]
    if prompts:
        rows.append((f"loss on the default prompts, nats/token ({prompts['positions']:,} positions)",
                     f"{prompts['target_loss']:.3f}", f"{prompts['draft_loss']:.3f}"))
    rows += [
        (f"B=1 prefill of {latency.get('prefill_tokens', 128)} tokens, ms (median, fp32, "
         f"{results['torch_threads']} threads)", f"{latency['target_prefill_ms']:.2f}",
         f"{latency['draft_prefill_ms']:.2f}"),
        ("B=1 cached one-token decode step, ms (median)", f"{latency['target_decode_ms']:.2f}",
         f"{latency['draft_decode_ms']:.2f}"),
    ]
    lines = ["| measured | target | draft |", "|---|---|---|"]
    lines += [f"| {name} | {t} | {d} |" for name, t, d in rows]
    lines += [
        "",
        f"- Single-draft acceptance sum_x min(p, q) at temperature 1, mean over the held-out positions: "
        f"**{heldout['acceptance']:.3f}**" + (f"; over the default prompts' positions: {prompts['acceptance']:.3f}"
                                               if prompts else ""),
        f"- Target/draft B=1 forward cost: **{latency['prefill_ratio']:.1f}x** for the prefill, "
        f"**{latency['decode_ratio']:.1f}x** for a cached decode step.",
        f"- Training: {manifest.get('steps', '?')} steps, {manifest.get('tokens_seen', 0):,} tokens seen, "
        f"{manifest.get('train_seconds', 0) / 60:.1f} min, stopped by {manifest.get('stopped_by', '?')}.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
