"""Cost model: predict tokens/s of each (method, K, L, B) from measured per-call latencies and acceptance.

1) Latencies (`measure_latencies`), each the mean of >= `repeats` timed calls after one untimed call,
   through the engine's own pieces (`spectr.hf.HFCausalLM.forward` on a `RowKVCache` holding a cached
   context, with the engine's mask construction):
   - target forward over T new tokens per row, T = 1 (autoregressive) and T = 1 + K*L (a draft tree);
   - draft forward over T = 1 or 2 tokens per row (draft step 0: the pending tokens) and T = K (the K
     branches at draft steps 1..L-1);
   - the draft's sampling after each draft forward (warp + inverse-CDF sample of K tokens per row);
   - the selection phase (warps of the target logits [B, 1+K*L, V], the tree gather, and
     `spectr.sequence.select_sequences`) at its two extremes: every row rejects at the first position
     (disjoint p and q) and every row accepts all L positions (p = q); autoregressive: warp + sample;
   - the commit of an iteration (`RowKVCache.keep_path` of the accepted path in both caches and the
     iteration's one host sync) and the removal of finished rows (`RowKVCache.select_rows`, which
     copies every cache buffer, so its cost grows with the cache capacity);
   - the prompt prefill of each benchmark batch, for each model (`spectr.generate.prefill`);
   each at the batch sizes `latency_batch_sizes`, linearly interpolated in between (rows leave the
   batch as they finish, so the active batch shrinks). Forwards are measured at the cached context of
   each benchmark batch size and interpolated linearly in the context: a batch attends as many cache
   slots as its longest row (left-aligned rows, one mask), so the context of a batch of 16 prompts is
   set by its longest prompt, not the mean one.
2) Prediction (`predict_seconds`), for one measured run: the per-row target calls of that run say how
   many rows are active at each iteration i (a_i = #rows with at least i calls). An iteration costs
       draft(a, 1 or 2) + (L - 1) * draft(a, K) + L * sample(a, K)
       + target(a, 1 + K L) + selection(a, K, L, walk) + commit(a, L)
   where step 0 feeds 2 tokens when the previous iteration accepted all L drafts of some row
   (probability 1 - (1 - f)^a, f = the run's fraction of all-accepted calls) and the selection walk is
   interpolated between its extremes by the expected number of positions walked (the walk stops when
   no row of the batch accepts: P(reach j) = 1 - (1 - s_j)^a, s_j = the run's fraction of calls that
   accepted >= j tokens). Autoregressive: target(a, 1) + selection + commit. Every time rows finish,
   the remaining a' rows are copied out of each cache: select_rows(a'). Plus one prefill per batch and
   model. Predicted tokens/s = generated tokens / predicted seconds.
3) Calibration (`Calibrator`, `ScaledTable`): the machine may be shared, so its speed drifts between
   the grid and the latency table. Right after each timed run, the configuration's own forward shapes
   are timed again at its batch size and context; the table's forward latencies are scaled by local /
   table (pooled over the configuration's runs; the prefill like the model's widest forward), the
   other components are not.

What the model leaves out, and the relative error therefore includes: the engine's Python
bookkeeping per row, the growth of the context within a run beyond linear, and machine noise.
This module does not run the benchmark grid and does not report.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from spectr.generate import prefill
from spectr.hf import HFCausalLM
from spectr.kv_cache import tree_attention
from spectr.rng import make_generators, sample_categorical
from spectr.sequence import select_sequences
from spectr.warps import SamplingWarp

TARGET, DRAFT = "target", "draft"
REJECT_ALL, ACCEPT_ALL = "reject_all", "accept_all"
DRAFT_SAMPLE, DRAFT_SAMPLE_FIRST = "draft_sample", "draft_sample_first"
COMMIT = "commit"
SELECT_ROWS = "select_rows"  # + "_target" / "_draft"; its context is the cache capacity


@dataclass
class LatencyTable:
    """Seconds per call keyed by (component, batch size, shape, context).

    `at` interpolates linearly in the batch size at each measured context, then linearly in the
    context; components measured at one context (or none, `None`) do not depend on it, and
    `at(..., context=None)` takes the widest measured context. The "context" of the forwards is the
    cached tokens they attend; that of `select_rows_*` is the cache capacity in slots per row.
    """

    seconds: dict[tuple, float] = field(default_factory=dict)

    def add(self, component: str, batch: int, shape: tuple, seconds: float, context: int | None = None) -> None:
        self.seconds[(component, batch, tuple(shape), context)] = seconds

    def contexts(self, component: str) -> list[int]:
        return sorted({key[3] for key in self.seconds if key[0] == component and key[3] is not None})

    def at(self, component: str, batch: float, shape: tuple, context: float | None = None) -> float:
        """Latency at a (possibly unmeasured) batch size and context (see the class docstring)."""
        curves: dict[int | None, list[tuple[int, float]]] = {}
        for (name, b, s, ctx), value in self.seconds.items():
            if name == component and s == tuple(shape):
                curves.setdefault(ctx, []).append((b, value))
        if not curves:
            raise KeyError(f"no latency measured for {component} {shape}")
        values = [(ctx, interpolate(sorted(points), batch)) for ctx, points in curves.items()]
        if len(values) == 1:
            return max(values[0][1], 0.0)
        measured = sorted(v for v in values if v[0] is not None)
        if context is None:
            return max(measured[-1][1], 0.0)  # the widest measured context
        return max(interpolate(measured, context), 0.0)

    def grid(self, component: str, context: int | None = None) -> dict[tuple[int, tuple], float]:
        """{(batch, shape): seconds} of one component at one measured context (default: the widest)."""
        contexts = self.contexts(component)
        if context is None and contexts:
            context = contexts[-1]
        return {(k[1], k[2]): v for k, v in self.seconds.items() if k[0] == component and k[3] == context}

    def rows(self) -> list[dict]:
        return [
            {
                "component": key[0],
                "batch_size": key[1],
                "shape": "x".join(map(str, key[2])),
                "context": "" if key[3] is None else key[3],
                "milliseconds": 1000.0 * value,
            }
            for key, value in sorted(self.seconds.items(), key=lambda kv: tuple(map(str, kv[0])))
        ]


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through (x, y) points sorted by x; linear extrapolation from the end segments."""
    if len(points) == 1:
        return points[0][1] * x / points[0][0]  # one point: proportional
    if x <= points[0][0]:
        (x0, y0), (x1, y1) = points[0], points[1]
    elif x >= points[-1][0]:
        (x0, y0), (x1, y1) = points[-2], points[-1]
    else:
        (x0, y0), (x1, y1) = next((a, b) for a, b in zip(points, points[1:]) if a[0] <= x <= b[0])
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


MIN_TIMED_SECONDS = 0.15  # cheap calls are repeated until they add up to this much (noise on a shared machine)
MAX_REPEAT_FACTOR = 10


def mean_seconds(
    call: Callable[[], object], repeats: int, device: torch.device, before: Callable[[], object] | None = None
) -> float:
    """Mean wall time of `call` after one untimed call: at least `repeats` timed calls, more (up to
    10x) for cheap calls until MIN_TIMED_SECONDS have been timed. `before` runs untimed before each
    timed call (see `cache_evictor`).

    The mean, not the median: a generation run pays for every call, preempted ones included, so on a
    shared machine the expected cost per call is what predicts its wall time."""
    call()
    times: list[float] = []
    while len(times) < repeats or (sum(times) < MIN_TIMED_SECONDS and len(times) < MAX_REPEAT_FACTOR * repeats):
        if before is not None:
            before()
        _sync(device)
        start = time.perf_counter()
        call()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.fmean(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


EVICTION_BYTES = 64 * 2**20  # larger than the last-level cache of common server CPUs


_eviction_buffer: torch.Tensor | None = None


def cache_evictor(device: torch.device) -> Callable[[], object] | None:
    """`before` hook for the engine's cheap CPU steps: touch a buffer larger than the last-level cache.

    In the engine, the sampling, selection and commit steps each follow a model forward, whose weights
    (the target's alone are over 100 MB in float32) have evicted the CPU caches; timed back to back
    instead, the same steps find their code and data cached and run several times faster at B = 1.
    On CUDA: None (kernels do not depend on the host's caches).
    """
    global _eviction_buffer
    if device.type != "cpu":
        return None
    if _eviction_buffer is None:
        _eviction_buffer = torch.zeros(EVICTION_BYTES // 4, dtype=torch.float32)
    buffer = _eviction_buffer
    return lambda: buffer.add_(1.0)


# ---------------------------------------------------------------------------------------
# the shape of a benchmark batch
# ---------------------------------------------------------------------------------------


def batch_context(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> float:
    """Cached slots a forward of this batch attends, averaged over the run: the longest row's
    committed length (its prompt but the pending last token) plus half the new tokens."""
    return max(len(p) for p in prompts) - 1 + max_new_tokens / 2


def batch_capacity(prompts: Sequence[Sequence[int]], max_new_tokens: int, tree_width: int) -> int:
    """Cache slots per row the engine allocates for this batch (spectr.generate: prompt + new + tree)."""
    return max(len(p) for p in prompts) + max_new_tokens + tree_width


def tree_widths(method: str, num_drafts: int, draft_length: int) -> tuple[int, int]:
    """(target, draft) scratch slots per row beyond the committed tokens, as the engine sizes them."""
    if method == "autoregressive":
        return 1, 0
    return 1 + num_drafts * draft_length, 2 + num_drafts * draft_length


@dataclass(frozen=True)
class BatchRun:
    """One batch of one measured run, as the prediction needs it."""

    row_target_calls: Sequence[int]  # target calls of each row
    prefill_seconds: tuple[float, float]  # (target, draft) prefill latency of this batch (draft 0: none)
    context: float  # batch_context
    capacities: tuple[int, int]  # (target, draft) cache slots per row (batch_capacity)


# ---------------------------------------------------------------------------------------
# 1) measurements
# ---------------------------------------------------------------------------------------


class ForwardTimer:
    """Times forwards of T new tokens per row after a cached context of random tokens (one prefill).

    The same slots after the context are rewritten by every timed call, so one cache serves every
    T <= max_new_tokens.
    """

    def __init__(self, model: HFCausalLM, batch: int, context: int, max_new_tokens: int):
        self.model, self.batch, self.context = model, batch, context
        self.max_new_tokens = max_new_tokens
        device = model.device
        self.cache = model.new_cache(batch, context + max_new_tokens)
        self.generator = torch.Generator(device="cpu").manual_seed(0)
        if context > 0:
            with torch.inference_mode():
                ids = torch.randint(0, model.vocab_size, (batch, context), generator=self.generator).to(device)  # [B, C]
                positions = torch.arange(context, device=device).expand(batch, context)  # [B, C]
                causal = positions[0][:, None] >= positions[0][None, :]  # [C, C]
                allowed = tree_attention(self.cache.rows.lengths, causal, context)
                model.forward(ids, positions, allowed, self.cache, positions, last_only=True)
        self.cache.rows.lengths = torch.full((batch,), context, dtype=torch.int64, device=device)

    @torch.inference_mode()
    def seconds(self, new_tokens: int, repeats: int) -> float:
        """Mean seconds of one forward of `new_tokens` tokens per row (the engine's mask and slots)."""
        if new_tokens > self.max_new_tokens:
            raise ValueError(f"new_tokens {new_tokens} exceeds the timer's capacity {self.max_new_tokens}")
        device = self.model.device
        lengths = self.cache.rows.lengths  # [B]
        new = torch.randint(0, self.model.vocab_size, (self.batch, new_tokens), generator=self.generator).to(device)  # [B, T]
        slots = lengths[:, None] + torch.arange(new_tokens, device=device)  # [B, T]
        ancestors = torch.ones(new_tokens, new_tokens, dtype=torch.bool, device=device).tril()  # [T, T]

        def call():
            # the engine builds the mask every call
            allowed = tree_attention(lengths, ancestors, self.context + new_tokens)  # [B, T, C + T]
            return self.model.forward(new, slots, allowed, self.cache, slots)

        return mean_seconds(call, repeats, device)


@torch.inference_mode()
def prefill_latency(model: HFCausalLM, prompts: Sequence[Sequence[int]], repeats: int) -> float:
    """Mean seconds of the engine's prompt prefill of this batch."""
    device = model.device
    capacity = max(len(p) for p in prompts) + 1

    def call():
        prefill(model, model.new_cache(len(prompts), capacity), [list(p) for p in prompts], device)

    return mean_seconds(call, repeats, device)


@torch.inference_mode()
def draft_sampling_latency(
    batch: int, num_drafts: int, vocab_size: int, warp: SamplingWarp, first: bool, repeats: int,
    device: torch.device,
) -> float:
    """Mean seconds of the drafter's sampling after one draft forward (spectr.drafting.TreeDrafter):
    step 0 warps one distribution per row and draws K tokens from it; later steps warp K per row."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    shape = (batch, 1, vocab_size) if first else (batch, num_drafts, vocab_size)
    logits = torch.randn(shape, generator=generator).to(device)  # [B, 1 or K, V]
    uniforms = torch.rand(batch, num_drafts, generator=generator, dtype=torch.float64).to(device)  # [B, K]
    probs = torch.empty(batch, num_drafts, 2, vocab_size, dtype=torch.float32, device=device)  # [B, K, 2, V]
    last = torch.zeros(batch, 1, vocab_size, dtype=torch.int64, device=device)

    def call():
        if first:
            probs[:, :, 0] = warp.probs(logits.gather(1, last).squeeze(1))[:, None, :]
            return sample_categorical(probs[:, :, 0], uniforms)
        probs[:, :, 1] = warp.probs(logits)
        return sample_categorical(probs[:, :, 1], uniforms)

    return mean_seconds(call, repeats, device, cache_evictor(device))


@torch.inference_mode()
def commit_latency(
    target_timer: ForwardTimer, draft_timer: ForwardTimer | None, draft_length: int, repeats: int
) -> float:
    """Mean seconds of one iteration's commit (spectr.generate): the accepted path is gathered in the
    target cache (L slots) and the draft cache (L - 1), then one host sync of [B, L + 2] ints.
    Autoregressive (draft_length 0, no draft): the host sync of the sampled tokens only."""
    device = target_timer.model.device
    batch = target_timer.batch
    lengths = target_timer.cache.rows.lengths  # [B]
    depth = torch.arange(draft_length, device=device)  # [L]
    dest = lengths[:, None] + 1 + depth  # [B, L]
    source = dest.flip(1)  # any slots of the tree: the work is the same
    num_accepted = torch.full((batch,), draft_length, dtype=torch.int64, device=device)  # [B]
    tokens = torch.zeros(batch, draft_length + 1, dtype=torch.int64, device=device)  # [B, L+1]

    def call():
        if draft_length > 0:
            target_timer.cache.rows.keep_path(torch.where(depth < num_accepted[:, None], source, dest), dest)
        if draft_timer is not None and draft_length > 1:
            draft_timer.cache.rows.keep_path(source[:, : draft_length - 1], dest[:, : draft_length - 1])
        return torch.cat([num_accepted[:, None], tokens], 1).cpu().tolist()

    return mean_seconds(call, repeats, device, cache_evictor(device))


@torch.inference_mode()
def select_rows_latency(model: HFCausalLM, batch: int, capacity: int, repeats: int) -> float:
    """Mean seconds of `RowKVCache.select_rows` keeping `batch` rows of a cache with `capacity` slots
    per row (it copies every buffer; the engine calls it when rows finish)."""
    timer = ForwardTimer(model, batch, 1, capacity - 1)  # one cached token allocates the buffers
    rows = torch.arange(batch, device=model.device)
    return mean_seconds(lambda: timer.cache.rows.select_rows(rows), repeats, model.device, cache_evictor(model.device))


@torch.inference_mode()
def selection_latency(
    method: str,
    batch: int,
    num_drafts: int,
    draft_length: int,
    vocab_size: int,
    extreme: str,
    warp: SamplingWarp,
    repeats: int,
    device: torch.device,
) -> float:
    """Mean seconds of the engine's selection phase for one iteration, at one extreme of acceptance.

    The inputs look like the engine's: peaked distributions (softmax of 3 x Gaussian logits), the
    same p and q at position 0 of every draft (one context), different ones after; the draft tokens
    are sampled from p. ACCEPT_ALL: q = p, so every position is accepted; REJECT_ALL: p and q live on
    disjoint halves of the vocabulary, so every draft token has q = 0.
    """
    generator = torch.Generator(device="cpu").manual_seed(0)
    nodes = 1 + num_drafts * draft_length
    logits = torch.randn(batch, nodes, vocab_size, generator=generator).to(device)  # [B, T, V]
    node_of = torch.zeros(num_drafts, draft_length + 1, dtype=torch.int64, device=device)  # [K, L+1]
    shape_logits = 3.0 * torch.randn(batch, num_drafts, draft_length + 1, vocab_size, generator=generator)
    shape_logits[:, :, 0] = shape_logits[:, :1, 0]  # position 0: one context for all K drafts
    target_probs = torch.softmax(shape_logits, -1)  # [B, K, L+1, V]
    draft_probs = target_probs[:, :, :draft_length].clone()  # [B, K, L, V]
    if extreme == REJECT_ALL:
        first_half = torch.arange(vocab_size) < vocab_size // 2  # [V]
        draft_probs[..., ~first_half] = 0.0
        target_probs[..., first_half] = 0.0
        draft_probs /= draft_probs.sum(-1, keepdim=True)
        target_probs /= target_probs.sum(-1, keepdim=True)
    draft_tokens = torch.multinomial(draft_probs.reshape(-1, vocab_size), 1, generator=generator)
    draft_tokens = draft_tokens.reshape(batch, num_drafts, draft_length)  # [B, K, L]
    draft_tokens, draft_probs, target_probs = draft_tokens.to(device), draft_probs.to(device), target_probs.to(device)

    generators = make_generators(range(batch), device)  # the engine makes them once per generation

    def call():
        node_probs = warp.probs(logits)  # [B, T, V] (the engine's warp; its values are not used here)
        node_probs[:, node_of]  # the tree gather, [B, K, L+1, V]
        return select_sequences(
            draft_tokens,
            draft_probs,
            target_probs,
            generators,
            method=method,
            validate=False,
        )

    return mean_seconds(call, repeats, device, cache_evictor(device))


@torch.inference_mode()
def autoregressive_selection_latency(
    batch: int, vocab_size: int, warp: SamplingWarp, repeats: int, device: torch.device
) -> float:
    generator = torch.Generator(device="cpu").manual_seed(0)
    logits = torch.randn(batch, vocab_size, generator=generator).to(device)  # [B, V]
    uniforms = torch.rand(batch, generator=generator, dtype=torch.float64).to(device)  # [B]
    return mean_seconds(
        lambda: sample_categorical(warp.probs(logits), uniforms), repeats, device, cache_evictor(device)
    )


def latency_shapes(cases: Sequence) -> dict[str, set]:
    """The shapes the cases need: target T, draft T, draft K, commit L, and (method, K, L) of the
    selection phase."""
    shapes: dict[str, set] = {name: set() for name in ("target", "draft", "sample", "commit", "selection")}
    for case in cases:
        if case.method == "autoregressive":
            shapes["target"].add(1)
            shapes["commit"].add(0)
            shapes["selection"].add(("autoregressive", 0, 0))
        elif case.method in ("speculative", "spectr", "specinfer"):
            shapes["target"].add(1 + case.num_drafts * case.draft_length)
            shapes["draft"].update({1, 2, case.num_drafts})
            shapes["sample"].add(case.num_drafts)
            shapes["commit"].add(case.draft_length)
            shapes["selection"].add((case.method, case.num_drafts, case.draft_length))
    return shapes


def measure_latencies(
    target: HFCausalLM,
    draft: HFCausalLM,
    cases: Sequence,
    batch_sizes: Sequence[int],
    contexts: Iterable[int],
    capacities: Iterable[int],
    warp: SamplingWarp,
    repeats: int,
    on_step: Callable[[str], None] | None = None,
) -> LatencyTable:
    """Every latency the prediction of `cases` needs, at each of `batch_sizes`; forwards at each of
    `contexts`, select_rows at each of `capacities` (see the module docstring)."""
    shapes = latency_shapes(cases)
    table = LatencyTable()
    device = target.device
    contexts, capacities = sorted(set(contexts)), sorted(set(capacities))
    widest = max(shapes["target"] | shapes["draft"] | {1})
    for batch in batch_sizes:
        timers = {}
        for context in contexts:
            timers[TARGET] = ForwardTimer(target, batch, context, widest)
            for tokens in sorted(shapes["target"]):
                table.add(TARGET, batch, (tokens,), timers[TARGET].seconds(tokens, repeats), context)
            timers[DRAFT] = None
            if shapes["draft"]:
                timers[DRAFT] = ForwardTimer(draft, batch, context, widest)
                for tokens in sorted(shapes["draft"]):
                    table.add(DRAFT, batch, (tokens,), timers[DRAFT].seconds(tokens, repeats), context)
        for drafts in sorted(shapes["sample"]):
            for component, first in ((DRAFT_SAMPLE_FIRST, True), (DRAFT_SAMPLE, False)):
                seconds = draft_sampling_latency(batch, drafts, target.vocab_size, warp, first, repeats, device)
                table.add(component, batch, (drafts,), seconds)
        for length in sorted(shapes["commit"]):
            seconds = commit_latency(timers[TARGET], timers[DRAFT] if length else None, length, repeats)
            table.add(COMMIT, batch, (length,), seconds)
        for capacity in capacities:
            table.add(f"{SELECT_ROWS}_{TARGET}", batch, (), select_rows_latency(target, batch, capacity, repeats),
                      capacity)
            if shapes["draft"]:
                table.add(f"{SELECT_ROWS}_{DRAFT}", batch, (), select_rows_latency(draft, batch, capacity, repeats),
                          capacity)
        for method, drafts, length in sorted(shapes["selection"]):
            if method == "autoregressive":
                table.add(
                    "selection_autoregressive",
                    batch,
                    (),
                    autoregressive_selection_latency(batch, target.vocab_size, warp, repeats, device),
                )
                continue
            for extreme in (REJECT_ALL, ACCEPT_ALL):
                table.add(
                    f"selection_{method}_{extreme}",
                    batch,
                    (drafts, length),
                    selection_latency(method, batch, drafts, length, target.vocab_size, extreme, warp, repeats, device),
                )
        if on_step is not None:
            on_step(f"latencies at B={batch}")
    return table


def forward_shapes(case) -> list[tuple[str, tuple]]:
    """The (model, new tokens) forwards one iteration of `case` runs."""
    if case.method == "autoregressive":
        return [(TARGET, (1,))]
    shapes = [(TARGET, (1 + case.num_drafts * case.draft_length,)), (DRAFT, (1,)), (DRAFT, (2,)),
              (DRAFT, (case.num_drafts,))]
    return list(dict.fromkeys(shapes))


class Calibrator:
    """Times a configuration's own forward shapes at its batch size and context, right after each timed run.

    On a shared machine the speed drifts with the load of other processes; measuring the per-call
    latencies next to the run they predict keeps the two under the same conditions. The prediction
    then scales the full latency table (all batch sizes, measured once) by these local measurements
    (`ScaledTable`).
    """

    def __init__(self, target: HFCausalLM, draft: HFCausalLM, repeats: int):
        self.models = {TARGET: target, DRAFT: draft}
        self.repeats = repeats
        self.timers: dict[tuple[str, int, int], ForwardTimer] = {}

    def measure(self, case, context: int) -> dict[tuple[str, tuple], float]:
        measured = {}
        for component, shape in forward_shapes(case):
            key = (component, case.batch_size, context)
            if key not in self.timers or self.timers[key].max_new_tokens < shape[0]:
                self.timers[key] = ForwardTimer(self.models[component], case.batch_size, context, max(shape[0], 2))
            measured[(component, shape)] = self.timers[key].seconds(shape[0], self.repeats)
        return measured


def pooled(calibrations: Iterable[dict]) -> dict:
    """Mean of each calibrated latency over a configuration's runs (less noise than any one run)."""
    values: dict = {}
    for calibration in calibrations:
        for key, seconds in calibration.items():
            values.setdefault(key, []).append(seconds)
    return {key: statistics.fmean(v) for key, v in values.items()}


class ScaledTable:
    """A LatencyTable whose forward latencies are rescaled to a local measurement at one batch size.

    at(component, a, shape, c) = table.at(component, a, shape, c) * local[component, shape] /
    table.at(component, B, shape, context); components without a local measurement are taken from
    the table as they are. Prefill latencies are scaled like the model's widest forward.
    """

    def __init__(self, table: LatencyTable, local: dict[tuple[str, tuple], float], batch: int, context: float):
        self.table, self.local, self.batch, self.context = table, local, batch, context

    def factor(self, component: str, shape: tuple) -> float:
        if (component, shape) not in self.local:
            return 1.0
        return self.local[(component, shape)] / self.table.at(component, self.batch, shape, self.context)

    def model_factor(self, component: str) -> float:
        """Scale of the model's widest calibrated forward (used for its prefill)."""
        shapes = [shape for c, shape in self.local if c == component]
        return self.factor(component, max(shapes)) if shapes else 1.0

    def at(self, component: str, batch: float, shape: tuple, context: float | None = None) -> float:
        return self.table.at(component, batch, shape, context) * self.factor(component, shape)


# ---------------------------------------------------------------------------------------
# 2) prediction
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    seconds: float
    draft_seconds: float
    target_seconds: float
    selection_seconds: float
    other_seconds: float  # commit and removal of finished rows
    prefill_seconds: float  # included in draft_seconds / target_seconds

    def tokens_per_second(self, generated_tokens: int) -> float:
        return generated_tokens / self.seconds if self.seconds > 0 else 0.0


def active_rows(row_target_calls: Sequence[int]) -> list[int]:
    """Active batch size at iteration 1, 2, ...: rows that made at least that many target calls."""
    iterations = max(row_target_calls, default=0)
    return [sum(1 for calls in row_target_calls if calls >= i) for i in range(1, iterations + 1)]


def reach_probabilities(histogram: Sequence[int], draft_length: int) -> list[float]:
    """s_j, j = 0..L: fraction of (row, call) pairs whose call accepted >= j draft tokens.

    histogram[n] counts calls that emitted n tokens (accepted + 1, before truncation at the end of a
    row it is a close proxy); s_0 = 1 and s_L is the all-accepted fraction.
    """
    calls = sum(histogram)
    if calls == 0:
        return [1.0] + [0.0] * draft_length
    return [sum(histogram[j + 1 :]) / calls for j in range(draft_length + 1)]


def iteration_seconds(
    table: LatencyTable | ScaledTable,
    method: str,
    active: int,
    num_drafts: int,
    draft_length: int,
    reach: Sequence[float],
    context: float | None = None,
) -> tuple[float, float, float, float]:
    """(draft, target, selection, commit) seconds of one iteration with `active` rows."""
    if method == "autoregressive":
        return (
            0.0,
            table.at(TARGET, active, (1,), context),
            table.at("selection_autoregressive", active, ()),
            table.at(COMMIT, active, (0,)),
        )
    two_pending = 1.0 - (1.0 - reach[draft_length]) ** active  # some row accepted all L last time
    draft = (
        (1.0 - two_pending) * table.at(DRAFT, active, (1,), context)
        + two_pending * table.at(DRAFT, active, (2,), context)
        # branch step d (1..L-1) attends d - 1 earlier branch steps of K slots beyond the context
        + sum(
            table.at(DRAFT, active, (num_drafts,), None if context is None else context + (d - 1) * num_drafts)
            for d in range(1, draft_length)
        )
        + table.at(DRAFT_SAMPLE_FIRST, active, (num_drafts,))
        + (draft_length - 1) * table.at(DRAFT_SAMPLE, active, (num_drafts,))
    )
    target = table.at(TARGET, active, (1 + num_drafts * draft_length,), context)
    low = table.at(f"selection_{method}_{REJECT_ALL}", active, (num_drafts, draft_length))
    high = table.at(f"selection_{method}_{ACCEPT_ALL}", active, (num_drafts, draft_length))
    # positions walked by the batch: position j (0-based) is walked when some row reached it
    walked = sum(1.0 - (1.0 - reach[j]) ** active for j in range(draft_length))
    if draft_length > 1:
        share = (walked - 1.0) / (draft_length - 1)
    else:  # L = 1: one position is always walked; the extremes differ by the bonus sample after it
        share = 1.0 - (1.0 - reach[1]) ** active
    selection = low + (high - low) * min(max(share, 0.0), 1.0)
    return draft, target, selection, table.at(COMMIT, active, (draft_length,))


def row_removal_seconds(table: LatencyTable | ScaledTable, method: str, active: Sequence[int],
                        capacities: tuple[int, int]) -> float:
    """Seconds spent copying the remaining rows out of the caches each time rows finish."""
    seconds = 0.0
    for before, after in zip(active, list(active[1:]) + [0]):
        if after < before and after > 0:
            seconds += table.at(f"{SELECT_ROWS}_{TARGET}", after, (), capacities[0])
            if method != "autoregressive":
                seconds += table.at(f"{SELECT_ROWS}_{DRAFT}", after, (), capacities[1])
    return seconds


def predict_seconds(
    table: LatencyTable,
    method: str,
    num_drafts: int,
    draft_length: int,
    batches: Sequence[BatchRun],
    histogram: Sequence[int],
    calibration: dict[tuple[str, tuple], float] | None = None,
    batch_size: int | None = None,
    calibration_context: float | None = None,
) -> Prediction:
    """Predicted wall time of one run: per batch, its prefill plus its iterations (see module docstring).

    The engine times the prefill inside its target / draft phases, and so do the predicted
    draft_seconds / target_seconds. calibration (with batch_size and calibration_context): the
    configuration's own forward latencies at its batch size and context (`Calibrator`), which rescale
    the table (`ScaledTable`).
    """
    latencies = table if not calibration else ScaledTable(table, calibration, batch_size, calibration_context)
    reach = reach_probabilities(histogram, draft_length) if method != "autoregressive" else []
    draft = target = selection = other = 0.0
    prefill_target = prefill_draft = 0.0
    for batch in batches:
        active = active_rows(batch.row_target_calls)
        for rows in active:
            d, t, s, c = iteration_seconds(latencies, method, rows, num_drafts, draft_length, reach, batch.context)
            draft, target, selection, other = draft + d, target + t, selection + s, other + c
        other += row_removal_seconds(latencies, method, active, batch.capacities)
        prefill_target += batch.prefill_seconds[0]
        prefill_draft += batch.prefill_seconds[1]
    if calibration:
        prefill_target *= latencies.model_factor(TARGET)
        prefill_draft *= latencies.model_factor(DRAFT)
    draft, target = draft + prefill_draft, target + prefill_target
    return Prediction(
        draft + target + selection + other, draft, target, selection, other, prefill_target + prefill_draft
    )
