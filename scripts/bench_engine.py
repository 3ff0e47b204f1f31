"""Benchmark of the spectr.generate engine against Hugging Face generate, in one run on one machine.

Measures (printed as a table, and as JSON with --json):
1. engine overhead: wall time / time inside model forwards (draft + target), at B = 1 and B = 16;
2. our `autoregressive` vs HF `generate(do_sample=True, top_k=0)`, tokens/s at B = 1 and B = 16;
3. our `speculative` vs HF assisted generation (`assistant_model=`, constant schedule,
   num_assistant_tokens = L, confidence stopping off), tokens/s at B = 1;
4. block efficiency over a K x L grid (method spectr, B = 16);
5. peak resident memory of a fresh process running B = 16, K = 4, L = 4 (and CUDA peak on GPU).

Models: --target/--draft directories (from_pretrained), or by default random Llama models of
about the embedded pair's size (target ~30M params: hidden 512, 8 layers, vocab 8192; draft
~2.5M: hidden 128, 2 layers). With random weights acceptance says nothing about real speed-ups;
both sides of every ratio use the same pair, prompts and sampling settings.

Timings: each measurement is repeated (--repeats) with ours and HF interleaved, and the median
is reported. This is a benchmark script, not a test; nothing here asserts a speed.

    .venv/bin/python scripts/bench_engine.py --threads 1   # full run (~10 min on a loaded 2-core VM)
    .venv/bin/python scripts/bench_engine.py --quick       # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import spectr  # noqa: E402


def build_models(args):
    if args.target:
        target = transformers.AutoModelForCausalLM.from_pretrained(args.target, dtype=args.dtype)
        draft = transformers.AutoModelForCausalLM.from_pretrained(args.draft, dtype=args.dtype)
        source = f"from_pretrained: target={args.target}, draft={args.draft}"
    else:
        def llama(hidden, layers, heads, seed):
            config = transformers.LlamaConfig(
                vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=2048,
                tie_word_embeddings=False,
            )
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                return transformers.LlamaForCausalLM(config)

        target, draft = llama(512, 8, 8, 0), llama(128, 2, 4, 1)
        source = "random Llama (seeded): target hidden 512 x 8 layers, draft hidden 128 x 2 layers, vocab 8192"
    dtype = getattr(torch, args.dtype)
    target = target.to(args.device, dtype).eval()
    draft = draft.to(args.device, dtype).eval()
    return target, draft, source


def params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=generator).tolist()


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_ours(target, draft, prompts, args, **kwargs):
    sync(args.device)
    start = time.perf_counter()
    out = spectr.generate(target, draft, prompts, max_new_tokens=args.new_tokens, seed=list(range(len(prompts))),
                          **kwargs)
    sync(args.device)
    wall = time.perf_counter() - start
    tokens = sum(len(t) for t in out.tokens)
    return dict(wall=wall, tokens=tokens, tokens_per_s=tokens / wall, stats=out.stats)


@torch.inference_mode()
def run_hf(target, prompts, args, assistant=None, draft_length=4):
    ids = torch.tensor(prompts, device=args.device)
    kwargs = dict(do_sample=True, top_k=0, top_p=1.0, temperature=1.0, max_new_tokens=args.new_tokens,
                  min_new_tokens=args.new_tokens, pad_token_id=0, eos_token_id=None)
    if assistant is not None:
        assistant.generation_config.num_assistant_tokens = draft_length
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = assistant
    torch.manual_seed(0)
    sync(args.device)
    start = time.perf_counter()
    out = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    sync(args.device)
    wall = time.perf_counter() - start
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return dict(wall=wall, tokens=tokens, tokens_per_s=tokens / wall)


def median(runs, key):
    return statistics.median(r[key] for r in runs)


def compare(name, ours_fn, theirs_fn, repeats):
    ours, theirs = [], []
    ours_fn(), theirs_fn()  # warm-up
    for _ in range(repeats):
        ours.append(ours_fn())
        theirs.append(theirs_fn())
    a, b = median(ours, "tokens_per_s"), median(theirs, "tokens_per_s")
    return dict(name=name, ours_tokens_per_s=a, hf_tokens_per_s=b, ratio=a / b, ours_runs=ours)


def _proc_status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def memory_probe(args) -> dict:
    """Run in a fresh process: load the models, reset the peak-RSS mark, run B=16, K=4, L=4 spectr."""
    target, draft, _ = build_models(args)
    prompts = prompts_for(16, args.prompt_length, target.config.vocab_size, 5)
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:  # Linux: resets VmHWM (peak RSS) to the current RSS
        f.write("5")
    loaded = _proc_status_mib("VmRSS")
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    run_ours(target, draft, prompts, args, method="spectr", num_drafts=4, draft_length=4)
    out = dict(rss_mib_after_loading=loaded, peak_rss_mib_during_generation=_proc_status_mib("VmHWM"))
    if args.device.startswith("cuda"):
        out["cuda_peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--draft-length", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small run: 16 new tokens, 1 repeat, small grid")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (on a shared, loaded machine 1 avoids thread-contention stalls)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--memory-probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.new_tokens, args.repeats = 16, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_probe:
        print(json.dumps(memory_probe(args)))
        return

    target, draft, source = build_models(args)
    vocab = target.config.vocab_size
    L = args.draft_length
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cpus, torch threads "
          f"{torch.get_num_threads()}, load average {os.getloadavg()}, device {args.device}, dtype {args.dtype}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"models: {source}; target {params(target) / 1e6:.1f}M params, draft {params(draft) / 1e6:.2f}M params")
    print(f"prompt length {args.prompt_length}, new tokens {args.new_tokens}, repeats {args.repeats} (median)\n")
    results: dict = dict(source=source, args=vars(args), load_average_start=os.getloadavg())

    # 1-2. autoregressive vs HF sampling, and the engine overhead
    ar = {}
    for batch in (1, 16):
        prompts = prompts_for(batch, args.prompt_length, vocab, batch)
        ar[batch] = compare(
            f"autoregressive B={batch}",
            lambda prompts=prompts: run_ours(target, None, prompts, args, method="autoregressive"),
            lambda prompts=prompts: run_hf(target, prompts, args),
            args.repeats,
        )
    # 3. speculative vs HF assisted generation, B = 1
    prompts = prompts_for(1, args.prompt_length, vocab, 1)
    spec = compare(
        f"speculative B=1 L={L}",
        lambda: run_ours(target, draft, prompts, args, method="speculative", draft_length=L),
        lambda: run_hf(target, prompts, args, assistant=draft, draft_length=L),
        args.repeats,
    )
    # overhead of spectr K=4 at B = 1 and 16
    overhead_rows = []
    for label, batch, kwargs in [
        ("autoregressive", 1, dict(method="autoregressive")),
        ("autoregressive", 16, dict(method="autoregressive")),
        ("speculative", 1, dict(method="speculative", draft_length=L)),
        (f"spectr K=4 L={L}", 1, dict(method="spectr", num_drafts=4, draft_length=L)),
        (f"spectr K=4 L={L}", 16, dict(method="spectr", num_drafts=4, draft_length=L)),
    ]:
        prompts = prompts_for(batch, args.prompt_length, vocab, batch)
        run_ours(target, draft, prompts, args, **kwargs)  # warm-up
        runs = [run_ours(target, draft, prompts, args, **kwargs) for _ in range(args.repeats)]
        best = sorted(runs, key=lambda r: r["wall"])[len(runs) // 2]
        s = best["stats"]
        overhead_rows.append(dict(
            name=f"{label} B={batch}", wall_s=s.wall_seconds, forward_s=s.forward_seconds,
            ratio=s.wall_seconds / s.forward_seconds, selection_s=s.selection_seconds, other_s=s.other_seconds,
            block_efficiency=s.block_efficiency, acceptance_rate=s.acceptance_rate,
            tokens_per_s=best["tokens_per_s"],
        ))

    print("== engine overhead: wall time / time inside model forwards (target 1.15) ==")
    print(f"{'run':<26}{'wall s':>9}{'fwd s':>9}{'wall/fwd':>10}{'select s':>10}{'other s':>9}{'BE':>6}{'tok/s':>9}")
    for r in overhead_rows:
        print(f"{r['name']:<26}{r['wall_s']:>9.3f}{r['forward_s']:>9.3f}{r['ratio']:>10.3f}{r['selection_s']:>10.3f}"
              f"{r['other_s']:>9.3f}{r['block_efficiency']:>6.2f}{r['tokens_per_s']:>9.1f}")
    print("\n== ours vs Hugging Face, same models, prompts and sampling (do_sample, top_k=0) ==")
    print(f"{'run':<26}{'ours tok/s':>12}{'HF tok/s':>12}{'ratio':>8}   target")
    for row, goal in ((ar[1], 0.9), (ar[16], 0.9), (spec, 1.2)):
        print(f"{row['name']:<26}{row['ours_tokens_per_s']:>12.1f}{row['hf_tokens_per_s']:>12.1f}"
              f"{row['ratio']:>8.2f}   >= {goal}")
    spec_stats = spec["ours_runs"][0]["stats"]
    print(f"(speculative: block efficiency {spec_stats.block_efficiency:.2f}, acceptance {spec_stats.acceptance_rate:.2f})")

    # 4. K x L grid of block efficiency
    grid_k = (1, 2, 4) if args.quick else (1, 2, 4, 8)
    grid_l = (1, 2, 4) if args.quick else (1, 2, 4, 8)
    prompts = prompts_for(16, args.prompt_length, vocab, 16)
    grid = {}
    for k in grid_k:
        for length in grid_l:
            run = run_ours(target, draft, prompts, args, method="spectr", num_drafts=k, draft_length=length)
            grid[(k, length)] = (run["stats"].block_efficiency, run["tokens_per_s"])
    print("\n== block efficiency (tokens per target call), spectr, B=16 [tokens/s in brackets] ==")
    print("K \\ L " + "".join(f"{length:>16}" for length in grid_l))
    for k in grid_k:
        print(f"{k:<6}" + "".join(f"{grid[(k, length)][0]:>8.2f} [{grid[(k, length)][1]:>5.0f}]" for length in grid_l))

    # 5. memory in a fresh process
    probe = [sys.executable, os.path.abspath(__file__), "--memory-probe", "--threads", str(torch.get_num_threads()),
             "--device", args.device, "--dtype",
             args.dtype, "--new-tokens", str(args.new_tokens), "--prompt-length", str(args.prompt_length)]
    if args.target:
        probe += ["--target", args.target, "--draft", args.draft]
    memory = json.loads(subprocess.run(probe, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    print("\n== memory: fresh process, B=16, K=4, L=4 ==")
    print(f"RSS after loading models {memory['rss_mib_after_loading']:.0f} MiB, "
          f"peak RSS during generation {memory['peak_rss_mib_during_generation']:.0f} MiB"
          + (f", CUDA peak allocated {memory['cuda_peak_allocated_mib']:.0f} MiB" if "cuda_peak_allocated_mib" in memory
             else ""))
    print(f"\nload average at end {os.getloadavg()}")

    if args.json:
        for row in (ar[1], ar[16], spec):
            row.pop("ours_runs")
        results.update(overhead=overhead_rows, autoregressive=[ar[1], ar[16]], speculative=spec,
                       grid={f"K={k},L={length}": v for (k, length), v in grid.items()}, memory=memory,
                       load_average_end=os.getloadavg())
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)


if __name__ == "__main__":
    main()
