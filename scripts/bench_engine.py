"""Benchmark of the spectr.generate engine against Hugging Face generate, in one run on one machine.

Measures (printed as a table, and as JSON with --json):
1. engine overhead: wall time / time inside model forwards (draft + target), at B = 1 and B = 16;
2. our `autoregressive` vs HF `generate(do_sample=True, top_k=0)`, tokens/s at B = 1 and B = 16;
3. our `speculative` vs HF assisted generation (`assistant_model=`, constant schedule,
   num_assistant_tokens = L, confidence stopping off), tokens/s at B = 1;
4. block efficiency over a K x L grid (method spectr, B = 16);
5. peak resident memory of a fresh process running B = 16, K = 4, L = 4 (and CUDA peak on GPU).

Engine comparison (`--compare ROOT[=LABEL] ...`, only this section runs): the same generation in
fresh subprocesses, each importing `spectr` from another checkout (e.g. a worktree of the code
before a change), interleaved round-robin over --repeats rounds. Per run it reports tokens/s
(median over rounds, and the median of each round's ratio to the first checkout), block
efficiency, engine host syncs per iteration (reads of device values outside the models'
forwards, counted by `spectr.diagnostics.HostSyncCounter` in a separate, untimed run), and the
target's input width per verify call (tokens per row, padding included). `--compact-fractions`
adds runs of the last checkout with other compaction settings (checkouts whose Generation
takes `compact_fraction`).

Block verification against token verification (`--block-vs-speculative`, only this section
runs): block efficiency (with its standard error over target calls), acceptance rate and
tokens/s of `block` and `speculative` for each --lengths, same prompts and seeds, in one run.

Models: --target/--draft directories (from_pretrained), or by default random Llama models of
about the embedded pair's size (target ~30M params: hidden 512, 8 layers, vocab 8192; draft
~2.5M: hidden 128, 2 layers). With random weights acceptance says nothing about real speed-ups;
both sides of every ratio use the same pair, prompts and sampling settings.

Timings: each measurement is repeated (--repeats) with ours and HF interleaved, and the median
is reported. This is a benchmark script, not a test; nothing here asserts a speed.

    .venv/bin/python scripts/bench_engine.py --threads 1   # full run (~10 min on a loaded 2-core VM)
    .venv/bin/python scripts/bench_engine.py --quick       # smoke run
    .venv/bin/python scripts/bench_engine.py --threads 1 --target assets/models/target --draft assets/models/draft \
        --prompts assets/prompts.jsonl --compare /tmp/wt-before=before --compare .=after --repeats 5
    .venv/bin/python scripts/bench_engine.py --threads 1 --target assets/models/target --draft assets/models/draft \
        --prompts assets/prompts.jsonl --block-vs-speculative --batch 256 --new-tokens 128 --eos
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import transformers

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# An engine worker imports spectr from the checkout it is given (see --compare).
_SPECTR_ROOT = sys.argv[sys.argv.index("--spectr-root") + 1] if "--spectr-root" in sys.argv else REPO_ROOT
sys.path.insert(0, os.path.abspath(_SPECTR_ROOT))
sys.path.insert(0, os.path.join(REPO_ROOT, "scripts"))
from harness import Report, interleaved, ratio_summary, sync, table  # noqa: E402

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


def run_ours(target, draft, prompts, args, **kwargs):
    sync()
    start = time.perf_counter()
    out = spectr.generate(target, draft, prompts, max_new_tokens=args.new_tokens, seed=list(range(len(prompts))),
                          **kwargs)
    sync()
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
    sync()
    start = time.perf_counter()
    out = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    sync()
    wall = time.perf_counter() - start
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return dict(wall=wall, tokens=tokens, tokens_per_s=tokens / wall)


def median(runs, key):
    return statistics.median(r[key] for r in runs)


def compare(name, ours_fn, theirs_fn, repeats):
    runs = interleaved({"ours": ours_fn, "theirs": theirs_fn}, rounds=repeats, warmup=1)
    ours, theirs = runs["ours"], runs["theirs"]
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


# ---------------------------------------------------------------------------------------
# engine comparison: one checkout per subprocess, interleaved
# ---------------------------------------------------------------------------------------


def engine_prompts(args, tokenizer_dir: str, count: int | None = None) -> list[list[int]]:
    """The first `count` (default --batch) prompts of --prompts (JSONL, column 'prompt'), tokenized;
    random ones without --prompts."""
    count = args.batch if count is None else count
    if not args.prompts:
        return prompts_for(count, args.prompt_length, 8192, 16)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    with open(args.prompts) as f:
        rows = [json.loads(line) for line, _ in zip(f, range(count))]
    return [tokenizer(row["prompt"])["input_ids"] for row in rows]


def _engine_syncs_and_widths(target, draft, prompts, kwargs) -> dict:
    """One untimed run: engine host reads per iteration (model forwards excluded), verify widths."""
    from spectr.diagnostics import HostSyncCounter

    class EngineSyncs(HostSyncCounter):
        inside_models = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if self.inside_models:
                return func(*args, **(kwargs or {}))
            return super().__torch_function__(func, types, args, kwargs)

    syncs, widths, handles = EngineSyncs(), [], []
    for model in (target, draft):
        if model is None:
            continue
        handles.append(model.register_forward_pre_hook(lambda *_: setattr(syncs, "inside_models", 1)))
        handles.append(model.register_forward_hook(lambda *_: setattr(syncs, "inside_models", 0)))

    def record_width(module, args, kw):
        if "logits_to_keep" not in kw:  # the prefill asks for the last position only
            widths.append(kw["input_ids"].shape[1])

    handles.append(target.register_forward_pre_hook(record_width, with_kwargs=True))
    try:
        with syncs:
            out = spectr.generate(target, draft, prompts, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    iterations = getattr(out.stats, "iterations", 0) or max(out.stats.target_calls)
    return dict(syncs_per_iteration=syncs.total / iterations, sync_kinds=dict(syncs.by_kind),
                verify_width=statistics.mean(widths), iterations=iterations)


def engine_worker(args) -> None:
    """Subprocess side of --compare: load the pair, warm up, time --groups consecutive batches of
    --batch prompts (one spectr.generate call each), count syncs on the first; print JSON."""
    target, draft, _ = build_models(args)
    every_prompt = engine_prompts(args, args.target or REPO_ROOT, args.batch * args.groups)
    groups = [every_prompt[i : i + args.batch] for i in range(0, len(every_prompt), args.batch)]
    prompts = groups[0]
    kwargs = dict(method=args.method, num_drafts=args.num_drafts, draft_length=args.draft_length,
                  max_new_tokens=args.new_tokens, seed=list(range(len(prompts))),
                  eos_token_id=target.generation_config.eos_token_id if args.eos else None)
    if args.compact_fraction is not None:
        from spectr.generate import Generation

        original = Generation.__init__
        Generation.__init__ = lambda self, *a, **kw: original(self, *a, **(kw | {"compact_fraction": args.compact_fraction}))
    spectr.generate(target, draft, prompts, **(kwargs | {"max_new_tokens": 8}))  # warm-up
    wall = cpu = tokens = calls = compactions = 0
    nodes = []
    for index, group in enumerate(groups):
        start, cpu_start = time.perf_counter(), time.process_time()
        out = spectr.generate(target, draft, group, **(kwargs | {"seed": list(range(index * args.batch,
                                                                                  index * args.batch + len(group)))}))
        wall, cpu = wall + time.perf_counter() - start, cpu + time.process_time() - cpu_start
        tokens, calls = tokens + out.stats.total_generated_tokens, calls + out.stats.total_target_calls
        compactions += getattr(out.stats, "compactions", 0)
        nodes.append(getattr(out.stats, "tree_nodes", None))
    result = dict(spectr=spectr.__file__, wall_s=wall, cpu_s=cpu, tokens=tokens, tokens_per_s=tokens / wall,
                  tokens_per_cpu_s=tokens / cpu, block_efficiency=tokens / calls, target_calls=calls,
                  cpu_ms_per_target_call=1000 * cpu / calls,
                  compactions=compactions if hasattr(out.stats, "compactions") else None,
                  mean_tree_nodes=sum(nodes) / calls if None not in nodes else None)
    if args.count:
        result.update(_engine_syncs_and_widths(target, draft, prompts, kwargs))
    print("RESULT " + json.dumps(result))


def compare_engines(args) -> None:
    """Round-robin subprocess runs of each checkout (and compaction setting); prints the table."""
    configs = []
    for spec in args.compare:
        root, _, label = spec.partition("=")
        configs.append((label or root, os.path.abspath(root), None))
    last_label, last_root, _ = configs[-1]
    for fraction in args.compact_fractions:
        configs.append((f"{last_label} compact_fraction={fraction:g}", last_root, fraction))
    common = [sys.executable, os.path.abspath(__file__), "--engine-worker", "--device", args.device, "--dtype",
              args.dtype, "--new-tokens", str(args.new_tokens), "--batch", str(args.batch), "--groups", str(args.groups),
              "--method", args.method,
              "--num-drafts", str(args.num_drafts), "--draft-length", str(args.draft_length),
              "--threads", str(torch.get_num_threads())]
    for name in ("target", "draft", "prompts"):
        if getattr(args, name):
            common += [f"--{name}", os.path.abspath(getattr(args, name))]
    common += ["--eos"] if args.eos else []
    report = Report("bench_engine_compare", args=args)
    print(report.header())
    print(f"{args.method} K={args.num_drafts} L={args.draft_length} B={args.batch} new tokens {args.new_tokens} "
          f"eos {'on' if args.eos else 'off'}, {args.groups} consecutive batches per run, "
          f"{args.repeats} interleaved rounds\n")
    done_rounds = {label: 0 for label, _, _ in configs}

    def worker(label, root, fraction):
        command = common + ["--spectr-root", root] + (["--count"] if done_rounds[label] < 2 else [])
        command += ["--compact-fraction", str(fraction)] if fraction is not None else []
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        done_rounds[label] += 1
        line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
        return json.loads(line[len("RESULT "):])

    def progress(round_index, label, last):
        print(f"round {round_index + 1} {label:<36} {last['tokens_per_s']:8.1f} tok/s "
              f"{last['tokens_per_cpu_s']:8.1f} tok/cpu-s", flush=True)

    arms = {label: (lambda c=(label, root, fraction): worker(*c)) for label, root, fraction in configs}
    # alternate the order (ABC, CBA, ...) so that a drifting load hits every checkout alike
    runs = interleaved(arms, rounds=args.repeats, alternate=True, on_run=progress)
    _print_engine_table(configs, runs)
    if args.json:
        report.write(args.json, dict(runs=runs))


def _print_engine_table(configs, runs) -> None:
    baseline = configs[0][0]
    print(f"\n{'checkout':<38}{'tok/s':>8}{'ratio':>7}{'tok/cpu-s':>10}{'ratio':>7}{'cpu ms/call':>12}{'BE':>6}"
          f"{'syncs/it':>9}{'width':>7}{'nodes':>7}{'compact':>8}")
    for label, _, _ in configs:
        rows = runs[label]
        ratios = [ratio_summary(rows, runs[baseline], key)["median"] for key in ("tokens_per_s", "tokens_per_cpu_s")]
        first, nodes = rows[0], rows[0]["mean_tree_nodes"]
        compactions = "-" if first["compactions"] is None else first["compactions"]
        print(f"{label:<38}{statistics.median(r['tokens_per_s'] for r in rows):>8.1f}{ratios[0]:>7.3f}"
              f"{statistics.median(r['tokens_per_cpu_s'] for r in rows):>10.1f}{ratios[1]:>7.3f}"
              f"{statistics.median(r['cpu_ms_per_target_call'] for r in rows):>12.2f}"
              f"{first['block_efficiency']:>6.2f}{first['syncs_per_iteration']:>9.2f}{first['verify_width']:>7.2f}"
              f"{'-' if nodes is None else format(nodes, '.2f'):>7}{compactions:>8}")
    print("ratio: median over rounds of the per-round ratio to the first checkout; tok/cpu-s: tokens per second of "
          "process CPU time (less sensitive to other load on a shared machine); width: target input tokens per "
          "row per verify call (padding included); nodes: tree nodes per row per call (the checkout's own stats); "
          "cpu ms/call: process CPU time per (row, target call), which does not depend on the sampled block "
          "efficiency; syncs and width: first group of the first round; nodes and compact(ions): all groups")


# ---------------------------------------------------------------------------------------
# block verification against token verification
# ---------------------------------------------------------------------------------------


def _tokens_per_call_stderr(histogram: list[int]) -> float:
    calls = sum(histogram)
    mean = sum(n * c for n, c in enumerate(histogram)) / calls
    variance = sum(c * (n - mean) ** 2 for n, c in enumerate(histogram)) / max(calls - 1, 1)
    return (variance / calls) ** 0.5


def block_vs_speculative(args) -> None:
    """Block efficiency of `block` and `speculative` for each L, same prompts and seeds, one process."""
    target, draft, source = build_models(args)
    prompts = engine_prompts(args, args.target or REPO_ROOT)
    eos = target.generation_config.eos_token_id if args.eos else None
    report = Report("block_vs_speculative", args=args)
    print(report.header())
    print(f"models: {source}; {len(prompts)} prompts, max_new_tokens {args.new_tokens}, temperature 1, "
          f"eos {eos}, rows in flight {args.rows_in_flight}, torch threads {torch.get_num_threads()}\n")
    print(f"{'L':>3} {'method':<12}{'BE':>8}{'+-':>7}{'accept':>8}{'calls':>8}{'tok/s':>8}{'BE ratio':>10}")
    results = []
    for length in args.lengths:
        speculative_be = None
        for method in ("speculative", "block"):
            start = time.perf_counter()
            out = spectr.generate(target, draft, prompts, method=method, draft_length=length,
                                  max_new_tokens=args.new_tokens, eos_token_id=eos, seed=list(range(len(prompts))),
                                  batch_size=args.rows_in_flight)
            wall = time.perf_counter() - start
            s = out.stats
            stderr = _tokens_per_call_stderr(s.tokens_per_call_histogram)
            speculative_be = speculative_be or s.block_efficiency
            ratio = s.block_efficiency / speculative_be
            print(f"{length:>3} {method:<12}{s.block_efficiency:>8.3f}{stderr:>7.3f}{s.acceptance_rate:>8.3f}"
                  f"{s.total_target_calls:>8}{s.total_generated_tokens / wall:>8.1f}{ratio:>10.3f}", flush=True)
            results.append(dict(draft_length=length, method=method, block_efficiency=s.block_efficiency,
                                stderr=stderr, acceptance_rate=s.acceptance_rate, target_calls=s.total_target_calls,
                                tokens=s.total_generated_tokens, wall_s=wall, ratio_to_speculative=ratio))
    print("(BE: generated tokens per target call; +-: its standard error over target calls; BE ratio: block / "
          "speculative at the same L)")
    if args.json:
        report.write(args.json, dict(results=results), markdown=table(results))


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
    parser.add_argument("--compare", action="append", default=[], metavar="ROOT[=LABEL]",
                        help="engine comparison: a checkout whose spectr/ to run (repeat the flag; the first is the "
                             "baseline of the ratios)")
    parser.add_argument("--compact-fractions", type=float, nargs="*", default=[],
                        help="engine comparison: extra runs of the last checkout with these compact_fraction values")
    parser.add_argument("--prompts", default=None, help="engine comparison: JSONL prompts (column 'prompt')")
    parser.add_argument("--batch", type=int, default=16, help="engine comparison: batch size")
    parser.add_argument("--method", default="spectr", help="engine comparison: method")
    parser.add_argument("--num-drafts", type=int, default=4, help="engine comparison: K")
    parser.add_argument("--eos", action="store_true", help="engine comparison: stop at the target's EOS ids")
    parser.add_argument("--groups", type=int, default=1,
                        help="engine comparison: consecutive batches of --batch prompts per run (more tokens, less "
                             "sampling noise in the block efficiency)")
    parser.add_argument("--engine-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spectr-root", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--compact-fraction", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--count", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--block-vs-speculative", action="store_true",
                        help="block efficiency of block and speculative for each --lengths (only this section runs)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4, 8], help="block comparison: draft lengths")
    parser.add_argument("--rows-in-flight", type=int, default=32, help="block comparison: spectr.generate batch_size")
    args = parser.parse_args()
    if args.quick:
        args.new_tokens, args.repeats = 16, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_probe:
        print(json.dumps(memory_probe(args)))
        return
    if args.engine_worker:
        engine_worker(args)
        return
    if args.compare:
        compare_engines(args)
        return
    if args.block_vs_speculative:
        block_vs_speculative(args)
        return

    target, draft, source = build_models(args)
    vocab = target.config.vocab_size
    L = args.draft_length
    report = Report("bench_engine", args=args)
    print(report.header())
    print(f"device {args.device}, dtype {args.dtype}, torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"models: {source}; target {params(target) / 1e6:.1f}M params, draft {params(draft) / 1e6:.2f}M params")
    print(f"prompt length {args.prompt_length}, new tokens {args.new_tokens}, repeats {args.repeats} (median)\n")
    results: dict = dict(source=source)

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

    if args.json:
        for row in (ar[1], ar[16], spec):
            row.pop("ours_runs")
        results.update(overhead=overhead_rows, autoregressive=[ar[1], ar[16]], speculative=spec,
                       grid={f"K={k},L={length}": v for (k, length), v in grid.items()}, memory=memory)
        report.write(args.json, results, markdown=table(overhead_rows) + "\n"
                     + table([{k: v for k, v in row.items() if k != "ours_runs"} for row in (ar[1], ar[16], spec)]))


if __name__ == "__main__":
    main()
