"""GPU speed: how fast `spectr.generate` is on an accelerator, against Hugging Face's fastest path, in one run.

Everything is measured in bf16 on a random-initialised ~1.1B Llama target whose draft is its own first 2
layers (so acceptance is high and unlike a trained pair's; the ratios compare runs of this one process).
The units, in priority order (each timed interleaved: every run once per round, the median of the rounds;
a compiled run first makes one untimed call of the same length, its `warmup_s`):

1. headline: our compiled autoregressive against HF `generate` with a static cache, which HF compiles itself
   on CUDA (torch.compile, its fastest documented path), at batch 1, 16 and 64;
2. headline: the exact methods against autoregressive at batch 1, all compiled (SpecTr K=2 L=4, block and
   speculative L=4); the summary names the best exact method at batch 1 and its ratio to our fastest
   autoregressive run;
3. at each batch: our autoregressive and SpecTr eager and HF `generate` (dynamic cache), and SpecTr compiled
   at batch > 1 (at batch 1 it is in 2);
4. ours speculative against HF assisted generation (batch 1, same L);
5. SpecTr K in {2, 4} x L in {2, 4, 6} eager at each batch, traversal K=2 L=4, and `auto`;
6. the compiled core's attention, masked against FlexAttention (`spectr.native.ATTENTION`), at each batch.

Each row has tokens/s, block efficiency, acceptance, peak GPU memory, the per-iteration draft / target /
selection / other time and, for eager runs, syncs per iteration (host reads counted by
`spectr.diagnostics.HostSyncCounter`, CUDA syncs by `torch.cuda.set_sync_debug_mode("warn")`), differenced
between a long and a one-token run so that prefill drops out. Compiled rows get no extra runs: their
per-iteration times include the prefill, and no TorchFunctionMode is wrapped around compiled code.
For the run the selection compiles from the first iteration (`SELECTION_COMPILE_AFTER = 0`), as in a long
job's steady state (these runs are shorter than the engine's 64 eager iterations).

Compile once, time warm: every compiled run makes one untimed call of the timed length first (its `warmup_s`,
and `compile_s`: the seconds of that call spent compiling, apart), so that its graphs are compiled and recorded
before any timing starts; every compiled run of the script reads one static KV pool per model, reserved at the
start for the plan's largest configuration (`reserve_pools`), so no group interleaves runs that need different
pools and no graph is re-recorded for a new pool address.

The time budget (`--budget-s`, counted from the script's start) is checked between units, never inside one:
a unit starts only while time is left, and at least as much as the last unit of its kind took (the first
of a kind: its GPU estimate, `SPEED_ESTIMATES_S`); otherwise it is recorded as "skipped". Writes `speed.json`
and `speed.md` to `--out` after every unit. Exit status 0 unless the script itself crashed (a unit that
raises is recorded as an error row; speed is measured, not checked: `scripts/gpu_exactness.py` is the
check). `--smoke` runs the same units on the CPU with a tiny Llama, the compiled ones with dynamo's "eager"
backend, on the simulated GPU budget clock (as gpu_exactness.py's).

Imports only torch, transformers, `spectr`, the standard library and its companion `gpu_exactness.py`
(the unit runner), and builds its models in-script.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # the budget counts from here: the imports below are part of the window

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import itertools  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_exactness.py, also when loaded from elsewhere

import gpu_exactness as shared  # noqa: E402  (puts the repository on sys.path, sets HF_HUB_OFFLINE)
import torch  # noqa: E402
import transformers  # noqa: E402
from gpu_exactness import Unit, UnitRunner, fmt, log, table  # noqa: E402

import spectr  # noqa: E402
from spectr.diagnostics import HostSyncCounter  # noqa: E402

AUTOREGRESSIVE = "autoregressive"
PREFIX = "gpu_speed"


# ---------------------------------------------------------------------------------------
# plans: the device run and the CPU smoke run differ in sizes only
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    name: str
    speed_shape: dict  # the random Llama target
    draft_layers: int  # the draft = the target's first layers + its embedding and head
    speed_batches: tuple[int, ...]
    prompt_lengths: tuple[int, int]  # uniform in [lo, hi]
    speed_new_tokens: int
    sync_new_tokens: int  # length of the instrumented runs that count syncs
    grid_drafts: tuple[int, ...]
    grid_lengths: tuple[int, ...]
    headline_spectr: tuple[int, int]  # (K, L) of SpecTr in the headline and per-batch units
    headline_length: int  # L of speculative and block in the headline, and of ours vs HF assisted
    repeats: int  # interleaved rounds (median) of a unit


LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)
TINY_LLAMA = dict(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

FULL = Plan(name="full", speed_shape=LLAMA_1B, draft_layers=2, speed_batches=(1, 16, 64), prompt_lengths=(128, 512),
            speed_new_tokens=64, sync_new_tokens=12, grid_drafts=(2, 4), grid_lengths=(2, 4, 6),
            headline_spectr=(2, 4), headline_length=4, repeats=3)
SMOKE = Plan(name="smoke", speed_shape=TINY_LLAMA, draft_layers=1, speed_batches=(1, 2), prompt_lengths=(8, 24),
             speed_new_tokens=10, sync_new_tokens=6, grid_drafts=(2,), grid_lengths=(2, 4),
             headline_spectr=(2, 2), headline_length=2, repeats=1)
BUDGET_S = 210.0  # with gpu_exactness.py's 230 s and 40 s of overrun: 8 minutes of an H100 (docs/testing.md)
SMOKE_BUDGET_S = BUDGET_S  # on the simulated GPU clock (--clock gpu-estimate, the default with --smoke)
# Expected GPU seconds per unit kind from a cold process (UNMEASURED: no GPU has run this yet). Basis: a compiled
# run's warm-up compiles the ~1.1B target's and its draft's core graphs (a handful per model, each an assumed 5 to
# 10 s of inductor + Triton on an H100) and records their CUDA graphs; a timed run of 64 new tokens is about a
# second. Replace them with the `seconds` and the rows' `compile_s` of the first GPU run.
SPEED_ESTIMATES_S = {"startup": 20.0, "headline vs HF": 40.0, "headline exact": 60.0, "per batch": 20.0,
                     "per batch, compiling": 30.0, "assisted": 15.0, "grid": 10.0, "auto": 20.0, "attention": 40.0}


# ---------------------------------------------------------------------------------------
# models and runs
# ---------------------------------------------------------------------------------------


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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class SpeedRun:
    """One measured configuration. kind: 'ours' | 'hf' | 'hf_static' | 'hf_assisted'.

    compiled: ours with `spectr.generate(compile=True)`; 'hf_static' is HF `generate` with a static cache,
    which HF compiles itself on CUDA (`torch.compile`, its fastest documented path; on the CPU it runs the
    static cache uncompiled). attention: compiled runs with `spectr.native.ATTENTION` set ("masked" /
    "flex", in the name); "": as is.
    """

    kind: str
    batch: int
    method: str = AUTOREGRESSIVE
    num_drafts: int = 1
    draft_length: int = 1
    compiled: bool = False
    attention: str = ""

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
        if self.method in ("speculative", "block"):
            return f"ours {self.method} L={self.draft_length}{mode}"
        return f"ours {self.method} K={self.num_drafts} L={self.draft_length}{mode}"


def speed_prompts(batch: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (batch,), generator=generator).tolist()
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in sizes]


def left_padded(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)  # [B, W]
    mask = torch.zeros(len(prompts), width, dtype=torch.int64)  # [B, W]
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
    before = native.ATTENTION
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
                              seed=list(range(len(prompts))), compile=run.compiled)
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


def decode_costs(long: dict, short: dict | None) -> dict:
    """Per-iteration costs; with a one-token run `short`, prefill removed: (long - short) / (their iteration gap)."""
    gap = long["iterations"] - (short["iterations"] if short else 0)
    if short is None or gap <= 0:  # cannot difference: the long run's plain averages (prefill included)
        short, gap = None, long["iterations"]

    def per_iteration(getter) -> float:
        value = getter(long) - (getter(short) if short else 0.0)
        return 1000.0 * max(value, 0.0) / gap

    breakdown = {f.removesuffix("_seconds"): per_iteration(lambda r, f=f: getattr(r["stats"], f)) for f in PHASE_FIELDS}
    return dict(iteration_ms=per_iteration(lambda r: r["wall_s"]), per_iteration_ms=breakdown,
                prefill_removed=short is not None)


def ours_row(pair, prompts, run: SpeedRun, plan: Plan, device: torch.device, long_runs: list[dict]) -> dict:
    """The row of one of our configurations from its timed calls; an eager one also gets its untimed one-token
    and sync-counting runs (not a compiled one: other lengths may compile other graphs, and a TorchFunctionMode
    around compiled code retraces it)."""
    long = sorted(long_runs, key=lambda r: r["wall_s"])[len(long_runs) // 2]  # the median run
    stats = long["stats"]
    row = dict(name=run.name, kind=run.kind, batch=run.batch, method=stats.method, compiled=run.compiled,
               attention=run.attention, num_drafts=stats.num_drafts, draft_length=stats.draft_length,
               new_tokens=plan.speed_new_tokens, tokens_per_s=statistics.median(r["tokens_per_s"] for r in long_runs),
               wall_s=long["wall_s"], generated_tokens=long["tokens"], iterations=long["iterations"],
               block_efficiency=stats.block_efficiency, acceptance_rate=stats.acceptance_rate,
               peak_memory_mib=long["peak_memory_mib"], repeats=len(long_runs),
               ran_compiled=getattr(stats, "compiled", None), compile_fallbacks=getattr(stats, "compile_fallbacks", None))
    if run.compiled:
        row.update(decode_costs(long, None))
    else:
        row.update(decode_costs(long, run_ours(pair, prompts, run, 1, device)))
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
        except Exception as error:  # recorded in its row
            errors[run] = shared.describe(error)
            release_memory(device)
            return None

    for run in group:
        if run.compiled or run.kind == "hf_static":
            warm = attempt(run)
            if warm is not None:
                warmup[run] = (warm["wall_s"], getattr(warm.get("stats"), "compile_seconds", None))
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
                       error=errors.get(run) or shared.describe(error))
        row["warmup_s"], row["compile_s"] = warmup.get(run, (None, None))  # the compile time apart from the run's
        rows.append(row)
    return rows


def warm_up(pair, prompts, device: torch.device) -> None:
    """Tune the eager kernels for this batch shape once (short runs, not recorded; compiled runs warm themselves)."""
    for run in (SpeedRun("ours", len(prompts)), SpeedRun("ours", len(prompts), "spectr", 2, 2),
                SpeedRun("hf", len(prompts))):
        run_once(pair, prompts, run, 4, device)


# ---------------------------------------------------------------------------------------
# the units
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeedUnit:
    name: str
    kind: str  # units of a kind cost alike (the budget's estimate)
    group: tuple[SpeedRun, ...]  # timed interleaved
    repeats: int


def versus_hf_unit(batch: int) -> str:
    return f"headline B={batch}: ours compiled autoregressive vs HF static cache + compile"


def speed_units(plan: Plan, with_auto: bool = True, methods: tuple[str, ...] = ()) -> list[SpeedUnit]:
    """The units in priority order (see the module docstring); `methods`: the engine's (traversal where it
    has it)."""
    k, length = plan.headline_spectr
    single = plan.headline_length
    units = [SpeedUnit(versus_hf_unit(b), "headline vs HF",
                       (SpeedRun("ours", b, compiled=True), SpeedRun("hf_static", b)), plan.repeats)
             for b in plan.speed_batches]
    units.append(SpeedUnit("headline B=1: exact methods vs autoregressive, compiled", "headline exact",
                           (SpeedRun("ours", 1, compiled=True), SpeedRun("ours", 1, "spectr", k, length, True),
                            SpeedRun("ours", 1, "block", 1, single, True),
                            SpeedRun("ours", 1, "speculative", 1, single, True)), plan.repeats))
    for b in plan.speed_batches:
        group = (SpeedRun("ours", b), SpeedRun("ours", b, "spectr", k, length), SpeedRun("hf", b))
        if b != 1:  # at batch 1 it is in the headline
            group += (SpeedRun("ours", b, "spectr", k, length, True),)
        units.append(SpeedUnit(f"B={b}: eager, HF generate" + (", SpecTr compiled" if b != 1 else ""),
                               "per batch, compiling" if b != 1 else "per batch", group, plan.repeats))
    units.append(SpeedUnit("B=1: ours speculative vs HF assisted", "assisted",
                           (SpeedRun("ours", 1, "speculative", 1, single),
                            SpeedRun("hf_assisted", 1, draft_length=single)), plan.repeats))
    for b in sorted(plan.speed_batches, key=lambda b: (b == 1, b)):  # batch 1 last: the slowest per token
        for drafts, draft_length in itertools.product(plan.grid_drafts, plan.grid_lengths):
            if (drafts, draft_length) != plan.headline_spectr:
                units.append(SpeedUnit(f"B={b}: SpecTr K={drafts} L={draft_length} eager", "grid",
                                       (SpeedRun("ours", b, "spectr", drafts, draft_length),), 1))
        if "traversal" in methods:
            units.append(SpeedUnit(f"B={b}: traversal K={k} L={length} eager", "grid",
                                   (SpeedRun("ours", b, "traversal", k, length),), 1))
        if with_auto:
            units.append(SpeedUnit(f"B={b}: auto", "auto", (SpeedRun("ours", b, "auto", max(plan.grid_drafts),
                                                                      max(plan.grid_lengths)),), 1))
    for b in plan.speed_batches:  # last (as time allows): the compiled core's attention
        units.append(SpeedUnit(f"B={b}: compiled SpecTr attention, masked vs flex", "attention",
                               (SpeedRun("ours", b, "spectr", k, length, True, "masked"),
                                SpeedRun("ours", b, "spectr", k, length, True, "flex")), plan.repeats))
    return units


@dataclass
class SpeedState:
    """What the units share: the pair, the plan, the batch sizes whose eager kernels are warm."""

    pair: tuple
    plan: Plan
    device: torch.device
    warmed: set = field(default_factory=set)


def measure_unit(state: SpeedState, unit: SpeedUnit) -> dict:
    batch = unit.group[0].batch
    prompts = speed_prompts(batch, state.plan.prompt_lengths, state.plan.speed_shape["vocab_size"], seed=batch)
    eager = any(not run.compiled and run.kind != "hf_static" for run in unit.group)
    if eager and batch not in state.warmed:
        warm_up(state.pair, prompts, state.device)
        state.warmed.add(batch)
    rows = [dict(row, unit=unit.name) for row in
            measure_group(state.pair, prompts, unit.group, state.plan, state.device, unit.repeats)]
    for row in rows:
        log(PREFIX, f"  B={batch} {row['name']}: " + (f"{row['tokens_per_s']:.1f} tokens/s" if "error" not in row
                                                     else row["error"]))
    ok = [r for r in rows if "error" not in r]
    status = "measured" if len(ok) == len(rows) else ("partial" if ok else "error")
    release_memory(state.device)
    return dict(status=status, batch=batch, rows=rows)


def build_pair(plan: Plan, device: torch.device) -> tuple[tuple, dict]:
    shape = plan.speed_shape
    target = random_llama(shape, seed=0, device=device, dtype=torch.bfloat16)
    draft = draft_from_target(target, shape, plan.draft_layers)
    weights = torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else None
    models = dict(dtype="bfloat16", target_shape=shape, target_parameters=parameter_count(target),
                  draft_layers=plan.draft_layers, draft_parameters=parameter_count(draft), weights_mib=weights,
                  description=f"random-initialised Llama target ({parameter_count(target) / 1e6:,.1f}M params, "
                  f"HF init std 0.02); draft ({parameter_count(draft) / 1e6:,.1f}M params) = the target's first "
                  f"{plan.draft_layers} layer(s) with its embedding, final norm and head, so acceptance is "
                  "high and unlike a trained pair's")
    reserve_pools(plan, target, draft)
    return (target, draft), models


def reserve_pools(plan: Plan, target, draft) -> None:
    """One static KV pool per model for the whole run, sized for the plan's largest configuration (batch, longest
    prompt + new tokens, widest tree): every compiled run of every unit reads the same pool, so no group
    interleaves runs that need different pools and no CUDA graph is re-recorded for a new pool address."""
    import spectr.native as native

    widest = max(max(plan.grid_drafts) * max(plan.grid_lengths), plan.headline_spectr[0] * plan.headline_spectr[1])
    capacity = plan.prompt_lengths[1] + plan.speed_new_tokens + 2 + widest
    for model in (target, draft):
        native.reserve_pool(model, rows=max(plan.speed_batches), capacity=capacity)


# ---------------------------------------------------------------------------------------
# ratios, the headline, the markdown
# ---------------------------------------------------------------------------------------


def measured_rows(units: list[dict]) -> list[dict]:
    return [row for unit in units for row in unit.get("rows", []) if "error" not in row]


def add_ratios(rows: list[dict]) -> None:
    """Measured ratios within the run, at the same batch: every ours row vs our eager and compiled
    autoregressive (a compiled row also vs its own eager run); ours vs HF generate (speculative: vs HF assisted)
    and vs HF generate with a static cache + compile. The other row is taken from the same unit (timed
    interleaved) where it has one, else the last measured at that batch."""
    by_name = {(r["batch"], r["name"]): r for r in rows if "error" not in r}
    in_unit = {(r.get("unit"), r["batch"], r["name"]): r for r in rows if "error" not in r}

    def other(row: dict, name: str) -> dict | None:
        return in_unit.get((row.get("unit"), row["batch"], name)) or by_name.get((row["batch"], name))

    def ratio(row: dict, name: str) -> float | None:
        found = other(row, name)
        return row["tokens_per_s"] / found["tokens_per_s"] if found else None

    for row in (r for r in rows if "error" not in r and r["kind"] == "ours"):
        row["speedup_vs_our_autoregressive"] = ratio(row, SpeedRun("ours", 1).name)
        row["speedup_vs_our_compiled_autoregressive"] = ratio(row, SpeedRun("ours", 1, compiled=True).name)
        if row.get("compiled"):
            attention_kind = row.get("attention") or ""
            base = row["name"].removesuffix(f" {attention_kind}") if attention_kind else row["name"]  # "... compiled"
            row["compiled_vs_eager"] = ratio(row, base.removesuffix(" compiled"))
            if attention_kind == "flex":
                row["flex_vs_masked"] = ratio(row, f"{base} masked")
        hf = SpeedRun("hf_assisted", 1, draft_length=row["draft_length"]) if row["method"] == "speculative" \
            else SpeedRun("hf", 1)
        if ratio(row, hf.name) is not None:
            row["vs_hf"] = dict(hf_run=hf.name, hf_tokens_per_s=other(row, hf.name)["tokens_per_s"],
                                ratio=ratio(row, hf.name))
        row["vs_hf_static_compiled"] = ratio(row, SpeedRun("hf_static", 1).name)


def headline(rows: list[dict], batches: list[int]) -> dict:
    """The two headline figures from the rows measured so far (None where a row is missing): our compiled
    autoregressive / HF static cache + compile, each batch, from its headline unit; the fastest exact method at
    batch 1 (any unit) / our fastest autoregressive run at batch 1."""
    by_name = {(r.get("unit"), r["name"]): r for r in rows}
    ours_name, hf_name = SpeedRun("ours", 1, compiled=True).name, SpeedRun("hf_static", 1).name
    versus_hf = []
    for batch in batches:
        unit = versus_hf_unit(batch)
        ours, hf = by_name.get((unit, ours_name)), by_name.get((unit, hf_name))
        versus_hf.append(dict(batch=batch, ours_tokens_per_s=ours and ours["tokens_per_s"],
                              hf_tokens_per_s=hf and hf["tokens_per_s"],
                              ratio=ours["tokens_per_s"] / hf["tokens_per_s"] if ours and hf else None))
    at_one = [r for r in rows if r["batch"] == 1 and r["kind"] == "ours"]
    exact = [r for r in at_one if r["method"] != AUTOREGRESSIVE]
    plain = [r for r in at_one if r["method"] == AUTOREGRESSIVE]
    best = max(exact, key=lambda r: r["tokens_per_s"], default=None)
    base = max(plain, key=lambda r: r["tokens_per_s"], default=None)
    best_exact = dict(best=best and best["name"], best_tokens_per_s=best and best["tokens_per_s"],
                      block_efficiency=best and best.get("block_efficiency"),
                      autoregressive=base and base["name"], autoregressive_tokens_per_s=base and base["tokens_per_s"],
                      ratio=best["tokens_per_s"] / base["tokens_per_s"] if best and base else None)
    return dict(compiled_autoregressive_vs_hf_static_compiled=versus_hf, best_exact_vs_autoregressive_b1=best_exact)


def summarizer(batches: list[int]):
    def summarize(units: list[dict]) -> dict:
        """Counts, the headline; and every measured row's ratios brought up to date (in place)."""
        rows = measured_rows(units)
        add_ratios(rows)
        counts = {status: sum(u["status"] == status for u in units)
                  for status in ("measured", "partial", "error", "skipped")}
        return dict(counts=counts, headline=headline(rows, batches))

    return summarize


def markdown_rows(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        if "error" in r:
            lines.append([r["batch"], r["name"], "error: " + r["error"][:80]] + [None] * 14)
            continue
        breakdown = r.get("per_iteration_ms")
        split = "/".join(f"{breakdown[p]:.1f}" for p in ("draft", "target", "selection", "other")) if breakdown else None
        lines.append([r["batch"], r["name"], r["tokens_per_s"], r.get("vs_hf", {}).get("ratio"),
                      r.get("vs_hf_static_compiled"), r.get("speedup_vs_our_autoregressive"),
                      r.get("speedup_vs_our_compiled_autoregressive"), r.get("compiled_vs_eager"),
                      r.get("block_efficiency"), r.get("iteration_ms"), split, r.get("host_syncs_per_iteration"),
                      r.get("cuda_syncs_per_iteration"), r.get("peak_memory_mib"), r.get("warmup_s"), r.get("compile_s"),
                      r.get("compile_fallbacks")])
    flex = [f"- B={r['batch']} {r['name']}: flex / masked attention {r['flex_vs_masked']:.2f}x"
            for r in rows if r.get("flex_vs_masked") is not None]
    return table(["B", "run", "tokens/s", "vs HF", "vs HF static+compile", "vs our AR", "vs our compiled AR",
                  "compiled vs eager", "block eff.", "iter ms", "draft/target/select/other ms", "host syncs/iter",
                  "CUDA syncs/iter", "peak MiB", "warm-up s", "compile s", "compile fallbacks"], lines) + ([""] + flex if flex else [])


def markdown(results: dict) -> str:
    summary = results.get("summary", {})
    top = summary.get("headline", {})
    counts = summary.get("counts", {})
    lines = ["# GPU speed", ""] + shared.environment_lines(results.get("environment", {})) + [
        f"- elapsed: {fmt(results.get('elapsed_s'), 1)} s; units: {counts.get('measured', 0)} measured, "
        f"{counts.get('partial', 0)} partial, {counts.get('error', 0)} errors, {counts.get('skipped', 0)} skipped "
        "for time", f"- models: {results.get('models', {}).get('description')}", "", "## Headline", ""]
    lines += table(["B", "ours compiled AR tokens/s", "HF static + compile tokens/s", "ours / HF"],
                   [[v["batch"], v["ours_tokens_per_s"], v["hf_tokens_per_s"], v["ratio"]]
                    for v in top.get("compiled_autoregressive_vs_hf_static_compiled", [])])
    best = top.get("best_exact_vs_autoregressive_b1", {})
    lines += ["", f"Best exact method at B=1: {best.get('best') or '-'} ({fmt(best.get('best_tokens_per_s'))} tokens/s, "
              f"block efficiency {fmt(best.get('block_efficiency'))}) = **{fmt(best.get('ratio'))}x** "
              f"{best.get('autoregressive') or 'our autoregressive'} ({fmt(best.get('autoregressive_tokens_per_s'))} "
              "tokens/s).", "", "## Every row (MEASURED on the random pair, bf16)", ""]
    lines += markdown_rows([row for unit in results.get("units", []) for row in unit.get("rows", [])])
    notes = [f"- {u['name']}: {u.get('reason') or u.get('error')}" for u in results.get("units", [])
             if u["status"] in ("skipped", "error")]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------


def auto_available() -> bool:
    """`method="auto"` (the planner) is served by `spectr.generate` when spectr.planner is there."""
    try:
        from spectr.planner.auto import AUTO  # noqa: F401
    except ImportError:
        return False
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shared.common_arguments(parser, budget_s=BUDGET_S, smoke_budget_s=SMOKE_BUDGET_S)
    args = shared.resolve_common(parser.parse_args(argv), budget_s=BUDGET_S, smoke_budget_s=SMOKE_BUDGET_S)
    args.plan = SMOKE if args.smoke else FULL
    return args


def main(argv: list[str] | None = None, *, started: float | None = None) -> int:
    """Run the units; 0 unless something outside a unit raised (the exception then ends the script).
    `started`: where the budget's clock starts (default: the script's import, so that the imports count)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    results = dict(environment=shared.environment("gpu_speed", device, args.budget_s, args.plan.name,
                                                  args.compile_backend),
                   plan=asdict(args.plan), sampling="temperature 1, top_k 0, top_p 1, no EOS", units=[])
    runner = UnitRunner(out=args.out, stem="speed", budget_s=args.budget_s, results=results,
                        summarize=summarizer(list(args.plan.speed_batches)), render=markdown, prefix=PREFIX,
                        started=STARTED if started is None else started, simulate=args.clock == "gpu-estimate",
                        startup_s=SPEED_ESTIMATES_S["startup"])
    units = shared.select_units(speed_units(args.plan, auto_available(), tuple(spectr.known_methods())), args.only)
    pair, results["models"] = build_pair(args.plan, device) if units else ((None, None), {})
    log(PREFIX, f"{results['environment']['device_name']}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, budget {args.budget_s:.0f} s; {results['models'].get('description')}")
    state = SpeedState(pair=pair, plan=args.plan, device=device)
    with shared.compiled_engine(args.compile_backend):
        runner.run_all([Unit(u.name, u.kind, functools.partial(measure_unit, state, u), SPEED_ESTIMATES_S[u.kind])
                        for u in units])
    runner.write()
    print(markdown(results), flush=True)
    log(PREFIX, f"done in {runner.elapsed():.0f} s; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
