"""Benchmark of the compiled engine (`compile=True`, `spectr.native`) against the eager one, in one run.

Sections (all by default; `--sections` picks some), every ratio from runs interleaved in one process:
- engine:  tokens/s of `spectr.generate` compiled vs eager, autoregressive and speculative L=3 (K=1), at
           B = 1 and B = 16 (B prompts, all in flight), medians over --repeats interleaved rounds;
- best:    at B = 1 (one slot, --best-prompts prompts of the default dataset in turn), the best exact method
           compiled (speculative L in 2..5, spectr K=2 L=3, block L=4) against compiled autoregressive
           (the issue's goal: >= 1.6x);
- forward: one forward of the draft and of the target (B = 1, one new token after a --context cache),
           eager and compiled: the target/draft time ratio; and the target over 5 and 17 new tokens
           (a causal chain, as a verify) relative to 1;
- hf:      our compiled autoregressive against HF `generate` with a static cache and `torch.compile`
           (HF's own fastest path), B = 1 and 16, same sampling (do_sample, top_k=0);
- compile: the compile seconds paid (first compiled run minus the steady one, per arm), and the
           break-even of `compile="auto"`: compile seconds / seconds saved per iteration (the number
           `spectr.native.CPU_MIN_ITERATIONS` should be near).

Models: --target/--draft (default the embedded pair, assets/models, float32); --quick uses tiny random
Llama models, few tokens and dynamo's "eager" backend (a smoke run: it checks the script, its numbers mean
nothing; `--backend inductor` compiles for real).
Results: JSON and markdown under --out (default benchmarks/results/compile/). Nothing asserts a speed.

    .venv/bin/python scripts/bench_compile.py --threads 1            # full run on a quiet machine
    .venv/bin/python scripts/bench_compile.py --quick --out /tmp/bc  # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import transformers

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "scripts"))
from harness import Report, interleaved  # noqa: E402

import spectr  # noqa: E402
import spectr.native as native  # noqa: E402
from spectr.kv_cache import tree_attention  # noqa: E402
from spectr.native import NativeCausalLM  # noqa: E402
from spectr.rows import prefill  # noqa: E402

SECTIONS = ("engine", "best", "forward", "hf", "compile")
BEST_CANDIDATES = [("speculative", 1, 2), ("speculative", 1, 3), ("speculative", 1, 4), ("speculative", 1, 5),
                   ("spectr", 2, 3), ("spectr", 2, 4), ("spectr", 4, 4), ("block", 1, 4), ("block", 1, 5)]


def load_pair(args):
    if args.quick:
        def llama(hidden, layers, seed):
            config = transformers.LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                                              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=512)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                return transformers.LlamaForCausalLM(config).eval()

        return llama(64, 2, 0), llama(32, 1, 1)
    load = transformers.AutoModelForCausalLM.from_pretrained
    return (load(args.target, dtype=torch.float32).eval().to(args.device),
            load(args.draft, dtype=torch.float32).eval().to(args.device))


def prompts_for(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=generator).tolist()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def default_prompts(args, count: int) -> list[list[int]]:
    """The first `count` prompts of the job's default dataset (assets/prompts.jsonl), tokenized as the job does
    (the target's tokenizer); random tokens with --quick (tiny random models have no tokenizer)."""
    if args.quick:
        return prompts_for(count, args.prompt_length, 512, 1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.target)
    with open(os.path.join(REPO_ROOT, "assets/prompts.jsonl"), encoding="utf-8") as lines:
        texts = [json.loads(line)["prompt"] for _, line in zip(range(count), lines)]
    return [tokenizer(text)["input_ids"] for text in texts]


def run_generate(target, draft, prompts, args, method, k, length, compiled, batch_size=None) -> dict:
    sync(args.device)
    start = time.perf_counter()
    out = spectr.generate(target, draft, prompts, method=method, num_drafts=k, draft_length=length,
                          max_new_tokens=args.new_tokens, seed=list(range(len(prompts))), compile=compiled,
                          batch_size=batch_size)
    sync(args.device)
    wall = time.perf_counter() - start
    tokens = sum(len(t) for t in out.tokens)
    return dict(wall=wall, tokens=tokens, tokens_per_s=tokens / wall, iterations=out.stats.iterations)


def first_and_steady(arms: dict, repeats: int) -> dict:
    """Run every arm once (the first run: compile paid), then `repeats` interleaved rounds; medians."""
    first = {name: fn() for name, fn in arms.items()}
    runs = interleaved(arms, rounds=repeats)
    result = {}
    for name in arms:
        steady = statistics.median(r["wall"] for r in runs[name])
        result[name] = dict(tokens_per_s=statistics.median(r["tokens_per_s"] for r in runs[name]),
                            steady_wall=steady, first_wall=first[name]["wall"],
                            iterations=runs[name][0].get("iterations"))
    return result


def engine_section(target, draft, args) -> list[dict]:
    rows = []
    for batch in args.batches:
        prompts = prompts_for(batch, args.prompt_length, target.config.vocab_size, batch)
        for method, k, length in (("autoregressive", 1, 1), ("speculative", 1, 3)):
            arms = {mode: (lambda mode=mode, method=method, k=k, length=length, prompts=prompts:
                           run_generate(target, draft, prompts, args, method, k, length, mode == "compiled"))
                    for mode in ("eager", "compiled")}
            result = first_and_steady(arms, args.repeats)
            rows.append(dict(section="engine", method=method, num_drafts=k, draft_length=length, batch=batch,
                             eager=result["eager"], compiled=result["compiled"],
                             speedup=result["compiled"]["tokens_per_s"] / result["eager"]["tokens_per_s"]))
            print(f"engine B={batch} {method} L={length}: compiled / eager = {rows[-1]['speedup']:.2f}x", flush=True)
    return rows


def best_section(target, draft, args) -> dict:
    """At B = 1 (one slot, --best-prompts prompts of the default dataset one after the other: real text, so
    each arm's acceptance is the pair's, not one draw over random tokens), every candidate compiled against
    compiled autoregressive."""
    prompts = default_prompts(args, args.best_prompts)
    arms = {"autoregressive": lambda: run_generate(target, draft, prompts, args, "autoregressive", 1, 1, True, 1)}
    for method, k, length in BEST_CANDIDATES:
        arms[f"{method} K={k} L={length}"] = (lambda m=method, kk=k, ll=length:
                                              run_generate(target, draft, prompts, args, m, kk, ll, True, 1))
    result = first_and_steady(arms, args.repeats)
    base = result.pop("autoregressive")["tokens_per_s"]
    best = max(result, key=lambda name: result[name]["tokens_per_s"])
    ratios = {name: r["tokens_per_s"] / base for name, r in result.items()}
    print(f"best at B=1 (compiled): {best} {ratios[best]:.2f}x compiled autoregressive", flush=True)
    return dict(section="best", autoregressive_tokens_per_s=base, ratios=ratios, best=best)


def time_forward(lm: NativeCausalLM, batch: int, new: int, context: int, calls: int, device: str) -> tuple:
    """(median seconds of one forward of `new` causal tokens per row after a `context`-token cache, seconds
    of the first call: the compile, if any), and the logits of the last call."""
    cache = lm.new_cache(batch, context + new + 1)
    prefill(lm, cache, prompts_for(batch, context + 1, lm.vocab_size, 7), torch.device(device))
    lengths = cache.rows.lengths  # [B]
    offsets = torch.arange(new, device=device)
    slots = lengths[:, None] + offsets  # [B, T]
    allowed = tree_attention(lengths, offsets[:, None] >= offsets[None, :], context + new)
    ids = torch.randint(3, lm.vocab_size, (batch, new), device=device,
                        generator=torch.Generator(device).manual_seed(new))
    seconds = []
    for _ in range(calls + 2):  # two warm-up calls (the first compiles)
        sync(device)
        start = time.perf_counter()
        logits = lm.forward(ids, slots, allowed, cache, slots)
        sync(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[2:]), seconds[0], logits


def forward_modes(args) -> list[str]:
    """eager, then every CPU compile variant (`spectr.native.CPU_VARIANTS`), or `compiled` on CUDA."""
    variants = args.variants.split(",") if args.variants else list(native.CPU_VARIANTS)
    return ["eager"] + (["compiled"] if args.device.startswith("cuda") else variants)


def forward_section(target, draft, args) -> dict:
    """Per mode: target over 1, 5 and 17 causal tokens of one row and the draft over 1 (medians of
    --calls, modes interleaved --repeats times after a warm-up round that pays the compiles), the ratios,
    the first-call (compile) seconds, and the largest logit difference to eager (same model: ~1e-5)."""
    out, first, reference, diff = {}, {}, {}, {}
    shapes = [("draft", 1)] + [("target", new) for new in (1, 5, 17)]
    lms = {"target": NativeCausalLM(target, "target"), "draft": NativeCausalLM(draft, "draft")}
    runs = {mode: {f"{name}_{new}": [] for name, new in shapes} for mode in forward_modes(args)}
    with torch.inference_mode():
        for round_ in range(args.repeats + 1):  # round 0: warm-up (compiles), not in the medians
            for mode in runs:
                for lm in lms.values():
                    lm.set_compiled(mode != "eager", None if mode in ("eager", "compiled") else mode)
                for name, new in shapes:
                    key = f"{name}_{new}"
                    median, first_call, logits = time_forward(lms[name], 1, new, args.context, args.calls,
                                                              args.device)
                    if round_ == 0:
                        first[mode] = first.get(mode, 0.0) + first_call - median
                        print(f"  warm-up {mode} {key}: first call {first_call:.1f} s, then {median * 1e3:.2f} ms",
                              flush=True)
                        reference.setdefault(key, logits)
                        diff[mode] = max(diff.get(mode, 0.0), float((logits - reference[key]).abs().max()))
                    else:
                        runs[mode][key].append(median)
    for mode, times in runs.items():
        t = {key: statistics.median(values) for key, values in times.items()}
        out[mode] = dict(seconds=t, target_over_draft=t["target_1"] / t["draft_1"],
                         target_5_over_1=t["target_5"] / t["target_1"], target_17_over_1=t["target_17"] / t["target_1"],
                         eager_over_this_target_1=statistics.median(runs["eager"]["target_1"]) / t["target_1"],
                         compile_seconds=first[mode], max_logit_diff=diff[mode])
        print(f"forward {mode}: target 1 token {t['target_1'] * 1e3:.2f} ms, target/draft "
              f"{out[mode]['target_over_draft']:.2f}, 5/1 {out[mode]['target_5_over_1']:.2f}, 17/1 "
              f"{out[mode]['target_17_over_1']:.2f}, compile {first[mode]:.1f} s, max |logit diff| {diff[mode]:.1e}",
              flush=True)
    return dict(section="forward", **out)


@torch.inference_mode()
def run_hf_static(target, prompts, args) -> dict:
    ids = torch.tensor(prompts, device=args.device)
    torch.manual_seed(0)
    sync(args.device)
    start = time.perf_counter()
    out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, top_p=1.0,
                          temperature=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                          pad_token_id=0, eos_token_id=None, cache_implementation="static")
    sync(args.device)
    wall = time.perf_counter() - start
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return dict(wall=wall, tokens=tokens, tokens_per_s=tokens / wall)


def hf_section(target, draft, args) -> list[dict]:
    import copy

    hf_model = copy.deepcopy(target)  # its forward is replaced by a compiled one
    hf_model.forward = torch.compile(hf_model.forward, fullgraph=True, backend=native.COMPILE_BACKEND)
    rows = []
    for batch in args.batches:
        prompts = prompts_for(batch, args.prompt_length, target.config.vocab_size, 100 + batch)
        arms = {"ours": lambda p=prompts: run_generate(target, None, p, args, "autoregressive", 1, 1, True),
                "hf": lambda p=prompts: run_hf_static(hf_model, p, args)}
        result = first_and_steady(arms, args.repeats)
        ratio = result["ours"]["tokens_per_s"] / result["hf"]["tokens_per_s"]
        rows.append(dict(section="hf", batch=batch, ours=result["ours"], hf=result["hf"], ratio=ratio))
        print(f"hf B={batch}: our compiled autoregressive / HF static+compile = {ratio:.2f}x", flush=True)
    return rows


def compile_section(engine_rows: list[dict]) -> dict:
    """Compile seconds per arm (its first compiled run minus a steady one, less the eager arm's own first-run
    overhead), the seconds saved per iteration, and auto's break-even (compile seconds / seconds saved per
    iteration); `job`: every graph a run of these arms compiles (their sum) over the median saving."""
    rows = []
    for row in engine_rows:
        compiled, eager = row["compiled"], row["eager"]
        paid = max((compiled["first_wall"] - compiled["steady_wall"]) - (eager["first_wall"] - eager["steady_wall"]), 0.0)
        # per iteration of each arm (their runs need not take as many iterations: EOS at another step)
        saved = (eager["steady_wall"] / max(eager["iterations"] or 1, 1)
                 - compiled["steady_wall"] / max(compiled["iterations"] or 1, 1))
        rows.append(dict(method=row["method"], batch=row["batch"], compile_seconds=paid, saved_per_iteration=saved,
                         break_even_iterations=paid / saved if saved > 0 else None))
    total = sum(r["compile_seconds"] for r in rows)
    saved = statistics.median(r["saved_per_iteration"] for r in rows) if rows else 0.0
    job = dict(compile_seconds=total, saved_per_iteration=saved, break_even_iterations=total / saved if saved > 0 else None)
    return dict(section="compile", arms=rows, job=job)


def goals(results: dict) -> list[tuple[str, str, str, bool | None]]:
    """The issue's goals table: (goal, target, measured, met); None where not measured in this run."""
    out = []
    for row in results.get("engine", []):
        need = 1.3 if row["batch"] == 1 else 1.1
        out.append((f"compiled / eager tokens/s, B={row['batch']} {row['method']} L={row['draft_length']}",
                    f">= {need}x", f"{row['speedup']:.2f}x", row["speedup"] >= need))
    forward = results.get("forward", {})
    modes = [m for m in forward if isinstance(forward[m], dict) and "seconds" in forward[m] and m != "eager"]
    if modes:
        best = min(modes, key=lambda m: forward[m]["seconds"]["target_17"])
        row = forward[best]
        out.append((f"target / draft forward time ({best}; eager {forward['eager']['target_over_draft']:.2f})",
                    ">= 8x", f"{row['target_over_draft']:.2f}x", row["target_over_draft"] >= 8))
        for new, need in ((5, 1.5), (17, 3.0)):
            ratio = row[f"target_{new}_over_1"]
            out.append((f"target forward {new} tokens / 1 ({best}; eager {forward['eager'][f'target_{new}_over_1']:.2f})",
                        f"<= {need}x", f"{ratio:.2f}x", ratio <= need))
    if "best" in results:
        best = results["best"]
        ratio = best["ratios"][best["best"]]
        out.append((f"best exact method at B=1 ({best['best']}) / compiled autoregressive", ">= 1.6x",
                    f"{ratio:.2f}x", ratio >= 1.6))
    for row in results.get("hf", []):
        out.append((f"compiled autoregressive / HF generate static+compile, B={row['batch']}", ">= 1.0x",
                    f"{row['ratio']:.2f}x", row["ratio"] >= 1.0))
    if "compile" in results:
        job = results["compile"]["job"]
        even = job["break_even_iterations"]
        out.append(("compile seconds of the engine arms / break-even iterations", "(reported)",
                    f"{job['compile_seconds']:.0f} s / {'never' if even is None else f'{even:.0f}'}", None))
    return out


def markdown(results: dict) -> str:
    lines = [f"# Compiled engine ({results['device']}, threads {results['threads']}, torch {torch.__version__}, "
             f"CPU variant {results.get('cpu_variant')})", ""]
    for row in results.get("engine", []):
        lines.append(f"- engine B={row['batch']} {row['method']} L={row['draft_length']}: compiled "
                     f"{row['compiled']['tokens_per_s']:.1f} tok/s, eager {row['eager']['tokens_per_s']:.1f}: "
                     f"**{row['speedup']:.2f}x**")
    if "best" in results:
        best = results["best"]
        lines.append(f"- best exact method at B=1 (compiled): {best['best']} **{best['ratios'][best['best']]:.2f}x** "
                     "compiled autoregressive")
    for mode, row in results.get("forward", {}).items():
        if isinstance(row, dict) and "seconds" in row:
            lines.append(f"- forward {mode}: target 1 token {row['seconds']['target_1'] * 1e3:.2f} ms, target/draft "
                         f"{row['target_over_draft']:.2f}, target 5/1 tokens {row['target_5_over_1']:.2f}, 17/1 "
                         f"{row['target_17_over_1']:.2f}; compile {row['compile_seconds']:.1f} s")
    for row in results.get("hf", []):
        lines.append(f"- B={row['batch']}: our compiled autoregressive / HF generate (static cache + torch.compile) "
                     f"**{row['ratio']:.2f}x**")
    for row in results.get("compile", {}).get("arms", []):
        even = row["break_even_iterations"]
        lines.append(f"- compile paid, {row['method']} B={row['batch']}: {row['compile_seconds']:.1f} s, saved "
                     f"{row['saved_per_iteration'] * 1e3:.2f} ms/iteration; break-even "
                     f"{'never' if even is None else f'{even:.0f} iterations'}")
    lines += ["", "| goal | target | measured | met |", "|---|---|---|---|"]
    for goal, need, measured, met in goals(results):
        lines.append(f"| {goal} | {need} | {measured} | {'-' if met is None else 'yes' if met else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=os.path.join(REPO_ROOT, "assets/models/target"))
    parser.add_argument("--draft", default=os.path.join(REPO_ROOT, "assets/models/draft"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--context", type=int, default=64, help="forward section: cached tokens before the forward")
    parser.add_argument("--best-prompts", type=int, default=8,
                        help="best section: prompts of the default dataset, run one at a time (B = 1)")
    parser.add_argument("--calls", type=int, default=30, help="forward section: timed forwards per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default=None,
                        help="forward section: comma-separated CPU compile variants (default: all CPU_VARIANTS)")
    parser.add_argument("--backend", default=None, help="torch.compile backend of the engine (default inductor; "
                        "--quick: dynamo's 'eager', which traces without compiling kernels)")
    parser.add_argument("--engine-variant", default=None, choices=sorted(native.CPU_VARIANTS),
                        help="CPU compile variant of compile=True in the engine, best, hf and compile sections "
                        "(default spectr.native.CPU_VARIANT)")
    parser.add_argument("--keep-cache", action="store_true", help="use inductor's usual on-disk cache (warm)")
    parser.add_argument("--quick", action="store_true", help="tiny random models, few tokens: a smoke run")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "benchmarks/results/compile"))
    args = parser.parse_args()
    report = Report("bench_compile", args=args)
    print(report.header(), flush=True)
    if args.quick:
        args.new_tokens, args.prompt_length, args.repeats, args.calls, args.context = 6, 5, 1, 2, 8
        args.batches = [1, 3]
    native.COMPILE_BACKEND = args.backend or ("eager" if args.quick else "inductor")
    native.CPU_VARIANT = args.engine_variant or native.CPU_VARIANT
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.keep_cache:  # a cold inductor cache: the compile seconds a fresh machine pays
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_compile_inductor_")
    sections = args.sections.split(",")
    target, draft = load_pair(args)
    results = dict(device=args.device, threads=torch.get_num_threads(), cpu_variant=native.CPU_VARIANT)
    if "engine" in sections or "compile" in sections:
        results["engine"] = engine_section(target, draft, args)
    if "compile" in sections:
        results["compile"] = compile_section(results["engine"])
    for name, section in (("best", best_section), ("forward", forward_section), ("hf", hf_section)):
        if name in sections:
            try:  # a section that fails leaves the others' results
                results[name] = section(target, draft, args)
            except Exception as error:  # noqa: BLE001 - recorded, the run goes on
                results[f"{name}_error"] = repr(error)
                print(f"section {name} failed: {error!r}", flush=True)
    report.write(os.path.join(args.out, "bench_compile.json"), results, markdown=markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
