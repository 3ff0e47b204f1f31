"""Cost model: predict tokens/s of each (method, K, L, B) from measured per-call latencies and acceptance.

1) Latencies (`measure_latencies`), each the mean of >= `repeats` timed calls after one untimed call,
   through the engine's own pieces (`spectr.hf.HFCausalLM.forward` on a `RowKVCache` holding a context
   of the benchmark's typical length, with the engine's mask construction):
   - target forward over T new tokens per row, T = 1 (autoregressive) and T = 1 + K*L (a draft tree);
   - draft forward over T = 1 or 2 tokens per row (draft step 0: the pending tokens) and T = K (the K
     branches at draft steps 1..L-1);
   - the selection phase (warps of the target logits [B, 1+K*L, V], the tree gather, and
     `spectr.sequence.select_sequences`) at its two extremes: every row rejects at the first position
     (disjoint p and q) and every row accepts all L positions (p = q); autoregressive: warp + sample;
   - the prompt prefill of each benchmark batch, for each model (`spectr.generate.prefill`);
   each at the batch sizes `latency_batch_sizes`, linearly interpolated in between (rows leave the
   batch as they finish, so the active batch shrinks).
2) Prediction (`predict_seconds`), for one measured run: the per-row target calls of that run say how
   many rows are active at each iteration i (a_i = #rows with at least i calls). An iteration costs
       draft(a, 1 or 2) + (L - 1) * draft(a, K) + target(a, 1 + K L) + selection(a, K, L, walk)
   where step 0 feeds 2 tokens when the previous iteration accepted all L drafts of some row
   (probability 1 - (1 - f)^a, f = the run's fraction of all-accepted calls) and the selection walk is
   interpolated between its extremes by the expected number of positions walked (the walk stops when
   no row of the batch accepts: P(reach j) = 1 - (1 - s_j)^a, s_j = the run's fraction of calls that
   accepted >= j tokens). Autoregressive: target(a, 1) + selection. Plus one prefill per batch and
   model. Predicted tokens/s = generated tokens / predicted seconds.
3) Calibration (`Calibrator`, `ScaledTable`): the machine is shared, so its speed drifts between the
   grid and the latency table. Right after each timed run, the configuration's own forward shapes are
   timed again at its batch size; the table's forward latencies are scaled by local / table at that
   batch size (the prefill like the model's widest forward), the selection latencies are not.

What the model leaves out, and the relative error therefore includes: the loop's bookkeeping (cache
commit, host sync, Python), growth of attention cost with the context within a run, and machine noise.
This module does not run the benchmark grid and does not report.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
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


@dataclass
class LatencyTable:
    """Seconds per call keyed by (component, batch size, shape...); interpolated in the batch size."""

    seconds: dict[tuple, float] = field(default_factory=dict)

    def add(self, component: str, batch: int, shape: tuple, seconds: float) -> None:
        self.seconds[(component, batch, *shape)] = seconds

    def at(self, component: str, batch: float, shape: tuple) -> float:
        """Latency at a (possibly unmeasured) batch size: linear in B between the measured neighbours."""
        points = sorted(
            (key[1], value)
            for key, value in self.seconds.items()
            if key[0] == component and tuple(key[2:]) == tuple(shape)
        )
        if not points:
            raise KeyError(f"no latency measured for {component} {shape}")
        return interpolate(points, batch)

    def rows(self) -> list[dict]:
        return [
            {
                "component": key[0],
                "batch_size": key[1],
                "shape": "x".join(map(str, key[2:])),
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


def mean_seconds(call: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Mean wall time of `call` after one untimed call: at least `repeats` timed calls, more (up to
    10x) for cheap calls until MIN_TIMED_SECONDS have been timed.

    The mean, not the median: a generation run pays for every call, preempted ones included, so on a
    shared machine the expected cost per call is what predicts its wall time."""
    call()
    times: list[float] = []
    while len(times) < repeats or (sum(times) < MIN_TIMED_SECONDS and len(times) < MAX_REPEAT_FACTOR * repeats):
        _sync(device)
        start = time.perf_counter()
        call()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.fmean(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------
# 1) measurements
# ---------------------------------------------------------------------------------------


MAX_TREE_TOKENS = 1024  # capacity of a ForwardTimer's cache beyond its context


class ForwardTimer:
    """Times forwards of T new tokens per row after a cached context of random tokens (one prefill).

    The same slots after the context are rewritten by every timed call, so one cache serves every T.
    """

    def __init__(self, model: HFCausalLM, batch: int, context: int):
        self.model, self.batch, self.context = model, batch, context
        device = model.device
        self.cache = model.new_cache(batch, context + MAX_TREE_TOKENS + 1)
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
        if new_tokens > MAX_TREE_TOKENS:
            raise ValueError(f"new_tokens {new_tokens} exceeds the timer's capacity {MAX_TREE_TOKENS}")
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


def forward_latency(model: HFCausalLM, batch: int, new_tokens: int, context: int, repeats: int) -> float:
    """Mean seconds of one forward of `new_tokens` tokens per row after a cached `context`."""
    return ForwardTimer(model, batch, context).seconds(new_tokens, repeats)


@torch.inference_mode()
def prefill_latency(model: HFCausalLM, prompts: Sequence[Sequence[int]], repeats: int) -> float:
    """Mean seconds of the engine's prompt prefill of this batch."""
    device = model.device
    capacity = max(len(p) for p in prompts) + 1

    def call():
        prefill(model, model.new_cache(len(prompts), capacity), [list(p) for p in prompts], device)

    return mean_seconds(call, repeats, device)


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
    """Mean seconds of the engine's selection phase for one iteration, at one extreme of acceptance."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    nodes = 1 + num_drafts * draft_length
    logits = torch.randn(batch, nodes, vocab_size, generator=generator).to(device)  # [B, T, V]
    node_of = torch.zeros(num_drafts, draft_length + 1, dtype=torch.int64, device=device)  # [K, L+1]
    half = vocab_size // 2
    base = torch.zeros(vocab_size, dtype=torch.float32, device=device)  # [V]
    draft_p = base.clone()
    draft_p[:half] = 1.0 / half
    target_q = draft_p.clone() if extreme == ACCEPT_ALL else base.clone()
    if extreme == REJECT_ALL:
        target_q[half:] = 1.0 / (vocab_size - half)  # disjoint from p: every draft token has q = 0
    draft_probs = draft_p.expand(batch, num_drafts, draft_length, vocab_size).contiguous()  # [B, K, L, V]
    target_probs = target_q.expand(
        batch, num_drafts, draft_length + 1, vocab_size
    ).contiguous()  # [B, K, L+1, V]
    draft_tokens = torch.randint(0, half, (batch, num_drafts, draft_length), generator=generator).to(device)

    def call():
        node_probs = warp.probs(logits)  # [B, T, V] (the engine's warp; its values are not used here)
        node_probs[:, node_of]  # the tree gather, [B, K, L+1, V]
        return select_sequences(
            draft_tokens,
            draft_probs,
            target_probs,
            make_generators(range(batch), device),
            method=method,
            validate=False,
        )

    return mean_seconds(call, repeats, device)


@torch.inference_mode()
def autoregressive_selection_latency(
    batch: int, vocab_size: int, warp: SamplingWarp, repeats: int, device: torch.device
) -> float:
    generator = torch.Generator(device="cpu").manual_seed(0)
    logits = torch.randn(batch, vocab_size, generator=generator).to(device)  # [B, V]
    uniforms = torch.rand(batch, generator=generator, dtype=torch.float64).to(device)  # [B]
    return mean_seconds(lambda: sample_categorical(warp.probs(logits), uniforms), repeats, device)


def latency_shapes(cases: Sequence) -> dict[str, set]:
    """The shapes the cases need: target T, draft T, and (method, K, L) of the selection phase."""
    target_tokens, draft_tokens, selections = set(), set(), set()
    for case in cases:
        if case.method == "autoregressive":
            target_tokens.add(1)
            selections.add(("autoregressive", 0, 0))
        elif case.method in ("speculative", "spectr", "specinfer"):
            target_tokens.add(1 + case.num_drafts * case.draft_length)
            draft_tokens.update({1, 2, case.num_drafts})
            selections.add((case.method, case.num_drafts, case.draft_length))
    return {"target": target_tokens, "draft": draft_tokens, "selection": selections}


def measure_latencies(
    target: HFCausalLM,
    draft: HFCausalLM,
    cases: Sequence,
    batch_sizes: Sequence[int],
    context: int,
    warp: SamplingWarp,
    repeats: int,
    on_step: Callable[[str], None] | None = None,
) -> LatencyTable:
    """Every latency the prediction of `cases` needs, at each of `batch_sizes` (see module docstring)."""
    shapes = latency_shapes(cases)
    table = LatencyTable()
    device = target.device
    for batch in batch_sizes:
        target_timer = ForwardTimer(target, batch, context)
        for tokens in sorted(shapes["target"]):
            table.add(TARGET, batch, (tokens,), target_timer.seconds(tokens, repeats))
        if shapes["draft"]:
            draft_timer = ForwardTimer(draft, batch, context)
            for tokens in sorted(shapes["draft"]):
                table.add(DRAFT, batch, (tokens,), draft_timer.seconds(tokens, repeats))
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
    return [(TARGET, (1 + case.num_drafts * case.draft_length,)), (DRAFT, (1,)), (DRAFT, (2,)),
            (DRAFT, (case.num_drafts,))]


class Calibrator:
    """Times a configuration's own forward shapes at its batch size, right after each timed run.

    On a shared machine the speed drifts with the load of other processes; measuring the per-call
    latencies next to the run they predict keeps the two under the same conditions. The prediction
    then scales the full latency table (all batch sizes, measured once) by these local measurements
    (`ScaledTable`).
    """

    def __init__(self, target: HFCausalLM, draft: HFCausalLM, context: int, repeats: int):
        self.models = {TARGET: target, DRAFT: draft}
        self.context, self.repeats = context, repeats
        self.timers: dict[tuple[str, int], ForwardTimer] = {}

    def measure(self, case) -> dict[tuple[str, tuple], float]:
        measured = {}
        for component, shape in forward_shapes(case):
            key = (component, case.batch_size)
            if key not in self.timers:
                self.timers[key] = ForwardTimer(self.models[component], case.batch_size, self.context)
            measured[(component, shape)] = self.timers[key].seconds(shape[0], self.repeats)
        return measured


class ScaledTable:
    """A LatencyTable whose forward latencies are rescaled to a local measurement at one batch size.

    at(component, a, shape) = table.at(component, a, shape) * local[component, shape] / table.at(component, B, shape);
    components without a local measurement (selection) are taken from the table as they are. Prefill
    latencies are scaled like the model's widest forward.
    """

    def __init__(self, table: LatencyTable, local: dict[tuple[str, tuple], float], batch: int):
        self.table, self.local, self.batch = table, local, batch

    def factor(self, component: str, shape: tuple) -> float:
        if (component, shape) not in self.local:
            return 1.0
        return self.local[(component, shape)] / self.table.at(component, self.batch, shape)

    def model_factor(self, component: str) -> float:
        """Scale of the model's widest calibrated forward (used for its prefill)."""
        shapes = [shape for c, shape in self.local if c == component]
        return self.factor(component, max(shapes)) if shapes else 1.0

    def at(self, component: str, batch: float, shape: tuple) -> float:
        return self.table.at(component, batch, shape) * self.factor(component, shape)


# ---------------------------------------------------------------------------------------
# 2) prediction
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    seconds: float
    draft_seconds: float
    target_seconds: float
    selection_seconds: float
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
    table: LatencyTable | ScaledTable, method: str, active: int, num_drafts: int, draft_length: int, reach: Sequence[float]
) -> tuple[float, float, float]:
    """(draft, target, selection) seconds of one iteration with `active` rows."""
    if method == "autoregressive":
        return 0.0, table.at(TARGET, active, (1,)), table.at("selection_autoregressive", active, ())
    two_pending = 1.0 - (1.0 - reach[draft_length]) ** active  # some row accepted all L last time
    draft = (
        (1.0 - two_pending) * table.at(DRAFT, active, (1,))
        + two_pending * table.at(DRAFT, active, (2,))
        + (draft_length - 1) * table.at(DRAFT, active, (num_drafts,))
    )
    target = table.at(TARGET, active, (1 + num_drafts * draft_length,))
    low = table.at(f"selection_{method}_{REJECT_ALL}", active, (num_drafts, draft_length))
    high = table.at(f"selection_{method}_{ACCEPT_ALL}", active, (num_drafts, draft_length))
    # positions walked by the batch: position j (0-based) is walked when some row reached it
    walked = sum(1.0 - (1.0 - reach[j]) ** active for j in range(draft_length))
    share = (walked - 1.0) / (draft_length - 1) if draft_length > 1 else reach[1] if len(reach) > 1 else 0.0
    return draft, target, low + (high - low) * min(max(share, 0.0), 1.0)


def predict_seconds(
    table: LatencyTable,
    method: str,
    num_drafts: int,
    draft_length: int,
    row_target_calls: Sequence[Sequence[int]],
    histogram: Sequence[int],
    prefill_seconds: Sequence[tuple[float, float]],
    calibration: dict[tuple[str, tuple], float] | None = None,
    batch_size: int | None = None,
) -> Prediction:
    """Predicted wall time of one run: per batch, its prefill plus its iterations (see module docstring).

    row_target_calls: per batch, the target calls of each row; prefill_seconds: per batch, the
    (target, draft) prefill latencies (draft 0 for autoregressive). The engine times the prefill
    inside its target / draft phases, and so do the predicted draft_seconds / target_seconds.
    calibration (with batch_size): the run's own forward latencies at its batch size (`Calibrator`),
    which rescale the table (`ScaledTable`).
    """
    latencies = table if not calibration else ScaledTable(table, calibration, batch_size)
    reach = reach_probabilities(histogram, draft_length) if method != "autoregressive" else []
    draft = target = selection = 0.0
    for calls in row_target_calls:
        for active in active_rows(calls):
            d, t, s = iteration_seconds(latencies, method, active, num_drafts, draft_length, reach)
            draft, target, selection = draft + d, target + t, selection + s
    target_scale = latencies.model_factor(TARGET) if calibration else 1.0
    draft_scale = latencies.model_factor(DRAFT) if calibration else 1.0
    prefill_target = target_scale * float(sum(t for t, _ in prefill_seconds))
    prefill_draft = draft_scale * float(sum(d for _, d in prefill_seconds))
    draft, target = draft + prefill_draft, target + prefill_target
    return Prediction(draft + target + selection, draft, target, selection, prefill_target + prefill_draft)
