"""One forward of a model over a few new tokens at batch 1 on the CPU: MKL's `F.linear` against the engine's
small-row kernel (`spectr.cpu_linear`), interleaved.

    .venv/bin/python scripts/bench_cpu_linear.py [--model models/SmolLM2-135M-Instruct] [--tokens 1 2 3 4 5 6]
        [--prefix 120] [--repeat 15] [--rounds 3] [--threads 1] [--out benchmarks/results/real_model/cpu_linear]

The model's HF forward over `--prefix` cached tokens then T new ones (the cache cropped back after each call),
as a verify of T - 1 drafted tokens runs at batch 1; the kernel arm runs it inside `cpu_linear.active()`. Reported
per T: milliseconds per forward (median over rounds of the mean over `--repeat` calls) for each arm, the kernel's
speed-up, and each arm's cost relative to its own one-token forward (what a verify costs in autoregressive steps).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from harness import Report, interleaved, summary, table  # noqa: E402

from spectr import cpu_linear  # noqa: E402


def forward_ms(model, cache, prefix: int, tokens: int, repeat: int, kernel: bool) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    positions = torch.arange(prefix, prefix + tokens)[None]

    def once():
        model(ids, past_key_values=cache, position_ids=positions, use_cache=True)
        cache.crop(-tokens)

    with torch.inference_mode(), (cpu_linear.active() if kernel else contextlib.nullcontext()):
        once()
        started = time.perf_counter()
        for _ in range(repeat):
            once()
    return (time.perf_counter() - started) / repeat * 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--prefix", type=int, default=120)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    report = Report("cpu_linear", argv=None if argv is None else [__file__, *argv], args=args)
    print(report.header(), flush=True)
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    if cpu_linear.install(model) == 0 or cpu_linear.kernel() is None:
        raise SystemExit("the kernel is off here (SPECTR_CPU_LINEAR=0, or its build failed: see the warning)")
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(torch.randint(0, model.config.vocab_size, (1, args.prefix)), past_key_values=cache, use_cache=True)
    arms = {f"{arm} T={t}": (lambda t=t, k=(arm == "kernel"): forward_ms(model, cache, args.prefix, t, args.repeat, k))
            for t in args.tokens for arm in ("mkl", "kernel")}
    runs = interleaved(arms, rounds=args.rounds, warmup=1, alternate=True)
    ms = {name: summary(values)["median"] for name, values in runs.items()}
    first = args.tokens[0]
    rows = [dict(tokens=t, mkl_ms=round(ms[f"mkl T={t}"], 1), kernel_ms=round(ms[f"kernel T={t}"], 1),
                 speedup=round(ms[f"mkl T={t}"] / ms[f"kernel T={t}"], 2),
                 mkl_vs_own_first=round(ms[f"mkl T={t}"] / ms[f"mkl T={first}"], 2),
                 kernel_vs_own_first=round(ms[f"kernel T={t}"] / ms[f"kernel T={first}"], 2)) for t in args.tokens]
    print(table(rows))
    if args.out:
        report.write(Path(args.out), dict(rows=rows, runs=runs), markdown=table(rows))


if __name__ == "__main__":
    main()
