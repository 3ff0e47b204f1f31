"""GPU check: one prepared script that proves `spectr.generate` on an accelerator and times it, in one run.

It (1) runs the end-to-end chi-square of the first 3 generated tokens against the enumerated law of
the warped target, on tiny random Llamas in float32 and bfloat16, for every method in
`spectr.known_methods()` (and, where `spectr.generate` takes `compile=`, autoregressive and SpecTr
compiled), each next to a negative control the same test must reject; (2) checks that greedy decoding
equals Hugging Face greedy token for token for Llama, Qwen2 and GPT-NeoX shapes; (3) measures the
embedded pair's acceptance (`assets/models`; from its `eval.json` when the weights are absent), used for
predictions only; (4) times, in bf16 on a random ~1.1B Llama target whose draft is its own first 2
layers, at batch 1, 16 and 64, interleaved: our autoregressive and SpecTr eager vs compiled (where the
engine takes `compile=`; detected with `inspect.signature`, else eager only) vs HF `generate` plain and
with a static cache + `torch.compile` (HF's own fastest path); ours vs HF assisted generation (batch 1);
SpecTr K in {2, 4} x L in {2, 4, 6} (and `auto` when the engine has it), with block efficiency,
per-iteration draft/target/selection/other time, syncs per iteration, compile warm-up and peak GPU
memory, next to the speedup PREDICTED at the embedded pair's acceptance; (6) `device_map`, only where two
GPUs are visible: the same random target split over them (`pipeline.placement`'s plan placed by
`spectr.split.dispatch`, as `model.device_map=auto` loads it) against it on one GPU, at one batch size,
autoregressive and SpecTr K=2 L=4, eager and compiled: tokens/s and whether the tokens of a seed are
identical (with one GPU it records "skipped: 1 GPU"; the CPU smoke run puts both groups on the CPU); and
writes `results.json` and
`results.md` to `--out` (after every unit) and prints the tables. Each section is guarded (a failing
one is recorded, the rest still run) and the whole run keeps to `--budget-s` (default 420 s): units past
their section's share are skipped and recorded, and a unit still running `--grace-s` (30 s) past it is
interrupted; a section cut that way keeps every result it had saved (`cut_for_time`).

It imports only `spectr`, torch, transformers, the standard library and (section 6) the pure-Python
`pipeline.placement` (tested against torch 2.11 and
transformers 5.17, the GPU machine's versions: `make check-transformers TRANSFORMERS=5.17.*`) and needs
nothing installed. At most 64 MiB of files can be copied to the GPU machine, and the embedded target's
weights alone are 65 MiB: leave them out of the working tree without staging any change to git (the
pair section then reads the acceptance from `assets/models/eval.json`), and put them back after:

    git sparse-checkout set --no-cone '/*' '!/assets/models/target/model.safetensors'   # after: git sparse-checkout disable

Then, on the GPU machine, from the repository root, run it as one prepared command of at most 10 minutes
(e.g. the device tool's `timeout_s` 570):

    set -o pipefail; PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --out "$OUT/gpu" 2>&1 | tee "$OUT/gpu_check.log"

(`make gpu-check` writes to benchmarks/results/gpu/<date>-<device>; `--smoke` runs the same code paths
on CPU with tiny shapes in seconds, as tests/scripts/test_gpu_check.py does.) Exit status 0 when every
exactness and greedy check passed and no section failed, else 1.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import inspect
import itertools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the GPU machine has no network; everything is local

import torch  # noqa: E402
import transformers  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the GPU machine runs the repo without installing it

import spectr  # noqa: E402
from spectr.block import block_rule  # noqa: E402
from spectr.diagnostics import HostSyncCounter  # noqa: E402
from spectr.selection import TOKEN_SELECTORS  # noqa: E402
from spectr.sequence import SEQUENCE_RULES  # noqa: E402

SECTIONS = ("exactness", "greedy", "pair_acceptance", "speed", "device_map")
MEASUREMENTS = ("pair_acceptance", "speed", "device_map")  # sections whose partial results are results (the others are checks)
# Share of the time budget each section may use (unused time rolls over to the next section).
BUDGET_SHARES = {"exactness": 0.27, "greedy": 0.06, "pair_acceptance": 0.05, "speed": 0.62, "device_map": 0.12}
# device_map's share counts only where two GPUs are visible (elsewhere the section is a skip record)
NO_SPLIT_SHARE = 0.0
AUTOREGRESSIVE = "autoregressive"


# ---------------------------------------------------------------------------------------
# plans: the full device run and the CPU smoke run differ in sizes only
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    name: str
    budget_s: float
    exact_samples: int  # rows (one batched call) per chi-square test
    exact_tokens: int  # first generated tokens whose joint law is enumerated
    greedy_new_tokens: int
    speed_shape: dict  # the random Llama target of the speed section
    draft_layers: int  # the draft = the target's first layers + its embedding and head
    speed_batches: tuple[int, ...]
    prompt_lengths: tuple[int, int]  # uniform in [lo, hi]
    speed_new_tokens: int
    sync_new_tokens: int  # length of the instrumented run that counts syncs
    grid_drafts: tuple[int, ...]
    grid_lengths: tuple[int, ...]
    assisted_length: int  # L of ours-speculative vs HF assisted (batch 1)
    headline_spectr: tuple[int, int]  # (K, L) of SpecTr in the headline groups (eager, compiled)
    compiled_exact_methods: tuple[str, ...]  # also tested compiled, where the engine compiles
    compiled_speed: bool  # time the compiled arms too, where the engine compiles (not in the CPU smoke run:
    # compiling there costs minutes; tests/scripts/test_gpu_check.py covers those arms with a stand-in)
    headline_repeats: int  # interleaved repeats (median) of the ours-vs-HF comparisons
    pair_prompts: int
    pair_new_tokens: int


LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)
TINY_LLAMA = dict(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

FULL = Plan(name="full", budget_s=420.0, exact_samples=16000, exact_tokens=3, greedy_new_tokens=24,
            speed_shape=LLAMA_1B, draft_layers=2, speed_batches=(1, 16, 64), prompt_lengths=(128, 512),
            speed_new_tokens=64, sync_new_tokens=12, grid_drafts=(2, 4), grid_lengths=(2, 4, 6),
            assisted_length=4, headline_spectr=(2, 4), headline_repeats=3,
            compiled_exact_methods=(AUTOREGRESSIVE, "spectr"), compiled_speed=True, pair_prompts=16,
            pair_new_tokens=48)
SMOKE = Plan(name="smoke", budget_s=300.0, exact_samples=2000, exact_tokens=3, greedy_new_tokens=8,
             speed_shape=TINY_LLAMA, draft_layers=1, speed_batches=(1, 2), prompt_lengths=(8, 24),
             speed_new_tokens=10, sync_new_tokens=6, grid_drafts=(2,), grid_lengths=(2, 4),
             assisted_length=2, headline_spectr=(2, 2), headline_repeats=1, compiled_exact_methods=(), compiled_speed=False, pair_prompts=2,
             pair_new_tokens=8)


class Budget:
    """A total time budget; each section must finish by its cumulative share of it."""

    def __init__(self, total_s: float, sections: list[str]):
        self.start = time.perf_counter()
        self.total_s = total_s
        shares = [BUDGET_SHARES[s] if s != "device_map" or two_gpus() else NO_SPLIT_SHARE for s in sections]
        shares = shares if sum(shares) else [1.0] * len(shares)  # device_map alone without two GPUs
        ends = itertools.accumulate(share / sum(shares) for share in shares)
        self.section_end = {s: self.start + end * total_s for s, end in zip(sections, ends)}
        self.current = sections[0] if sections else None

    def enter(self, section: str) -> None:
        self.current = section

    def expired(self) -> bool:
        """True once the current section has used up its share (later units are skipped)."""
        return time.perf_counter() > self.section_end[self.current]

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


@dataclass
class Context:
    plan: Plan
    device: torch.device
    budget: Budget
    out: Path
    results: dict = field(default_factory=dict)
    grace_s: float = 30.0  # a unit still running this long after its section's share is interrupted

    def save_partial(self, section: str, partial: dict) -> None:
        """Record a section's progress so far (status 'incomplete'), so a run killed mid-section keeps it."""
        self.results[section] = dict(partial, status="incomplete")
        write_results(self.out, self.results)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


def engine_compiles() -> bool:
    """True when `spectr.generate` takes `compile=` (the compiled engine); else the script runs eager only."""
    return "compile" in inspect.signature(spectr.generate).parameters


def engine_mode(compiled: bool) -> dict:
    """`compile=` for `spectr.generate` where it takes one: eager runs say so (its default may be "auto")."""
    return dict(compile=compiled) if engine_compiles() else {}


def log(message: str) -> None:
    print(f"[gpu_check] {message}", flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------


def tiny_model(arch: str, *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
               init_std: float, seed: int, dtype: torch.dtype, device: torch.device):
    """A seeded random tiny causal LM of a given HF architecture (sdpa attention, no downloads)."""
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, max_position_embeddings=256, initializer_range=init_std,
                  tie_word_embeddings=False)
    if arch == "llama":
        config = transformers.LlamaConfig(num_key_value_heads=kv_heads, **common)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(num_key_value_heads=kv_heads, **common)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "gpt_neox":
        config = transformers.GPTNeoXConfig(rotary_pct=0.5, **common)
        cls = transformers.GPTNeoXForCausalLM
    else:
        raise ValueError(f"unknown architecture {arch!r}")
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)  # built in float32 on the CPU, so the weights do not depend on the device
    return model.to(device=device, dtype=dtype).eval()


def random_llama(shape: dict, *, seed: int, device: torch.device, dtype: torch.dtype):
    """A random-initialised Llama of `shape`, built directly on `device` (HF init, std 0.02)."""
    config = transformers.LlamaConfig(**shape, initializer_range=0.02, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    return model.to(dtype).eval()


def draft_from_target(target, shape: dict, num_layers: int):
    """A draft of the target's family: its first `num_layers` layers, its embedding, norm and head."""
    device, dtype = next(target.parameters()).device, next(target.parameters()).dtype
    draft = random_llama({**shape, "num_hidden_layers": num_layers}, seed=1, device=device, dtype=dtype)
    state = target.state_dict()
    draft.load_state_dict({name: state[name] for name in draft.state_dict()})
    return draft


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------
# 1. exactness: chi-square of the first tokens against the enumerated law, with controls
# ---------------------------------------------------------------------------------------

EXACT_VOCAB = 8
EXACT_PROMPT = [1, 2, 3]
ACCEPT_P = 1e-4  # a correct engine must not be rejected at this level (seeds fixed: deterministic)
REJECT_P = 1e-6  # a negative control must be rejected at least this strongly
# Truncating warps only in float32: in bf16 a near-tie at the top-k / top-p edge could round
# differently in the cached engine and the cache-free enumeration, and a sample in a cell of
# exact probability 0 fails outright.
EXACT_WARPS = {"float32": (0.8, 5, 0.9), "bfloat16": (0.8, 0, 1.0)}
SINGLE_DRAFT_METHODS = ("speculative", "block")  # K = 1 by definition; the others use K = 3
EXACT_DRAFT_LENGTH = 2
CONTROL_TEMPERATURE_FACTOR = 1.25


def chi_square_sf(statistic: float, dof: int) -> float:
    """P(chi2_dof > statistic) = Q(dof / 2, statistic / 2), the regularized upper incomplete gamma."""
    if dof <= 0:
        return 1.0
    a = torch.tensor(dof / 2.0, dtype=torch.float64)
    x = torch.tensor(statistic / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(a, x))


@torch.inference_mode()
def enumerated_law(model, prompt: list[int], length: int, warp: spectr.SamplingWarp) -> torch.Tensor:
    """P(first `length` generated tokens) of the warped model by enumeration: [V ** length] float64, CPU.

    Every prefix of each depth goes through one batched, cache-free forward of the model itself
    (so a bf16 model's law is the bf16 model's).
    """
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    joint = torch.ones((), dtype=torch.float64)
    for depth in range(length):
        prefixes = list(itertools.product(range(vocab), repeat=depth))
        ids = torch.tensor([prompt + list(p) for p in prefixes], device=device)  # [V^depth, P + depth]
        logits = model(input_ids=ids, use_cache=False).logits[:, -1]  # [V^depth, V]
        step = warp.probs(logits).to(torch.float64).cpu().reshape([vocab] * depth + [vocab])
        joint = joint.unsqueeze(-1) * step
    return joint.reshape(-1)


def chi_square(tokens: list[list[int]], law: torch.Tensor, vocab: int, length: int) -> dict:
    """Chi-square of the joint counts of the first `length` tokens against `law` ([V ** length]).

    Cells with an expected count below 5 are pooled; any sample in a cell of probability 0
    gives p = 0.
    """
    samples = torch.tensor([t[:length] for t in tokens], dtype=torch.int64)  # [N, length]
    codes = torch.zeros(samples.shape[0], dtype=torch.int64)
    for i in range(length):
        codes = codes * vocab + samples[:, i]
    counts = torch.bincount(codes, minlength=vocab**length).to(torch.float64)
    impossible = int(counts[law == 0].sum())
    expected = law * samples.shape[0]
    large = expected >= 5
    observed, wanted = [counts[large]], [expected[large]]
    if expected[~large].sum() > 0:
        observed.append(counts[~large].sum().reshape(1))
        wanted.append(expected[~large].sum().reshape(1))
    observed, wanted = torch.cat(observed), torch.cat(wanted)
    statistic = float(((observed - wanted) ** 2 / wanted).sum())
    dof = len(observed) - 1
    p_value = 0.0 if impossible else chi_square_sf(statistic, dof)
    return dict(statistic=statistic, dof=dof, p_value=p_value, samples_in_impossible_cells=impossible)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [N, V], uniforms [N] -> [N] int64 (the script's own sampler; not the engine's)."""
    cdf = probs.to(torch.float64).cumsum(-1)  # [N, V]
    target = uniforms.to(torch.float64).unsqueeze(-1) * cdf[:, -1:]  # [N, 1]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(-1)


def skip_residual(selector: Callable) -> Callable:
    """A broken selection rule: where `selector` rejects every draft, sample q instead of the residual."""

    def broken(draft_tokens, alive, draft_probs, target_probs, uniforms):
        token, accepted = selector(draft_tokens, alive, draft_probs, target_probs, uniforms)
        from_q = _inverse_cdf(target_probs, uniforms[:, -1])  # [N]
        return torch.where(accepted, token, from_q), accepted

    return broken


# Broken versions of the sequence-level rules (spectr.sequence.SEQUENCE_RULES): block verification whose
# stop probabilities h_i = 1 keep every drafted block (the subtler h_i = w_i control needs more samples
# than this script's budget; tests/spectr/test_exactness_e2e.py rejects that one).
BROKEN_SEQUENCE_RULES = {"block": lambda: block_rule(lambda weights, excess: torch.ones_like(weights))}


@contextlib.contextmanager
def broken_selection(method: str):
    """Negative control: replace the method's token selector in `spectr.selection.TOKEN_SELECTORS`
    (every selector, for a method that is not itself a selector, e.g. a planner) by its
    skip-residual version, or a sequence-level rule by its broken version, and restore the registries
    on exit. Yields the replaced names."""
    if method in SEQUENCE_RULES:
        saved_rule = SEQUENCE_RULES[method]
        try:
            SEQUENCE_RULES[method] = BROKEN_SEQUENCE_RULES[method]()
            yield [method]
        finally:
            SEQUENCE_RULES[method] = saved_rule
        return
    names = [method] if method in TOKEN_SELECTORS else list(TOKEN_SELECTORS)
    saved = {name: TOKEN_SELECTORS[name] for name in names}
    try:
        for name in names:
            TOKEN_SELECTORS[name] = skip_residual(saved[name])
        yield names
    finally:
        TOKEN_SELECTORS.update(saved)


def exact_pair(dtype: torch.dtype, device: torch.device):
    """Peaked, context-dependent tiny Llamas (V = 8), so acceptance is far from 0 and from 1."""
    shape = dict(vocab=EXACT_VOCAB, hidden=16, heads=2, kv_heads=1, init_std=0.5, dtype=dtype, device=device)
    return tiny_model("llama", layers=2, seed=1, **shape), tiny_model("llama", layers=1, seed=2, **shape)


def generate_first_tokens(pair, method: str, warp: tuple, plan: Plan, compiled: bool = False):
    target, draft = pair
    temperature, top_k, top_p = warp
    out = spectr.generate(target, draft, [EXACT_PROMPT] * plan.exact_samples, method=method,
                          num_drafts=1 if method in SINGLE_DRAFT_METHODS else 3, draft_length=EXACT_DRAFT_LENGTH,
                          max_new_tokens=plan.exact_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                          seed=list(range(plan.exact_samples)), **engine_mode(compiled))
    if any(len(t) != plan.exact_tokens for t in out.tokens):
        raise AssertionError(f"{method}: some rows did not produce {plan.exact_tokens} tokens")
    return out


def negative_control(pair, law, method: str, warp: tuple, plan: Plan, compiled: bool = False) -> dict:
    """Run the same test on a deliberately broken sampler; it must be rejected."""
    if method == AUTOREGRESSIVE:  # no selection rule: sample the wrong law (temperature x 1.25)
        kind = f"temperature x {CONTROL_TEMPERATURE_FACTOR} (autoregressive has no selection rule)"
        out = generate_first_tokens(pair, method, (warp[0] * CONTROL_TEMPERATURE_FACTOR, *warp[1:]), plan,
                                   compiled)
    else:
        with broken_selection(method) as names:
            kind = (f"keep-every-block stops (h = 1) injected into SEQUENCE_RULES{names}"
                    if method in SEQUENCE_RULES else f"skip-residual selector injected into TOKEN_SELECTORS{names}")
            out = generate_first_tokens(pair, method, warp, plan, compiled)
    test = chi_square(out.tokens, law, EXACT_VOCAB, plan.exact_tokens)
    return dict(kind=kind, **test, rejected=test["p_value"] < REJECT_P)


def exactness_case(pair, law, method: str, dtype_name: str, plan: Plan, compiled: bool = False) -> dict:
    warp = EXACT_WARPS[dtype_name]
    out = generate_first_tokens(pair, method, warp, plan, compiled)
    test = chi_square(out.tokens, law, EXACT_VOCAB, plan.exact_tokens)
    stats = out.stats
    case = dict(dtype=dtype_name, method=method, compiled=compiled, num_drafts=stats.num_drafts, draft_length=stats.draft_length,
                warp=dict(zip(("temperature", "top_k", "top_p"), warp)), samples=plan.exact_samples,
                tokens=plan.exact_tokens, acceptance_rate=stats.acceptance_rate, **test)
    # the drafts must really have been tested and sometimes rejected, or the test proves little
    case["drafts_tested"] = method == AUTOREGRESSIVE or 0.02 < stats.acceptance_rate < 0.98
    case["control"] = negative_control(pair, law, method, warp, plan, compiled)
    case["passed"] = bool(test["p_value"] > ACCEPT_P and case["drafts_tested"] and case["control"]["rejected"])
    return case


def exact_units(plan: Plan) -> list[tuple[str, bool]]:
    """(method, compiled): every known method eager, then `plan.compiled_exact_methods` compiled where the
    engine takes `compile=` (the compiled engine must be as exact as the eager one, negative controls too)."""
    compiled = [m for m in plan.compiled_exact_methods if m in spectr.known_methods()] if engine_compiles() else []
    return [(m, False) for m in spectr.known_methods()] + [(m, True) for m in compiled]


def section_exactness(ctx: Context) -> dict:
    cases, skipped = [], []
    for dtype_name in EXACT_WARPS:
        dtype = getattr(torch, dtype_name)
        pair = exact_pair(dtype, ctx.device)
        law = enumerated_law(pair[0], EXACT_PROMPT, ctx.plan.exact_tokens, spectr.SamplingWarp(*EXACT_WARPS[dtype_name]))
        for method, compiled in exact_units(ctx.plan):
            label = f"{dtype_name}/{method}" + (" compiled" if compiled else "")
            if ctx.budget.expired():
                skipped.append(label)
                continue
            try:
                case = exactness_case(pair, law, method, dtype_name, ctx.plan, compiled)
            except Exception as error:  # one broken method must not hide the others
                case = dict(dtype=dtype_name, method=method, compiled=compiled, passed=False, error=_describe(error))
            log(f"exactness {label}: p = {case.get('p_value', float('nan')):.3g}, control p = "
                f"{case.get('control', {}).get('p_value', float('nan')):.3g} -> {'PASS' if case['passed'] else 'FAIL'}")
            cases.append(case)
            ctx.save_partial("exactness", dict(cases=cases))
    passed = bool(cases) and all(c["passed"] for c in cases) and not skipped
    return dict(status="passed" if passed else "failed", accept_p=ACCEPT_P, reject_p=REJECT_P,
                methods=spectr.known_methods(), cases=cases, skipped_for_time=skipped)


# ---------------------------------------------------------------------------------------
# 2. greedy equals Hugging Face greedy
# ---------------------------------------------------------------------------------------

GREEDY_ARCHS = ("llama", "qwen2", "gpt_neox")
GREEDY_PROMPT_LENGTHS = (4, 7, 11)


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def greedy_arch(arch: str, ctx: Context) -> list[dict]:
    shape = dict(vocab=96, hidden=32, heads=4, kv_heads=2, init_std=0.3, dtype=torch.float32, device=ctx.device)
    target = tiny_model(arch, layers=2, seed=11, **shape)
    draft = tiny_model(arch, layers=1, seed=12, **shape)
    generator = torch.Generator().manual_seed(13)
    prompts = [torch.randint(3, 96, (n,), generator=generator).tolist() for n in GREEDY_PROMPT_LENGTHS]
    new_tokens = ctx.plan.greedy_new_tokens
    reference = [hf_greedy(target, p, new_tokens) for p in prompts]
    cases = []
    for method in spectr.known_methods():
        num_drafts = 1 if method in SINGLE_DRAFT_METHODS else 2
        out = spectr.generate(target, draft, prompts, method=method, num_drafts=num_drafts, draft_length=3,
                              max_new_tokens=new_tokens, temperature=0.0)
        mismatches = [next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
                      for ours, theirs in zip(out.tokens, reference) if ours != theirs]
        cases.append(dict(arch=arch, method=method, prompts=len(prompts), new_tokens=new_tokens,
                          equal=not mismatches, first_mismatch=min(mismatches) if mismatches else None))
    return cases


def section_greedy(ctx: Context) -> dict:
    cases, skipped = [], []
    for arch in GREEDY_ARCHS:
        if ctx.budget.expired():
            skipped.append(arch)
            continue
        try:
            arch_cases = greedy_arch(arch, ctx)
        except Exception as error:
            arch_cases = [dict(arch=arch, method="*", equal=False, error=_describe(error))]
        log(f"greedy {arch}: " + ", ".join(f"{c['method']} {'==' if c['equal'] else '!='} HF" for c in arch_cases))
        cases += arch_cases
        ctx.save_partial("greedy", dict(dtype="float32", cases=cases))
    passed = bool(cases) and all(c["equal"] for c in cases) and not skipped
    return dict(status="passed" if passed else "failed", dtype="float32", cases=cases, skipped_for_time=skipped)


# ---------------------------------------------------------------------------------------
# 3. the embedded pair's acceptance (for the predictions only)
# ---------------------------------------------------------------------------------------

PAIR_DIR = REPO / "assets" / "models"
PROMPTS_FILE = REPO / "assets" / "prompts.jsonl"


def pair_prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` prompts spread over assets/prompts.jsonl, tokenized (BOS prepended by the tokenizer)."""
    with open(PROMPTS_FILE) as f:
        rows = [json.loads(line)["prompt"] for line in f if line.strip()]
    step = max(1, len(rows) // count)
    return [tokenizer(text)["input_ids"] for text in rows[::step][:count]]


def acceptance_from_eval_json() -> dict:
    """Fallback when the weights are not on this machine: the CPU measurement in assets/models/eval.json."""
    with open(PAIR_DIR / "eval.json") as f:
        evaluation = json.load(f)
    alpha = float(evaluation["prompts"]["acceptance"])
    return dict(status="measured", source="assets/models/eval.json (sum min(p, q) over the default prompts' "
                "positions, measured on CPU by scripts/eval_pair.py; not on this device)",
                alpha=alpha, block_efficiency={})


def section_pair_acceptance(ctx: Context) -> dict:
    """alpha of the embedded pair, measured here when its weights are present, else read from eval.json."""
    error = None
    if all((PAIR_DIR / role / "model.safetensors").exists() for role in ("target", "draft")):
        try:
            return measure_pair_acceptance(ctx)
        except Exception as failure:  # e.g. a tokenizer this transformers cannot load: fall back
            error = _describe(failure)
            log(f"embedded pair could not be measured here ({error}); using eval.json")
    if (PAIR_DIR / "eval.json").exists():
        return dict(acceptance_from_eval_json(), device_error=error)
    return dict(status="skipped", reason="assets/models is not on this machine", device_error=error)


def measure_pair_acceptance(ctx: Context) -> dict:
    """alpha of the embedded pair (speculative, L = 4) and its block efficiency at each speed-grid (K, L)."""
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    load = dict(dtype=dtype, attn_implementation="sdpa")
    target = transformers.AutoModelForCausalLM.from_pretrained(PAIR_DIR / "target", **load).to(ctx.device)
    draft = transformers.AutoModelForCausalLM.from_pretrained(PAIR_DIR / "draft", **load).to(ctx.device)
    tokenizer = transformers.AutoTokenizer.from_pretrained(PAIR_DIR / "target")
    prompts = pair_prompts(tokenizer, ctx.plan.pair_prompts)
    common = dict(max_new_tokens=ctx.plan.pair_new_tokens, temperature=1.0, seed=list(range(len(prompts))))
    length = ctx.plan.assisted_length  # the L of the speed section's speculative row
    out = spectr.generate(target, draft, prompts, method="speculative", draft_length=length, **common)
    efficiency = {f"K=1,L={length}": out.stats.block_efficiency}
    ctx.save_partial("pair_acceptance", dict(alpha=out.stats.acceptance_rate, block_efficiency=efficiency,
                                             source=f"assets/models on this device ({dtype}), cut short"))
    for k, length in itertools.product(ctx.plan.grid_drafts, ctx.plan.grid_lengths):
        if ctx.budget.expired():
            break
        run = spectr.generate(target, draft, prompts, method="spectr", num_drafts=k, draft_length=length, **common)
        efficiency[f"K={k},L={length}"] = run.stats.block_efficiency
    log(f"embedded pair: alpha = {out.stats.acceptance_rate:.3f} over {out.stats.tested_positions} positions")
    return dict(status="measured", source=f"assets/models on this device ({dtype}), {len(prompts)} prompts of "
                f"assets/prompts.jsonl, {ctx.plan.pair_new_tokens} new tokens, temperature 1, alpha from "
                f"speculative L={ctx.plan.assisted_length}", alpha=out.stats.acceptance_rate,
                tested_positions=out.stats.tested_positions, block_efficiency=efficiency)


# ---------------------------------------------------------------------------------------
# 4. speed: ratios in one run on a random ~1.1B Llama pair
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeedRun:
    """One measured configuration. kind: 'ours' | 'hf' | 'hf_static' | 'hf_assisted'.

    compiled: ours with `spectr.generate(compile=True)` (only where the engine takes `compile`);
    'hf_static' is HF `generate` with a static cache, which HF compiles itself on CUDA (`torch.compile`,
    its fastest documented path; on CPU it runs the static cache uncompiled).
    """

    kind: str
    batch: int
    method: str = AUTOREGRESSIVE
    num_drafts: int = 1
    draft_length: int = 1
    compiled: bool = False
    attention: str = ""  # compiled runs: `spectr.native.ATTENTION` set ("masked" / "flex", in the name); "": as is

    @property
    def name(self) -> str:
        if self.kind == "hf":
            return "HF generate (sampling)"
        if self.kind == "hf_static":
            return "HF generate static cache + compile"
        if self.kind == "hf_assisted":
            return f"HF assisted L={self.draft_length}"
        mode = (" compiled" if self.compiled else "") + (f" {self.attention}" if self.attention else "")
        if self.method == AUTOREGRESSIVE:
            return f"ours autoregressive{mode}"
        if self.method == "speculative":
            return f"ours speculative L={self.draft_length}{mode}"
        return f"ours {self.method} K={self.num_drafts} L={self.draft_length}{mode}"




def speed_prompts(batch: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (batch,), generator=generator).tolist()
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in sizes]


def left_padded(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros(len(prompts), width, dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


@contextlib.contextmanager
def attention(kind: str):
    """`spectr.native.ATTENTION` = kind for the duration (compiled runs build their core with it); "": as is."""
    import spectr.native as native

    if not kind:
        yield
        return
    if not hasattr(native, "ATTENTION"):
        raise RuntimeError(f"this engine has no attention {kind!r} (spectr.native.ATTENTION)")
    before = getattr(native, "ATTENTION", "masked")
    native.ATTENTION = kind
    try:
        yield
    finally:
        native.ATTENTION = before


def run_ours(pair, prompts, run: SpeedRun, new_tokens: int, device: torch.device) -> dict:
    """One timed `spectr.generate` call (sampling at temperature 1, no truncation, no EOS)."""
    target, draft = pair
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    start = time.perf_counter()
    with attention(run.attention):
        out = spectr.generate(target, draft, prompts, method=run.method, num_drafts=run.num_drafts,
                              draft_length=run.draft_length, max_new_tokens=new_tokens, temperature=1.0,
                              seed=list(range(len(prompts))), **engine_mode(run.compiled))
    synchronize(device)
    wall = time.perf_counter() - start
    tokens = sum(len(t) for t in out.tokens)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return dict(wall_s=wall, tokens=tokens, tokens_per_s=tokens / wall, stats=out.stats,
                iterations=max(out.stats.target_calls), peak_memory_mib=peak)


@torch.inference_mode()
def run_hf(pair, prompts, run: SpeedRun, new_tokens: int, device: torch.device) -> dict:
    """One timed HF `generate` call, the same sampling (do_sample, top_k=0): plain, static cache, or assisted."""
    target, draft = pair
    ids, mask = left_padded(prompts, device)
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None)
    if run.kind == "hf_static":
        kwargs["cache_implementation"] = "static"  # HF compiles the decode step itself on CUDA
    if run.kind == "hf_assisted":
        draft.generation_config.num_assistant_tokens = run.draft_length
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = draft
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    synchronize(device)
    start = time.perf_counter()
    out = target.generate(ids, attention_mask=mask, **kwargs)
    synchronize(device)
    wall = time.perf_counter() - start
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return dict(wall_s=wall, tokens=tokens, tokens_per_s=tokens / wall, peak_memory_mib=peak)


def run_once(pair, prompts, run: SpeedRun, new_tokens: int, device: torch.device) -> dict:
    return (run_ours if run.kind == "ours" else run_hf)(pair, prompts, run, new_tokens, device)


@contextlib.contextmanager
def cuda_sync_warnings(device: torch.device):
    """Counts `torch.cuda.set_sync_debug_mode("warn")` warnings while active; box['count'] is None off CUDA."""
    box: dict = {"count": None}
    if device.type != "cuda":
        yield box
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield box
        finally:
            torch.cuda.set_sync_debug_mode("default")
    box["count"] = sum("synchroniz" in str(w.message).lower() for w in caught)


def count_syncs(pair, prompts, run: SpeedRun, new_tokens: int, device: torch.device) -> dict:
    """Syncs per iteration from two separate, untimed runs under HostSyncCounter (and, on CUDA, the
    sync debug mode): `new_tokens` and 1 new token, differenced so that setup and prefill drop out."""
    counts = []
    for tokens in (new_tokens, 1):
        with HostSyncCounter() as host, cuda_sync_warnings(device) as cuda:
            out = run_ours(pair, prompts, run, tokens, device)
        counts.append((out["iterations"], host.total, cuda["count"], dict(host.by_kind)))
    (iterations, host, cuda, by_kind), (short_iterations, short_host, short_cuda, _) = counts
    gap = iterations - short_iterations
    if gap <= 0:  # cannot difference: plain averages of the long run (setup included)
        gap, short_host, short_cuda = iterations, 0, 0 if cuda is not None else None
    return dict(sync_run_new_tokens=new_tokens, sync_run_iterations=iterations, host_syncs=host,
                host_syncs_by_kind=by_kind, host_syncs_per_iteration=(host - short_host) / gap,
                cuda_syncs=cuda, cuda_syncs_per_iteration=None if cuda is None else (cuda - short_cuda) / gap,
                setup_syncs_removed=gap != iterations)


PHASE_FIELDS = ("draft_seconds", "target_seconds", "selection_seconds", "other_seconds")


def decode_costs(long: dict, short: dict) -> dict:
    """Per-iteration costs with the prefill removed: (long run - one-token run) / (their iteration gap)."""
    gap = long["iterations"] - short["iterations"]
    if gap <= 0:  # cannot difference: fall back to the long run's plain averages (prefill included)
        short, gap = None, long["iterations"]

    def per_iteration(name: str, getter) -> float:
        value = getter(long) - (getter(short) if short else 0.0)
        return 1000.0 * max(value, 0.0) / gap

    breakdown = {f.removesuffix("_seconds"): per_iteration(f, lambda r, f=f: getattr(r["stats"], f))
                 for f in PHASE_FIELDS}
    return dict(iteration_ms=per_iteration("wall", lambda r: r["wall_s"]), per_iteration_ms=breakdown,
                prefill_removed=short is not None)


def ours_row(pair, prompts, run: SpeedRun, plan: Plan, device: torch.device, long_runs: list[dict]) -> dict:
    """The row of one of our configurations from its timed calls, plus its untimed prefill and sync runs."""
    long = sorted(long_runs, key=lambda r: r["wall_s"])[len(long_runs) // 2]  # the median run
    short = run_ours(pair, prompts, run, 1, device)
    stats = long["stats"]
    row = dict(name=run.name, kind=run.kind, batch=run.batch, method=stats.method, compiled=run.compiled,
               attention=run.attention, num_drafts=stats.num_drafts, draft_length=stats.draft_length, new_tokens=plan.speed_new_tokens,
               tokens_per_s=statistics.median(r["tokens_per_s"] for r in long_runs),
               wall_s=long["wall_s"], generated_tokens=long["tokens"], iterations=long["iterations"],
               block_efficiency=stats.block_efficiency, acceptance_rate=stats.acceptance_rate,
               peak_memory_mib=long["peak_memory_mib"], repeats=len(long_runs))
    row.update(decode_costs(long, short))
    row.update(count_syncs(pair, prompts, run, plan.sync_new_tokens, device))
    return row


def hf_row(run: SpeedRun, plan: Plan, device: torch.device, runs: list[dict]) -> dict:
    return dict(name=run.name, kind=run.kind, batch=run.batch, method=run.kind,
                compiled=run.kind == "hf_static" and device.type == "cuda",  # HF's own auto-compile criteria
                num_drafts=1 if run.kind == "hf_assisted" else 0,
                draft_length=run.draft_length if run.kind == "hf_assisted" else 0, new_tokens=plan.speed_new_tokens,
                tokens_per_s=statistics.median(r["tokens_per_s"] for r in runs),
                wall_s=statistics.median(r["wall_s"] for r in runs), generated_tokens=runs[0]["tokens"],
                peak_memory_mib=max((r["peak_memory_mib"] or 0) for r in runs) if device.type == "cuda" else None,
                repeats=len(runs))


def measure_group(pair, prompts, group: tuple[SpeedRun, ...], plan: Plan, device: torch.device,
                  repeats: int) -> list[dict]:
    """Time the runs of `group` interleaved: `repeats` rounds, each run once per round, so that a drift of
    the machine (clocks, heat) falls on every run alike; a row's tokens/s is the median of its rounds.

    A compiled run (ours compiled, HF static cache) first makes one untimed call of the full length, which
    compiles its graphs: its wall time is recorded as `warmup_s` (the compile time paid, plus one run).
    A run that raises (e.g. out of memory) gets an error row; the others go on.
    """
    timed: dict[SpeedRun, list[dict]] = {run: [] for run in group}
    errors: dict[SpeedRun, str] = {}
    warmup: dict[SpeedRun, float] = {}

    def attempt(run: SpeedRun) -> dict | None:
        try:
            return run_once(pair, prompts, run, plan.speed_new_tokens, device)
        except Exception as error:  # recorded in its row; SectionTimeout is no Exception and cuts the section
            errors[run] = _describe(error)
            release_memory(device)
            return None

    for run in group:
        if run.compiled or run.kind == "hf_static":
            warm = attempt(run)
            if warm is not None:
                warmup[run] = warm["wall_s"]
    for _ in range(repeats):
        for run in (r for r in group if r not in errors):
            result = attempt(run)
            if result is not None:
                timed[run].append(result)
    rows = []
    for run in group:
        try:
            if run in errors:
                raise RuntimeError(errors[run])
            row = ours_row(pair, prompts, run, plan, device, timed[run]) if run.kind == "ours" else \
                hf_row(run, plan, device, timed[run])
        except Exception as error:
            row = dict(name=run.name, kind=run.kind, batch=run.batch, compiled=run.compiled,
                       error=errors.get(run) or _describe(error))
        row["warmup_s"] = warmup.get(run)
        rows.append(row)
    return rows


SpeedUnit = tuple[tuple[SpeedRun, ...], int]  # (runs timed interleaved, repeats)


def speed_units(plan: Plan, methods: list[str], compiles: bool) -> list[SpeedUnit]:
    """The units in priority order: at each batch the headline group (our autoregressive and SpecTr at
    `plan.headline_spectr`, eager and, where the engine compiles, compiled; HF generate plain and with a
    static cache + compile), then ours speculative vs HF assisted (batch 1), then the K x L grids."""
    k, length = plan.headline_spectr
    units: list[SpeedUnit] = []
    for batch in plan.speed_batches:
        ours = [SpeedRun("ours", batch), SpeedRun("ours", batch, "spectr", k, length)]
        if compiles:
            ours += [SpeedRun("ours", batch, compiled=True), SpeedRun("ours", batch, "spectr", k, length, True)]
        units.append((tuple(ours) + (SpeedRun("hf", batch), SpeedRun("hf_static", batch)), plan.headline_repeats))
    length = plan.assisted_length
    units.append(((SpeedRun("ours", 1, "speculative", 1, length), SpeedRun("hf_assisted", 1, draft_length=length)),
                  plan.headline_repeats))
    for batch in sorted(plan.speed_batches, key=lambda b: (b == 1, b)):  # batch 1 last: the slowest per token
        for k, length in itertools.product(plan.grid_drafts, plan.grid_lengths):
            if (k, length) != plan.headline_spectr:
                units.append(((SpeedRun("ours", batch, "spectr", k, length),), 1))
        if "auto" in methods:
            units.append(((SpeedRun("ours", batch, "auto", max(plan.grid_drafts), max(plan.grid_lengths)),), 1))
    if compiles:  # last (it runs if time is left): the compiled core's attention, masked vs FlexAttention
        k, length = plan.headline_spectr
        for batch in plan.speed_batches:
            units.append(((SpeedRun("ours", batch, "spectr", k, length, True, "masked"),
                           SpeedRun("ours", batch, "spectr", k, length, True, "flex")), plan.headline_repeats))
    return units


def warm_up(pair, prompts, device: torch.device) -> None:
    """Tune the eager kernels for this batch shape once (short runs, not recorded; compiled runs warm themselves)."""
    for run in (SpeedRun("ours", len(prompts)), SpeedRun("ours", len(prompts), "spectr", 2, 2),
                SpeedRun("hf", len(prompts))):
        run_once(pair, prompts, run, 4, device)


def build_speed_pair(ctx: Context):
    shape, dtype = ctx.plan.speed_shape, torch.bfloat16
    target = random_llama(shape, seed=0, device=ctx.device, dtype=dtype)
    draft = draft_from_target(target, shape, ctx.plan.draft_layers)
    weights = torch.cuda.memory_allocated(ctx.device) / 2**20 if ctx.cuda else None
    models = dict(dtype="bfloat16", target_shape=shape, target_parameters=parameter_count(target),
                  draft_layers=ctx.plan.draft_layers, draft_parameters=parameter_count(draft), weights_mib=weights,
                  description=f"random-initialised Llama target ({parameter_count(target) / 1e6:,.1f}M params, "
                  f"HF init std 0.02); draft ({parameter_count(draft) / 1e6:,.1f}M params) = the target's first "
                  f"{ctx.plan.draft_layers} layer(s) with its embedding, final norm and head, so acceptance is "
                  "high and unlike a trained pair's")
    return (target, draft), models


def section_speed(ctx: Context) -> dict:
    pair, models = build_speed_pair(ctx)
    compiles = engine_compiles() and ctx.plan.compiled_speed
    models["engine_compiles"] = compiles
    log(models["description"] + ("" if compiles else "; spectr.generate takes no `compile`: eager only"))
    rows, skipped, warmed = [], [], set()
    vocab = ctx.plan.speed_shape["vocab_size"]
    for group, repeats in speed_units(ctx.plan, spectr.known_methods(), compiles):
        batch = group[0].batch
        if ctx.budget.expired():
            skipped += [f"B={batch} {run.name}" for run in group]
            continue
        prompts = speed_prompts(batch, ctx.plan.prompt_lengths, vocab, seed=batch)
        try:
            if batch not in warmed:
                warm_up(pair, prompts, ctx.device)
                warmed.add(batch)
            group_rows = measure_group(pair, prompts, group, ctx.plan, ctx.device, repeats)
        except Exception as error:  # e.g. out of memory in the warm-up at one batch size: record it, go on
            group_rows = [dict(name=run.name, kind=run.kind, batch=batch, compiled=run.compiled,
                               error=_describe(error)) for run in group]
            release_memory(ctx.device)
        for row in group_rows:
            log(f"speed B={batch} {row['name']}: " + (f"{row['tokens_per_s']:.1f} tokens/s" if "error" not in row
                                                       else row["error"]))
        rows += group_rows
        add_ratios(rows)
        ctx.save_partial("speed", dict(models=models, rows=rows, skipped_for_time=skipped))
    ok = [r for r in rows if "error" not in r]
    status = "measured" if ok and len(ok) == len(rows) else ("partial" if ok else "failed")
    return dict(status=status, models=models, sampling="temperature 1, top_k 0, top_p 1, no EOS",
                prompt_lengths=list(ctx.plan.prompt_lengths), rows=rows, skipped_for_time=skipped)


# ---------------------------------------------------------------------------------------
# 6. device_map: a target split over two GPUs (spectr.split) against the same target on one
# ---------------------------------------------------------------------------------------

SPLIT_METHODS = ((AUTOREGRESSIVE, 1, 1), ("spectr", 2, 4))  # (method, K, L) of each compared arm


def split_devices(ctx: Context) -> dict | None:
    """{plan GPU: device} for the split target: two GPUs where >= 2 are visible; in the CPU smoke run two
    groups on the CPU (the same code path, nothing measured); else None (the section is skipped)."""
    if ctx.plan.name == SMOKE.name and not ctx.cuda:
        return {0: "cpu", 1: "cpu"}
    if ctx.cuda and torch.cuda.device_count() >= 2:
        return {0: "cuda:0", 1: "cuda:1"}
    return None


def split_units(compiles: bool) -> list[tuple[str, int, int, bool]]:
    return [(m, k, length, compiled) for compiled in ((False, True) if compiles else (False,))
            for m, k, length in SPLIT_METHODS]


def section_device_map(ctx: Context) -> dict:
    """Tokens/s of a target split over two GPUs vs the same target on the first, and identical tokens for a seed
    (eager; compiled where the engine compiles). Skipped, and recorded so, with fewer than two GPUs."""
    devices = split_devices(ctx)
    if devices is None:
        gpus = torch.cuda.device_count() if ctx.cuda else 0
        return dict(status="skipped", reason=f"skipped: {gpus} GPU" + ("" if gpus == 1 else "s"))
    from pipeline.placement import placement_plan
    from spectr.split import dispatch, layer_groups

    (target, draft), models = build_speed_pair(ctx)
    shape = ctx.plan.speed_shape
    split = dispatch(random_llama(shape, seed=0, device=ctx.device, dtype=torch.bfloat16),
                     placement_plan(shape["num_hidden_layers"], [0, 1]), devices)
    models["groups"] = [[a, b, str(d)] for a, b, d in layer_groups(split, shape["num_hidden_layers"])]
    batch = ctx.plan.speed_batches[min(1, len(ctx.plan.speed_batches) - 1)]
    prompts = speed_prompts(batch, ctx.plan.prompt_lengths, shape["vocab_size"], seed=batch)
    rows, skipped = [], []
    for method, k, length, compiled in split_units(engine_compiles() and ctx.plan.compiled_speed):
        name = f"{method} K={k} L={length}" + (" compiled" if compiled else "")
        if ctx.budget.expired():
            skipped.append(name)
            continue
        try:
            rows.append(dict(name=name, batch=batch, **compare_split((target, draft), (split, draft), prompts,
                                                                      SpeedRun("ours", batch, method, k, length,
                                                                               compiled), ctx)))
        except Exception as error:
            rows.append(dict(name=name, batch=batch, error=_describe(error)))
        log(f"device_map {name}: {rows[-1]}")
        ctx.save_partial("device_map", dict(models=models, rows=rows, skipped_for_time=skipped))
    ok = [r for r in rows if "error" not in r]
    passed = bool(ok) and len(ok) == len(rows) and all(r["identical_tokens"] for r in ok)
    return dict(status="passed" if passed else "failed", models=models, devices={str(k): v for k, v in devices.items()},
                rows=rows, skipped_for_time=skipped, measured=ctx.cuda)


def compare_split(whole_pair, split_pair, prompts, run: SpeedRun, ctx: Context) -> dict:
    """One warm-up each, then one timed run each of the same seeds: tokens/s and whether the tokens agree."""
    new_tokens = ctx.plan.speed_new_tokens
    results = {}
    for label, pair in (("one_gpu", whole_pair), ("split", split_pair)):
        run_ours(pair, prompts, run, 4, ctx.device)  # warm-up (and compile) outside the timing
        target, draft = pair
        synchronize(ctx.device)
        start = time.perf_counter()
        out = spectr.generate(target, draft, prompts, method=run.method, num_drafts=run.num_drafts,
                              draft_length=run.draft_length, max_new_tokens=new_tokens, temperature=1.0,
                              seed=list(range(len(prompts))), **engine_mode(run.compiled))
        synchronize(ctx.device)
        wall = time.perf_counter() - start
        results[label] = (out.tokens, sum(len(t) for t in out.tokens) / wall)
    mismatch = [row for row, (a, b) in enumerate(zip(results["one_gpu"][0], results["split"][0])) if a != b]
    return dict(one_gpu_tokens_per_s=results["one_gpu"][1], split_tokens_per_s=results["split"][1],
                split_vs_one_gpu=results["split"][1] / results["one_gpu"][1], identical_tokens=not mismatch,
                rows_differing=mismatch[:8])


def markdown_device_map(section: dict) -> list[str]:
    if section.get("status") == "skipped":
        return [str(section.get("reason"))]
    rows = [[r["batch"], r["name"], r.get("one_gpu_tokens_per_s"), r.get("split_tokens_per_s"),
             r.get("split_vs_one_gpu"), r.get("identical_tokens"), r.get("error")] for r in section.get("rows", [])]
    note = [] if section.get("measured") else ["", "(CPU smoke run: both 'GPUs' are the CPU; nothing measured)"]
    return [f"groups: {section.get('models', {}).get('groups')}", ""] + _table(
        ["B", "run", "one GPU tokens/s", "split tokens/s", "split / one GPU", "identical tokens", "error"], rows) + note


def add_ratios(rows: list[dict]) -> None:
    """Measured ratios within the run, at the same batch: every ours row vs our eager autoregressive (and a
    compiled row vs our compiled autoregressive and vs its own eager run); ours vs HF generate (speculative:
    vs HF assisted) and vs HF generate with a static cache + compile."""
    by_name = {(r["batch"], r["name"]): r for r in rows if "error" not in r}

    def ratio(row: dict, name: str) -> float | None:
        other = by_name.get((row["batch"], name))
        return row["tokens_per_s"] / other["tokens_per_s"] if other else None

    for row in (r for r in rows if "error" not in r and r["kind"] == "ours"):
        row["speedup_vs_our_autoregressive"] = ratio(row, SpeedRun("ours", 1).name)
        if row.get("compiled"):
            row["speedup_vs_our_compiled_autoregressive"] = ratio(row, SpeedRun("ours", 1, compiled=True).name)
            attention = row.get("attention") or ""
            base = row["name"].removesuffix(f" {attention}") if attention else row["name"]  # "... compiled"
            row["compiled_vs_eager"] = ratio(row, base.removesuffix(" compiled"))
            if attention == "flex":  # the compiled core's attention: FlexAttention vs masked, same unit
                row["flex_vs_masked"] = ratio(row, f"{base} masked")
        hf = SpeedRun("hf_assisted", 1, draft_length=row["draft_length"]) if row["method"] == "speculative" \
            else SpeedRun("hf", 1)
        if ratio(row, hf.name) is not None:
            row["vs_hf"] = dict(hf_run=hf.name, hf_tokens_per_s=by_name[(row["batch"], hf.name)]["tokens_per_s"],
                                ratio=ratio(row, hf.name))
        row["vs_hf_static_compiled"] = ratio(row, SpeedRun("hf_static", 1).name)


# ---------------------------------------------------------------------------------------
# predictions at the embedded pair's acceptance
# ---------------------------------------------------------------------------------------


def tokens_per_call(alpha: float, draft_length: int) -> float:
    """Expected tokens per target call of one draft with i.i.d. acceptance alpha: (1 - a^(L+1)) / (1 - a)."""
    if alpha >= 1.0:
        return draft_length + 1.0
    return (1.0 - alpha ** (draft_length + 1)) / (1.0 - alpha)


def predict(speed: dict, pair: dict) -> dict:
    """Predicted speedup over our autoregressive decoding = tokens per iteration at the embedded pair's
    acceptance / (measured cost of one iteration / measured cost of one autoregressive step, same batch).

    Tokens per iteration: the formula (1 - a^(L+1)) / (1 - a) at the pair's acceptance a (exact for one
    draft with i.i.d. acceptance; for K > 1 it ignores the extra drafts, a lower estimate), and, where the
    pair section ran the pair at that (K, L), its measured block efficiency.
    """
    alpha = pair.get("alpha")
    if alpha is None or speed.get("status") not in ("measured", "partial"):
        return dict(status="skipped", reason="needs both the speed rows and the embedded pair's acceptance")
    rows = [r for r in speed["rows"] if "error" not in r and r["kind"] == "ours"]
    ar_rows = {(r["batch"], r.get("compiled", False)): r for r in rows if r["method"] == AUTOREGRESSIVE}
    predictions = []
    for row in rows:
        ar = ar_rows.get((row["batch"], row.get("compiled", False)))  # a compiled row vs compiled AR
        if row["method"] == AUTOREGRESSIVE or ar is None:
            continue
        k, length = row["num_drafts"], row["draft_length"]
        if row["iteration_ms"] <= 0 or ar["iteration_ms"] <= 0:
            # the long and the one-token run took the same time within noise (tiny models, smoke mode)
            predictions.append(dict(batch=row["batch"], name=row["name"], num_drafts=k, draft_length=length,
                                    skipped="iteration time not measurable above timing noise"))
            continue
        formula = tokens_per_call(alpha, length)
        measured_be = pair.get("block_efficiency", {}).get(f"K={k},L={length}")
        cost = row["iteration_ms"] / ar["iteration_ms"]  # wall time per iteration, prefill differenced out
        forwards = row["per_iteration_ms"]["draft"] + row["per_iteration_ms"]["target"]
        predictions.append(dict(
            batch=row["batch"], name=row["name"], num_drafts=k, draft_length=length,
            formula_tokens_per_iteration=formula, embedded_pair_block_efficiency=measured_be,
            iteration_cost_vs_ar_step=cost,
            forward_cost_vs_ar_step=forwards / max(ar["per_iteration_ms"]["target"], 1e-9),
            predicted_speedup_formula=formula / cost,
            predicted_speedup_embedded_pair=None if measured_be is None else measured_be / cost,
            measured_speedup_random_pair=row.get("speedup_vs_our_autoregressive")))
    return dict(status="predicted", alpha=alpha, alpha_source=pair.get("source"), rows=predictions)


# ---------------------------------------------------------------------------------------
# results: JSON, markdown, printing
# ---------------------------------------------------------------------------------------


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def environment(args: argparse.Namespace, device: torch.device) -> dict:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=" ".join([sys.executable, *sys.argv]), plan=args.plan.name, budget_s=args.budget_s,
                device=str(device), device_name=name, torch=torch.__version__, transformers=transformers.__version__,
                python=platform.python_version(), cuda=torch.version.cuda, git_commit=commit,
                torch_threads=torch.get_num_threads(), known_methods=spectr.known_methods(), host=platform.node())


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e-2 and value != 0 else f"{value:.{digits}f}"
    return str(value)


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]


def markdown_exactness(section: dict) -> list[str]:
    rows = [[c["dtype"], c["method"] + (" compiled" if c.get("compiled") else ""), c.get("num_drafts"), c.get("draft_length"), c.get("samples"),
             _fmt(c.get("p_value"), 3), c.get("acceptance_rate"), _fmt(c.get("control", {}).get("p_value"), 3),
             c.get("control", {}).get("rejected"), c["passed"]] for c in section.get("cases", [])]
    lines = _table(["dtype", "method", "K", "L", "samples", "p-value", "acceptance", "control p",
                    "control rejected", "passed"], rows)
    errors = [f"- {c['dtype']}/{c['method']}: {c['error']}" for c in section.get("cases", []) if "error" in c]
    return lines + errors


def markdown_speed(section: dict) -> list[str]:
    rows = []
    for r in section.get("rows", []):
        if "error" in r:
            rows.append([r["batch"], r["name"], "error: " + r["error"][:80]] + [None] * 13)
            continue
        breakdown = r.get("per_iteration_ms")
        split = "/".join(f"{breakdown[p]:.1f}" for p in ("draft", "target", "selection", "other")) if breakdown else None
        rows.append([r["batch"], r["name"], r["tokens_per_s"], r.get("vs_hf", {}).get("ratio"),
                     r.get("vs_hf_static_compiled"), r.get("speedup_vs_our_autoregressive"),
                     r.get("compiled_vs_eager"), r.get("block_efficiency"), r.get("acceptance_rate"),
                     r.get("iteration_ms"), split, r.get("host_syncs_per_iteration"),
                     r.get("cuda_syncs_per_iteration"), r.get("peak_memory_mib"), r.get("warmup_s")])
    flex = [f"- B={r['batch']} {r['name']}: flex / masked attention {r['flex_vs_masked']:.2f}x"
            for r in section.get("rows", []) if r.get("flex_vs_masked") is not None]
    return _table(["B", "run", "tokens/s", "vs HF", "vs HF static+compile", "vs our AR", "compiled vs eager",
                   "block eff.", "acceptance", "iter ms", "draft/target/select/other ms", "host syncs/iter",
                   "CUDA syncs/iter", "peak MiB", "warm-up s"], rows) + ([""] + flex if flex else [])


def markdown_predictions(section: dict) -> list[str]:
    rows = [[p["batch"], p["name"], p["formula_tokens_per_iteration"], p["embedded_pair_block_efficiency"],
             p["iteration_cost_vs_ar_step"], p["forward_cost_vs_ar_step"], p["predicted_speedup_formula"],
             p["predicted_speedup_embedded_pair"], p["measured_speedup_random_pair"]]
            for p in section.get("rows", []) if "skipped" not in p]
    return _table(["B", "run", "tokens/iter (formula)", "tokens/iter (pair, measured)", "iter cost / AR step",
                   "forwards / AR forward", "PREDICTED speedup (formula)", "PREDICTED speedup (pair BE)",
                   "measured speedup (random pair)"], rows)


NOTES = [
    "MEASURED: every tokens/s, ratio, block efficiency, time breakdown, sync count and memory figure of the "
    "speed table, on the random-initialised pair. Its draft is the target's own first layers, so its acceptance "
    "is high and says nothing about a trained pair; the ratios compare runs of this one process.",
    "PREDICTED: the speedups of the prediction table = tokens per iteration of the embedded trained pair "
    "((1 - a^(L+1)) / (1 - a) at its acceptance a, exact for K = 1 and a lower estimate for K > 1; and its "
    "block efficiency at that K, L where the pair section measured it) / the cost of one iteration relative "
    "to one autoregressive step, measured here on the random pair (wall time per iteration, prefill "
    "differenced out; the ratio of forward times alone is shown beside it).",
    "vs HF: ours speculative against HF assisted generation (batch 1, same L, constant schedule); every other "
    "ours row against HF generate (sampling, dynamic cache) at the same batch. vs HF static+compile: against HF "
    "generate with cache_implementation='static', which HF compiles itself on CUDA (torch.compile, "
    "reduce-overhead); on CPU it runs uncompiled.",
    "The headline group of each batch (our autoregressive and SpecTr, eager and compiled where spectr.generate "
    "takes compile=, HF plain and static) is timed interleaved: each run once per round, the median of the "
    "rounds. Compiled runs first make one untimed call of the same length; its time is the warm-up column "
    "(compile time + one run).",
    "Syncs per iteration are differenced between a run of `sync_new_tokens` and a one-token run (both "
    "instrumented, untimed), so setup and prefill drop out; CUDA syncs are the warnings of "
    "torch.cuda.set_sync_debug_mode('warn'); host syncs are spectr.diagnostics.HostSyncCounter's count.",
]


def markdown(results: dict) -> str:
    env = results.get("environment", {})
    lines = ["# GPU check", "", f"- date: {env.get('date')}", f"- command: `{env.get('command')}`",
             f"- device: {env.get('device_name')} ({env.get('device')}); torch {env.get('torch')}, transformers "
             f"{env.get('transformers')}, CUDA {env.get('cuda')}, Python {env.get('python')}",
             f"- plan: {env.get('plan')}, budget {env.get('budget_s')} s, git {env.get('git_commit')}", "",
             "## Summary", ""]
    lines += _table(["section", "status", "seconds"], [[s, results.get(s, {}).get("status", "not run"),
                                                       results.get(s, {}).get("seconds")] for s in SECTIONS])
    for name in SECTIONS:
        if results.get(name, {}).get("error"):
            lines += ["", f"**{name} failed**: `{results[name]['error']}`"]
    lines += ["", "## 1. Exactness (chi-square of the first tokens vs the enumerated target law)", ""]
    lines += markdown_exactness(results.get("exactness", {}))
    greedy = results.get("greedy", {}).get("cases", [])
    lines += ["", "## 2. Greedy equals HF greedy (float32)", ""]
    lines += _table(["arch", "method", "equal", "first mismatch"],
                    [[c["arch"], c["method"], c["equal"], c.get("first_mismatch", c.get("error"))] for c in greedy])
    pair = results.get("pair_acceptance", {})
    lines += ["", "## 3. Embedded pair acceptance (input to the predictions)", "",
              f"alpha = {_fmt(pair.get('alpha'), 3)}; source: {pair.get('source', pair.get('reason'))}; "
              f"block efficiency by (K, L): {pair.get('block_efficiency')}"]
    speed = results.get("speed", {})
    lines += ["", "## 4. Speed: MEASURED on the random pair, bf16, ratios within this run", "",
              str(speed.get("models", {}).get("description", "")), ""]
    lines += markdown_speed(speed)
    lines += ["", "## 5. PREDICTED speedup at the embedded pair's acceptance (not measured)", "",
              f"alpha = {_fmt(results.get('predictions', {}).get('alpha'), 3)}: tokens per iteration at the embedded "
              "pair's acceptance divided by the measured cost of one iteration relative to one autoregressive "
              "step of the same batch (prefill removed).", ""]
    lines += markdown_predictions(results.get("predictions", {}))
    lines += ["", "## 6. device_map: the target split over two GPUs vs on one (MEASURED where two GPUs are visible)",
              ""] + markdown_device_map(results.get("device_map", {}))
    lines += ["", "## Notes", ""] + [f"- {note}" for note in NOTES]
    return "\n".join(lines) + "\n"


def write_results(out: Path, results: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    (out / "results.md").write_text(markdown(results))


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------

SECTION_FUNCTIONS = {"exactness": section_exactness, "greedy": section_greedy,
                     "pair_acceptance": section_pair_acceptance, "speed": section_speed,
                     "device_map": section_device_map}


class SectionTimeout(BaseException):
    """Raised inside a unit that runs far past its section's share (the units are not otherwise bounded).

    A BaseException, so that the sections' per-unit `except Exception` (which records a failing unit and goes
    on) does not swallow it: it ends the section, which keeps what it saved (`cut_section`)."""


@contextlib.contextmanager
def hard_deadline(seconds: float):
    """Interrupt the block with SectionTimeout after `seconds` (SIGALRM; a no-op where that is unavailable)."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise SectionTimeout(f"still running {seconds:.1f} s after its section began (its share of the budget "
                             "and the grace period are spent)")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def cut_section(name: str, partial: dict | None, error: BaseException) -> dict:
    """The record of a section that raised: what it saved so far (`Context.save_partial`) is kept.

    A section cut for time (SectionTimeout) with saved results keeps them: status 'partial' for the
    speed and pair sections (MEASUREMENTS), 'failed' for a check (unfinished checks do not pass).
    Any other error, or a cut before anything was saved, is status 'error'.
    """
    record = dict(partial or {}, error=_describe(error), traceback=traceback.format_exc())
    record.pop("status", None)
    kept = bool(partial) and isinstance(error, SectionTimeout)
    record["cut_for_time"] = isinstance(error, SectionTimeout)
    record["status"] = ("partial" if name in MEASUREMENTS else "failed") if kept else "error"
    return record


def run_section(name: str, ctx: Context) -> None:
    ctx.budget.enter(name)
    log(f"== {name} (t = {ctx.budget.elapsed():.0f} s) ==")
    start = time.perf_counter()
    ctx.results.pop(name, None)
    try:
        with hard_deadline(ctx.budget.section_end[name] - start + ctx.grace_s):
            section = SECTION_FUNCTIONS[name](ctx)
    except (Exception, SectionTimeout) as error:  # recorded with what the section had saved; the others still run
        section = cut_section(name, ctx.results.get(name), error)
        log(f"{name} {'cut' if section['cut_for_time'] else 'failed'}: {section['error']}")
    section["seconds"] = time.perf_counter() - start
    ctx.results[name] = section
    release_memory(ctx.device)
    write_results(ctx.out, ctx.results)  # after every section, so a killed run still leaves its results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="folder for results.json and results.md")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, same code paths, seconds")
    parser.add_argument("--device", default=None, help="default: cuda when available (cpu with --smoke)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"total time budget in seconds (default {FULL.budget_s:.0f}; {SMOKE.budget_s:.0f} with "
                        "--smoke); sections past their share are skipped and recorded as such")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--grace-s", type=float, default=30.0,
                        help="a unit still running this long past its section's share is interrupted; the section "
                        "keeps what it had measured (default 30)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    args.plan = SMOKE if args.smoke else FULL
    if args.budget_s is None:
        args.budget_s = args.plan.budget_s
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {SECTIONS}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    device = torch.device(args.device)
    ctx = Context(plan=args.plan, device=device, budget=Budget(args.budget_s, args.sections), out=args.out,
                  grace_s=args.grace_s)
    ctx.results["environment"] = environment(args, device)
    ctx.results["plan"] = asdict(args.plan)
    ctx.results["notes"] = NOTES
    log(f"{ctx.results['environment']['device_name']}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, methods {spectr.known_methods()}")
    for name in args.sections:
        run_section(name, ctx)
    ctx.results["predictions"] = predict(ctx.results.get("speed", {}), ctx.results.get("pair_acceptance", {}))
    ctx.results["wall_s"] = ctx.budget.elapsed()
    checks = [ctx.results[s]["status"] for s in ("exactness", "greedy") if s in ctx.results]
    failed = [s for s in args.sections if ctx.results[s]["status"] in ("error", "failed")]
    ctx.results["passed"] = all(c == "passed" for c in checks) and not failed
    write_results(args.out, ctx.results)
    print(markdown(ctx.results), flush=True)
    log(f"done in {ctx.results['wall_s']:.0f} s; results in {args.out}; "
        f"{'all checks passed' if ctx.results['passed'] else 'FAILED: ' + ', '.join(failed)}")
    return 0 if ctx.results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
