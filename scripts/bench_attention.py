"""Attention of the compiled core, masked against FlexAttention (issue 22, item 5), in one run.

Times the core's own attention functions (`spectr.native.NativeCore._attend`, and `_block_mask` +
`NativeCore._attend_flex`) over all layers of a model, compiled with inductor (fullgraph, static shapes)
and eager-masked, interleaved, on a tree pattern: T new tokens (a root and branches, as a verify) after S
cached slots, per row. Reports medians and each compile's seconds; writes `result.json` under --out.
Nothing asserts a speed.

    .venv/bin/python scripts/bench_attention.py --threads 1 --out benchmarks/results/compile/attention
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))
from harness import Report, interleaved, sync, table  # noqa: E402

from spectr.native import NativeCore, _block_mask  # noqa: E402


def inputs(core: NativeCore, rows: int, new: int, cached: int, device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dim = core.head_dim
    query = torch.randn(rows, core.heads, new, dim, generator=g).to(device)
    cache_kv = torch.randn(2, rows, core.kv_heads, cached, dim, generator=g).to(device)
    new_kv = torch.randn(2, rows, core.kv_heads, new, dim, generator=g).to(device)
    cache_allowed = (torch.rand(rows, new, cached, generator=g) < 0.9).to(device)
    cache_allowed[..., 0] = True
    tree = torch.eye(new, dtype=torch.bool)
    tree[:, 0] = True  # every node sees the root
    tree[2:, 1] = torch.arange(2, new) % 2 == 0  # two branches
    new_allowed = tree.expand(rows, new, new).contiguous().to(device)
    return query, cache_kv, new_kv, cache_allowed, new_allowed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO_ROOT / "assets" / "models" / "target"))
    parser.add_argument("--shapes", default="1x5x128,16x5x256", help="rows x new tokens x cached slots, comma-separated")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval().to(device)
    core = NativeCore(model)
    layers = len(core.layers)

    def chained(query, out):
        """The next layer's query from this one's output (so no layer's work is a duplicate to eliminate)."""
        batch, _, new, dim = query.shape
        return out.view(batch, new, core.heads, dim).transpose(1, 2)

    def masked(query, cache_kv, new_kv, cache_allowed, new_allowed):
        for _ in range(layers):
            out = core._attend(query, cache_kv[0], cache_kv[1], new_kv[0], new_kv[1], cache_allowed, new_allowed)
            query = chained(query, out)
        return out

    def flex(query, cache_kv, new_kv, cache_allowed, new_allowed):
        block = _block_mask(cache_allowed, new_allowed)  # once per forward, as the core does
        for _ in range(layers):
            out = core._attend_flex(query, cache_kv[0], cache_kv[1], new_kv[0], new_kv[1], block)
            query = chained(query, out)
        return out

    report = Report("bench_attention", args=args)
    print(report.header())
    print(f"device={device} threads={args.threads} layers={layers} heads={core.heads}/{core.kv_heads} "
          f"dim={core.head_dim}")
    results = []
    for shape in args.shapes.split(","):
        rows, new, cached = map(int, shape.split("x"))
        tensors = inputs(core, rows, new, cached, device)
        arms = {"masked eager": masked}
        compile_s = {}
        for name, fn in (("masked compiled", masked), ("flex compiled", flex)):
            compiled = torch.compile(fn, fullgraph=True, dynamic=False)
            start = time.perf_counter()
            with torch.inference_mode():
                compiled(*tensors)
            compile_s[name] = time.perf_counter() - start
            arms[name] = compiled
        with torch.inference_mode():
            reference = masked(*tensors)
            error = float((arms["flex compiled"](*tensors) - reference).abs().max())
        def calls(fn, tensors=tensors):
            """Seconds of each of --calls calls of `fn` (CUDA synchronised around each)."""
            seconds = []
            with torch.inference_mode():
                for _ in range(args.calls):
                    sync()
                    start = time.perf_counter()
                    fn(*tensors)
                    sync()
                    seconds.append(time.perf_counter() - start)
            return seconds

        runs = interleaved({name: (lambda fn=fn: calls(fn)) for name, fn in arms.items()}, rounds=args.repeats)
        medians = {name: statistics.median(t for run in r for t in run) * 1e3 for name, r in runs.items()}
        row = dict(rows=rows, new=new, cached=cached, median_ms=medians, compile_s=compile_s, max_abs_error=error,
                   flex_over_masked_compiled=medians["flex compiled"] / medians["masked compiled"])
        results.append(row)
        print(f"B={rows} T={new} S={cached}: " + ", ".join(f"{n} {m:.3f} ms" for n, m in medians.items())
              + f"; flex / masked (compiled) {row['flex_over_masked_compiled']:.2f}x; compile "
              + ", ".join(f"{n} {s:.1f} s" for n, s in compile_s.items()) + f"; max |flex - masked| {error:.1e}")
    if args.out:
        flat = [dict(shape=f"{r['rows']}x{r['new']}x{r['cached']}", **{f"{n} ms": m for n, m in r["median_ms"].items()},
                     flex_over_masked=r["flex_over_masked_compiled"]) for r in results]
        report.write(Path(args.out) / "result.json", dict(device=str(device), threads=args.threads, results=results),
                     markdown=table(flat))


if __name__ == "__main__":
    main()
