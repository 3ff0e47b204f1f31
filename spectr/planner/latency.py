"""Measuring the cost model's latencies on the device: forwards, draft sampling, selection, commit, prefill.

`measure_latencies` times, through the engine's own pieces (`spectr.hf.HFCausalLM.forward` on a
`RowKVCache` holding a cached context, with the engine's mask construction), each the mean of
>= `repeats` timed calls after one untimed call:
- target forward over T new tokens per row, T = 1 (autoregressive) and T = 1 + K*L (a draft tree);
- draft forward over T = 1 or 2 tokens per row (draft step 0: the pending tokens) and T = K (the K
  branches at draft steps 1..L-1);
- the draft's sampling after each draft forward (warp + inverse-CDF sample of K tokens per row);
- the selection phase (warps of the target logits [B, 1+K*L, V], the tree gather, and
  `spectr.sequence.select_sequences`) at its two extremes: every row rejects at the first position
  (disjoint p and q) and every row accepts all L positions (p = q); autoregressive: warp + sample;
- the commit of an iteration (`RowKVCache.keep_path` of the accepted path in both caches and the
  iteration's one host sync);
- the prompt prefill of each benchmark batch, for each model (`spectr.generate.prefill`);
each at the batch sizes `latency_batch_sizes`, linearly interpolated in between. Forwards are measured
at the cached context of each benchmark batch size and interpolated linearly in the context: a batch
attends as many cache slots as its longest row (left-aligned rows, one mask).

Calibration (`Calibrator`): the machine may be shared, so its speed drifts between the grid and the
latency table. Right after each timed run, the configuration's own forward shapes are timed again at
its batch size and context (see `spectr.planner.table.ScaledTable`).

Not here: the prediction (`spectr.planner.predict`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from spectr.generate import prefill
from spectr.hf import HFCausalLM
from spectr.kv_cache import tree_attention
from spectr.planner.table import (
    ACCEPT_ALL,
    COMMIT,
    DRAFT,
    DRAFT_SAMPLE,
    DRAFT_SAMPLE_FIRST,
    REJECT_ALL,
    TARGET,
    LatencyTable,
)
from spectr.rng import counter_uniforms, row_keys, sample_categorical
from spectr.sequence import select_sequences, uniforms_shape
from spectr.warps import SamplingWarp

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

    keys = row_keys(range(batch), device)  # [B]
    iterations = torch.zeros(batch, dtype=torch.int64, device=device)  # [B]
    shape = uniforms_shape(num_drafts, draft_length)

    def call():
        node_probs = warp.probs(logits)  # [B, T, V] (the engine's warp; its values are not used here)
        node_probs[:, node_of]  # the tree gather, [B, K, L+1, V]
        uniforms = counter_uniforms(keys, iterations, shape[0] * shape[1]).reshape(batch, *shape)  # [B, L+1, K+1]
        return select_sequences(draft_tokens, draft_probs, target_probs, uniforms, method=method,
                                              validate=False)

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
        elif case.method in ("speculative", "block", "spectr", "specinfer", "traversal"):
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
    warp: SamplingWarp,
    repeats: int,
    on_step: Callable[[str], None] | None = None,
) -> LatencyTable:
    """Every latency the prediction of `cases` needs, at each of `batch_sizes`; forwards at each of
    `contexts` (see the module docstring)."""
    shapes = latency_shapes(cases)
    table = LatencyTable()
    contexts = sorted(set(contexts))
    for batch in batch_sizes:
        timers = _measure_forwards(table, target, draft, shapes, batch, contexts, repeats)
        _measure_steps(table, target, timers, shapes, batch, warp, repeats)
        _measure_selection(table, target, shapes, batch, warp, repeats)
        if on_step is not None:
            on_step(f"latencies at B={batch}")
    return table


def _measure_forwards(table, target, draft, shapes, batch, contexts, repeats) -> dict:
    """Forwards of both models at every context; returns the timers of the last context."""
    widest = max(shapes["target"] | shapes["draft"] | {1})
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
    return timers


def _measure_steps(table, target, timers, shapes, batch, warp, repeats) -> None:
    """The cheap steps: the draft's sampling, the commit, and the removal of finished rows."""
    device = target.device
    for drafts in sorted(shapes["sample"]):
        for component, first in ((DRAFT_SAMPLE_FIRST, True), (DRAFT_SAMPLE, False)):
            seconds = draft_sampling_latency(batch, drafts, target.vocab_size, warp, first, repeats, device)
            table.add(component, batch, (drafts,), seconds)
    for length in sorted(shapes["commit"]):
        seconds = commit_latency(timers[TARGET], timers[DRAFT] if length else None, length, repeats)
        table.add(COMMIT, batch, (length,), seconds)


def _measure_selection(table, target, shapes, batch, warp, repeats) -> None:
    """The selection phase of every (method, K, L): autoregressive sampling, or both extremes of the walk."""
    device = target.device
    for method, drafts, length in sorted(shapes["selection"]):
        if method == "autoregressive":
            seconds = autoregressive_selection_latency(batch, target.vocab_size, warp, repeats, device)
            table.add("selection_autoregressive", batch, (), seconds)
            continue
        for extreme in (REJECT_ALL, ACCEPT_ALL):
            table.add(
                f"selection_{method}_{extreme}",
                batch,
                (drafts, length),
                selection_latency(method, batch, drafts, length, target.vocab_size, extreme, warp, repeats, device),
            )


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
