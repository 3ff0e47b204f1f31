"""Benchmark of sequence-level selection on the CPU, as a ratio to one softmax.

Times `spectr.sequence.select_sequences` at B = 64, K = 8, L = 8, V = 32000 (defaults), the
engine's own call of the same walk ("engine select": `select_tree` with counter-based uniforms
and the row splits of the drafts' shared prefixes) and, in the same run, one `torch.softmax`
over the [B, K, L + 1, V] target logits; reports the
ratio of medians (the steps are interleaved), and the peak resident memory each step adds
above what is already held (Linux VmHWM, reset before each step).

The inputs are built like the engine builds them: logits from random "models", where the
target is the draft plus noise, so acceptance is realistic (neither all nor nothing).

    python scripts/bench_selection.py [--batch 64 --drafts 8 --length 8 --vocab 32000]

--compiled adds the compiled engine's call (`spectr.native.compiled_select_tree`: the same rule under
torch.compile with inductor, every row through the K-draft rule), and prints its compile seconds (first
call minus a steady one), e.g. the figures in spectr/native.py:

    python scripts/bench_selection.py --threads 1 --batch 1 --drafts 1 --length 3 --vocab 8192 \
        --method speculative --repeats 30 --compiled

It does not time the models or drafting; it is not a test (no assertion on speed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Report, interleaved, summary, table, timed  # noqa: E402

from spectr.native import compiled_select_tree  # noqa: E402
from spectr.rng import counter_uniforms, row_keys, sample_categorical  # noqa: E402
from spectr.sequence import row_splits, select_sequences, select_tree, uniforms_shape  # noqa: E402
from spectr.tree import prefix_leaders, shared_depths  # noqa: E402


def build_inputs(batch: int, drafts: int, length: int, vocab: int, seed: int, dtype: torch.dtype):
    """Draft tokens [B, K, L], draft probs [B, K, L, V], target logits [B, K, L + 1, V]."""
    g = torch.Generator().manual_seed(seed)
    draft_logits = 2.0 * torch.randn(batch, drafts, length + 1, vocab, generator=g, dtype=dtype)
    target_logits = draft_logits + 0.5 * torch.randn(draft_logits.shape, generator=g, dtype=dtype)
    draft_logits = draft_logits[:, :, :length]
    draft_probs = torch.softmax(draft_logits, -1)  # [B, K, L, V]
    del draft_logits
    uniforms = torch.rand(batch, drafts, length, generator=g, dtype=torch.float64)
    draft_tokens = sample_categorical(draft_probs, uniforms)  # [B, K, L]
    # Drafts share prefixes in reality; make all drafts of a row agree on their first token
    # half the time, so that the walk sees duplicates and alive counts below K.
    share = torch.rand(batch, generator=g) < 0.5
    draft_tokens[share, :, 0] = draft_tokens[share, :1, 0]
    return draft_tokens, draft_probs, target_logits


def engine_inputs(draft_tokens, target_probs):
    """The engine's tree inputs: per-draft nodes and counter-based uniforms."""
    batch, num_drafts, length = draft_tokens.shape
    node_of = torch.arange(num_drafts * (length + 1)).view(1, num_drafts, length + 1).expand(batch, -1, -1)
    node_probs = target_probs.reshape(batch, num_drafts * (length + 1), -1)  # [B, K * (L + 1), V]
    uniforms = counter_uniforms(row_keys(range(batch)), torch.zeros(batch, dtype=torch.int64),
                                (length + 1) * (num_drafts + 1)).view(batch, length + 1, num_drafts + 1)
    return node_probs, node_of.contiguous(), uniforms


def engine_selection(draft_tokens, draft_probs, target_probs, method: str):
    """The engine's call: select_tree on per-draft nodes, counter-based uniforms, and row splits from
    the drafts' shared prefixes (the engine reads their sizes with its tree-width host copy)."""
    node_probs, node_of, uniforms = engine_inputs(draft_tokens, target_probs)
    shared = shared_depths(prefix_leaders(draft_tokens))  # [B, L]
    splits = row_splits(shared, shared.sum(0).tolist())
    return select_tree(draft_tokens, draft_probs, node_probs, node_of, uniforms, method=method, row_splits=splits)


def compiled_engine_selection(draft_tokens, draft_probs, target_probs, method: str):
    """The compiled engine's call (`spectr.native.compiled_select_tree`) on the same inputs."""
    node_probs, node_of, uniforms = engine_inputs(draft_tokens, target_probs)
    return compiled_select_tree(draft_tokens, draft_probs, node_probs, node_of, uniforms, method=method)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_extra_memory_mib(fn) -> float:
    """Peak resident memory `fn()` adds above the current RSS (Linux: resets VmHWM first)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset the peak-RSS high-water mark of this process
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--drafts", type=int, default=8)
    parser.add_argument("--length", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--method", default="spectr")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compiled", action="store_true", help="also time the compiled engine's selection")
    parser.add_argument("--json", help="write the results here (and the same name with .md)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    report = Report("bench_selection", args=args)
    print(report.header())
    print(
        f"B={args.batch} K={args.drafts} L={args.length} V={args.vocab} method={args.method} "
        f"dtype={args.dtype} torch threads={args.threads} repeats={args.repeats}"
    )
    dtype = getattr(torch, args.dtype)
    draft_tokens, draft_probs, target_logits = build_inputs(
        args.batch, args.drafts, args.length, args.vocab, args.seed, dtype
    )
    target_probs = torch.softmax(target_logits, -1)  # [B, K, L + 1, V]
    call = {"n": 0}

    def softmax():
        return torch.softmax(target_logits, -1)

    def select(validate: bool):
        call["n"] += 1
        keys = row_keys(range(call["n"] * args.batch, (call["n"] + 1) * args.batch))  # [B]
        shape = uniforms_shape(args.drafts, args.length)
        uniforms = counter_uniforms(keys, torch.zeros_like(keys), shape[0] * shape[1]).view(args.batch, *shape)
        return select_sequences(draft_tokens, draft_probs, target_probs, uniforms, method=args.method,
                                validate=validate)

    steps = {
        "softmax": softmax,
        "select": lambda: select(False),
        "select+validate": lambda: select(True),
        "engine select": lambda: engine_selection(draft_tokens, draft_probs, target_probs, args.method),
    }
    compile_s = None
    if args.compiled:
        steps["engine compiled"] = lambda: compiled_engine_selection(draft_tokens, draft_probs, target_probs,
                                                                     args.method)
        start = time.perf_counter()
        first = steps["engine compiled"]()
        first_s = time.perf_counter() - start
        start = time.perf_counter()
        steps["engine compiled"]()
        compile_s = first_s - (time.perf_counter() - start)
        want = steps["engine select"]()
        same = all(torch.equal(getattr(first, f), getattr(want, f)) for f in ("tokens", "num_tokens"))
        print(f"compiled selection: compile {compile_s:.1f} s; same tokens as eager: {same}")
    for fn in steps.values():  # warm up (lazy initialisation, allocator pools)
        fn()
    memory = {name: peak_extra_memory_mib(fn) for name, fn in steps.items()}
    # interleaved, so that load changes hit every step alike
    runs = interleaved({name: (lambda fn=fn: timed(fn)) for name, fn in steps.items()}, rounds=args.repeats)
    times = {name: [run["wall_s"] for run in runs[name]] for name in steps}
    tokens_per_call = [float(run["result"].num_tokens.double().mean()) for run in runs["select"]]
    softmax_s = statistics.median(times["softmax"])
    input_mib = sum(t.numel() * t.element_size() for t in (draft_probs, target_probs, target_logits)) / 2**20
    print(f"inputs held: {input_mib:.0f} MiB; mean tokens per call {statistics.mean(tokens_per_call):.2f}")
    rows = []
    for name in steps:
        median = statistics.median(times[name])
        rows.append(dict(step=name, **{f"{k}_ms": v * 1e3 for k, v in summary(times[name]).items() if k != "n"},
                         ratio_to_softmax=median / softmax_s, peak_extra_mib=memory[name]))
        print(
            f"{name:16s} median {median * 1e3:8.1f} ms  (min {min(times[name]) * 1e3:7.1f} ms)  "
            f"ratio to softmax {median / softmax_s:5.2f}x  peak extra memory {memory[name]:7.1f} MiB"
        )
    if args.compiled:
        ratio = statistics.median(times["engine select"]) / statistics.median(times["engine compiled"])
        print(f"engine select eager / compiled: {ratio:.2f}x (compile {compile_s:.1f} s)")
    if args.json:
        report.write(args.json, dict(steps=rows, compile_s=compile_s), markdown=table(rows))


if __name__ == "__main__":
    main()
