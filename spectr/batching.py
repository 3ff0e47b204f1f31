"""Continuous batching: a fixed number of rows in flight over one cache pool, refilled as rows finish.

`ContinuousBatcher` holds a draft/target pair, `batch_size` slots and the KV caches of both
models allocated once at `batch_size x capacity` (capacity = `max_length` + the widest tree,
`max_length` = the longest prompt + budget a row may have, at most the models' positions). Its
life is a loop of three moves:

1) admit   - `admit(prompts, max_new_tokens=..., seed=..., tags=...)` checks the prompts and
             queues them, in order; at the next `step`, waiting prompts take the free slots
             (prefill of the new rows only, one forward per model, no host sync; a prompt that a
             live or another new row already holds is not run again: its row copies that row's
             prompt slots, so the samples of a prompt share one prefill; `share_prefill=False` off);
             rows may carry their own `SamplingWarp` (`admit(..., warps=)`: the pool then warps per
             row, `spectr.warps.RowWarps`) and, with `logprobs=True`, each token's log q comes back
             with the row (`FinishedRow.logprobs`, in the same read-back); a row admitted with
             `prompt_logprobs=N` keeps its prefill's logits at every prompt position (its own forward,
             apart from the rows that do not ask, which keep only the last position's) and comes back
             with vLLM's `prompt_logprobs` (`FinishedRow.prompt_logprobs`, `spectr.rows.PromptLogprobs`);
2) iterate - `step(config=None)` runs one iteration (`spectr.iteration`) of `config` (any
             `spectr.steps.StepConfig` within the batcher's bounds; default the batcher's own, see
             "Configurations" below) on the slots [0, top) (top = the
             highest occupied slot + 1; empty and finished slots below it masked); when at most
             `pack_below x batch_size` rows are live, live rows above the holes are first moved
             down into them (see "Live rows" below);
3) retire  - rows that finished in that iteration are read back (one host copy for all of
             them) and returned as `FinishedRow`s; their slots are reset, never compacted,
             and take the next waiting prompts.

`finished()` iterates `step()` until nothing waits or runs, yielding rows as they finish; an
actor calls `admit` again whenever `waiting` runs low, so that its batch stays full across
shards. A row's output depends only on its prompt, seed, budget, the models and the run
settings: its random stream is keyed by (seed, the row's own iteration, slot), and no
computation mixes rows (batched kernels' floating-point differences aside).

Configurations: the caches, records and drafter are allocated once for the bounds (Kmax, Lmax), so
consecutive iterations may run different methods, K and L on the same rows, cache pool and random
streams; `last_step` (`StepReport`) says what each did: its tokens, accepted and tested positions
come in the iteration's existing host copy (no extra read), its seconds from the host clock. The
draft cache does not follow autoregressive iterations; the next speculative one catches it up in
one forward (`spectr.iteration`). Every iteration samples the target's conditional law, so a
schedule of configurations never changes the output law; a row's exact tokens then depend on the
schedule (with one fixed configuration, on its prompt, seed, budget, models and settings only).

Host syncs: per iteration the engine's usual one (autoregressive and the single-draft
methods, speculative and block) or two (multi-draft methods, spectr and specinfer with
K > 1), plus one read-back in an iteration where rows finished (retirement, which frees the
slots the next admission fills). Admission itself reads nothing.

Live rows: with a queue of waiting prompts every slot is busy; at the tail of a run (nothing
waits) slots empty one by one. Slots above the highest occupied one are never computed (the
iteration runs on a prefix of the pool, views, no copy). With packing, the live rows fill
the holes below: each hole takes the highest live row (`RowKVCache.move_rows`: a copy of that
row's used cache slots, once, not of the cache), so that the iteration runs on the live rows
only. On the CPU a forward costs about in proportion to its rows, so packing pays as soon as
a slot is free (pack_below = 1); on CUDA a small forward is bound by reading the weights and a
masked row costs little, so the default never packs (not measured on a GPU yet; see
`DEFAULT_PACK_BELOW`).

This module knows nothing about tokenizers, Ray or files: prompts are lists of token ids.
"""

from __future__ import annotations

import contextlib
import heapq
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from spectr.drafting import TreeDrafter
from spectr.feature_draft import FeatureDrafter, FeatureDraftLM, FeatureTap
from spectr.hf import HFCausalLM
from spectr.iteration import Loop, autoregressive_step, speculative_step
from spectr.native import (
    NativeCausalLM,
    auto_compile,
    check_compile,
    compile_seconds_so_far,
    native_supported,
    shape_rules,
)
from spectr.records import DRAFT_NONFINITE, STOP, TARGET_NONFINITE, Records, SlotResult
from spectr.rng import row_keys
from spectr.rows import PromptLogprobs, RowState, prefill, prompt_logprob_tensors
from spectr.sequence import sequence_methods
from spectr.settings import (
    AUTOREGRESSIVE,
    Settings,
    check_max_new_tokens,
    check_prompts,
    check_prompts_fit,
    check_seeds,
)
from spectr.stats import GenerationStats, PhaseTimer
from spectr.steps import StepConfig, StepReport
from spectr.warps import RowWarps, SamplingWarp

# Pack live rows into the holes below them when at most this fraction of the slots is live, by device type. On
# the CPU a forward costs about in proportion to its rows, so packing pays as soon as a slot is free (measured:
# docs/performance.md#default_pack_below); on CUDA never (not measured on a GPU yet): see the module docstring.
DEFAULT_PACK_BELOW = {"cpu": 1.0}


@dataclass
class FinishedRow:
    """One finished prompt: its tokens and its own statistics (see `spectr.stats` for the terms).

    request: admission order over the batcher's life (0, 1, ...); tag: what the caller gave with
    the prompt (`admit(..., tags=...)`), or None.
    """

    request: int
    tag: Any
    tokens: list[int]
    finish_reason: str  # "eos" | "length" | "error" | "stop" (ended by `ContinuousBatcher.finish_rows`)
    target_calls: int
    error: str | None
    accepted_per_position: list[int] = field(default_factory=list)
    tested_positions: int = 0
    tree_nodes: int = 0
    tokens_per_call_histogram: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None  # with logprobs: per token, log q of its warped target law ("raw": log-softmax)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # with top_logprobs=N: per token, N (id, log-prob)
    prompt_logprobs: PromptLogprobs | None = None  # admitted with prompt_logprobs=N: vLLM's, from the prefill

    @property
    def generated_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class _Request:
    request: int
    prompt: list[int]
    budget: int
    seed: int
    tag: Any
    warp: SamplingWarp | None = None  # None: the run's warp
    stops: tuple[int, ...] | None = None  # None: the run's EOS ids end the row; else these tokens (empty: none)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs=N (None: not asked)
    prompt_state: tuple | None = None  # its `prompt_logprob_tensors` (device), set at the prefill


def known_methods() -> list[str]:
    """The concrete methods (`spectr.generate(method="auto")` picks among them per iteration)."""
    return [AUTOREGRESSIVE, *sequence_methods()]


def wrap_model(model, role: str, native: bool = False) -> HFCausalLM:
    """The engine's view of an HF model: `NativeCausalLM` (compilable) when `native` and the model is of
    the Llama / Qwen2 family (`spectr.native`), else `HFCausalLM` (eager HF forward); a feature draft's
    `FeatureDraftLM` (unbound: its vocabulary and limits only)."""
    if getattr(model, "is_feature_draft", False):
        return FeatureDraftLM(model, role=role)
    if native and native_supported(model) is None:
        return NativeCausalLM(model, role=role)
    return HFCausalLM(model, role=role)


def load_models(target, draft, settings: Settings, speculative: bool | None = None,
                native: bool = False) -> tuple[HFCausalLM, HFCausalLM | None]:
    """Wrap the pair and check that it is one: vocabulary, device. The draft is kept when some
    iteration may speculate (`speculative`, default: the settings' method is speculative).
    native: wrap Llama / Qwen2 models as `NativeCausalLM` (so that they may be compiled)."""
    feature = getattr(draft, "is_feature_draft", False)
    # a feature draft reads the target's hidden states from HF's forward (hooks): the target runs eagerly
    target_lm = wrap_model(target, "target", native and not feature)
    if not (settings.speculative if speculative is None else speculative):
        return target_lm, None
    if draft is None:
        raise ValueError(f"method {settings.method!r} needs a draft model; got draft=None")
    if feature:
        draft_lm = FeatureDraftLM(draft.bind(target))
        target_lm.tap = feature_tap(target, draft.config.feature_layers)
    else:
        draft_lm = wrap_model(draft, "draft", native)
    if draft_lm.vocab_size != target_lm.vocab_size:
        raise ValueError(
            f"target and draft must share a vocabulary: target vocab size {target_lm.vocab_size} "
            f"({target_lm.model_type}), draft vocab size {draft_lm.vocab_size} ({draft_lm.model_type})"
        )
    if draft_lm.device != target_lm.device:
        raise ValueError(
            f"target and draft must be on the same device: target on {target_lm.device}, draft on {draft_lm.device}"
        )
    return target_lm, draft_lm


def feature_tap(target, layers: list[int]) -> FeatureTap:
    """The target's feature tap for these layers, installed once per model (kept on the model, so that
    batchers over the same target share its hooks instead of stacking them)."""
    tap = getattr(target, "_spectr_feature_tap", None)
    if tap is not None and tap.layers == list(layers):
        return tap
    if tap is not None:
        tap.close()
    tap = FeatureTap(target, layers)
    target._spectr_feature_tap = tap
    return tap


def model_limit(models: Sequence[HFCausalLM]) -> int | None:
    """The longest sequence every model can take (positions, sliding window), None if unbounded."""
    limits = [limit for m in models for limit in (m.max_positions, m.sliding_window) if limit is not None]
    return min(limits) if limits else None


class ContinuousBatcher:
    """Rows in flight over one cache pool; see the module docstring.

    method / num_drafts / draft_length are the default configuration (`config`, what `step()` runs);
    max_num_drafts / max_draft_length (default: the default configuration's K and L) bound the
    configurations `step(config)` may run, and size the tree slots of the caches, the records and the
    drafter once. A draft model is kept when the bounds allow speculation (autoregressive without a
    draft: autoregressive only).

    compile: False (eager HF forwards), True (Llama / Qwen2 models run `spectr.native`'s forward under
    torch.compile; other models stay eager) or "auto" (`spectr.native.auto_compile`, decided once at the
    first `step` from the queued work); `stats.compiled` says which ran. On CUDA, compiled iterations run
    on a power-of-2 prefix of the slots (masked rows above the live ones) so CUDA graphs see few shapes.

    The constructor checks the run settings and raises ValueError naming the bad argument;
    `admit` checks prompts, budgets and seeds and raises ValueError naming the argument and the
    row (nothing of that call is queued then).
    """

    def __init__(self, target, draft, *, batch_size: int, max_length: int | None = None, method: str = "spectr",
                 num_drafts: int = 4, draft_length: int = 4, max_num_drafts: int | None = None,
                 max_draft_length: int | None = None, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, eos_token_id=None, pack_below: float | None = None, logprobs: bool | str = False,
                 share_prefill: bool = True, compile: bool | str = False, top_logprobs: int = 0):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.settings = Settings.for_run(methods=known_methods(), method=method, num_drafts=num_drafts,
                                         draft_length=draft_length, temperature=temperature, top_k=top_k,
                                         top_p=top_p, eos_token_id=eos_token_id)
        s = self.settings
        self.config = StepConfig.of(s.method, s.num_drafts, s.draft_length)
        self.bounds = self._bounds(max_num_drafts, max_draft_length)
        if draft is None and not s.speculative:
            self.bounds = (0, 0)  # autoregressive without a draft model: no drafter, whatever the bounds
        self.compile = check_compile(compile)
        self.target, self.draft = load_models(target, draft, s, speculative=self.bounds[1] > 0,
                                              native=self.compile is not False)
        self.compiled: bool | None = None  # decided at the first step (compile="auto": by the queued work)
        self._compile_base = 0.0  # `compile_seconds_so_far()` when the compile decision was taken
        self.batch_size = batch_size
        self.max_length = self._max_length(max_length)
        self.device = self.target.device
        self.pack_below = float(DEFAULT_PACK_BELOW.get(self.device.type, 0.0) if pack_below is None else pack_below)
        if logprobs not in (False, True, "processed", "raw"):
            raise ValueError(f"logprobs must be False, True / 'processed' (the warped law each token was drawn "
                             f"from) or 'raw' (the target's log-softmax), got {logprobs!r}")
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or top_logprobs < 0:
            raise ValueError(f"top_logprobs must be an int >= 0, got {top_logprobs!r}")
        self.logprobs = bool(logprobs) or top_logprobs > 0
        self.raw_logprobs = logprobs == "raw"
        self.top_logprobs = top_logprobs  # with logprobs: each token's N most likely tokens, from the same law
        self.share_prefill = bool(share_prefill)  # False: every row runs its own prefill (measurements)
        self.row_warps: RowWarps | None = None  # set when a row is admitted with its own warp
        self.stats = GenerationStats(method=s.method, num_drafts=s.num_drafts, draft_length=s.draft_length)
        with torch.inference_mode():
            self._allocate()
        self.loop = Loop(self.target, s.warp, s.method, s.num_drafts, s.draft_length, self.records, self.stats,
                         PhaseTimer(self.device))
        self.loop.raw_logprobs = self.raw_logprobs
        self._waiting: deque[_Request] = deque()
        self._free = list(range(batch_size))  # a heap: the lowest free slot first
        self._in_slot: list[_Request | None] = [None] * batch_size
        self._top = 0  # the highest occupied slot + 1 (host)
        self._next_request = 0
        self.rows_running = 0  # host copy of running.sum()
        self._totals = [0, 0, 0]  # host copy of records.totals(occupied) after the last iteration
        self.last_step: StepReport | None = None
        self.watch_tokens = False  # True: each iteration's new tokens come back with its host copy (recent_tokens)
        self.recent_tokens: dict[int, list[int]] = {}  # request -> tokens its row committed in the last iteration
        self._seen: dict[int, int] = {}  # request -> output length already in recent_tokens (watching only)

    def _bounds(self, max_num_drafts: int | None, max_draft_length: int | None) -> tuple[int, int]:
        """(Kmax, Lmax): what the allocation fits; default the default config's own K and L."""
        bounds = []
        for name, value, default in (("max_num_drafts", max_num_drafts, self.config.num_drafts),
                                     ("max_draft_length", max_draft_length, self.config.draft_length)):
            if value is None:
                value = default
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
            bounds.append(max(value, default))
        if bounds[1] == 0:  # autoregressive without bounds: no draft, no tree
            return 0, 0
        if self.settings.warp.greedy:
            bounds[0] = 1  # greedy drafts one path (see Settings.for_run)
        return max(bounds[0], 1), bounds[1]

    def check_config(self, config: StepConfig) -> StepConfig:
        """`config` in normal form for this run (greedy: one draft), or ValueError when it does not fit."""
        if config.method not in known_methods():
            raise ValueError(f"unknown method {config.method!r}; expected one of {known_methods()}")
        if config.speculative and self.settings.warp.greedy:
            config = StepConfig.of(config.method, 1, config.draft_length)
        max_k, max_l = self.bounds
        if config.speculative and (self.draft is None or config.num_drafts > max_k or config.draft_length > max_l):
            raise ValueError(f"configuration {config.label} does not fit this batcher (K <= {max_k}, L <= {max_l}, "
                             f"draft model {'present' if self.draft is not None else 'absent'})")
        return config

    def _max_length(self, max_length: int | None) -> int:
        limit = model_limit([m for m in (self.target, self.draft) if m is not None])
        if max_length is None:
            if limit is None:
                raise ValueError("max_length is required: the models declare no maximum number of positions")
            return limit
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"max_length must be an int >= 2 (prompt + new tokens), got {max_length!r}")
        return max_length if limit is None else min(max_length, limit)

    def _allocate(self) -> None:
        """The cache pool and the per-slot state, once for the batcher's life."""
        s, slots = self.settings, self.batch_size
        max_k, max_l = self.bounds
        tree = max_k * max_l  # the widest tree any iteration may draft
        self.target_cache = self.target.new_cache(slots, self.max_length + 1 + tree)
        drafter = None
        if self.draft is not None:
            draft_cache = self.draft.new_cache(slots, self.max_length + 2 + tree)
            pending = torch.zeros(slots, dtype=torch.int64, device=self.device)
            if isinstance(self.draft, FeatureDraftLM):  # pending: an iteration's L + 1 tokens, + 1 autoregressive
                drafter = FeatureDrafter(self.draft, draft_cache, s.warp, pending, capacity=max_l + 2)
            else:
                drafter = TreeDrafter(self.draft, draft_cache, s.warp, pending)
        self.rows = RowState.pool(slots, self.target_cache, drafter, self.device)
        self.occupied = torch.zeros(slots, dtype=torch.bool, device=self.device)  # [B] admitted, not retired
        self.records = Records(slots, self.max_length, max_l + 1, max_l, s.eos_ids, self.device, self.logprobs,
                               min(self.top_logprobs, self.target.vocab_size))

    # -- the caller's view -------------------------------------------------------------
    @property
    def waiting(self) -> int:
        """Prompts admitted but not in a slot yet."""
        return len(self._waiting)

    @property
    def in_flight(self) -> int:
        """Rows in a slot (generating, or finished in the last iteration and not returned yet)."""
        return self.batch_size - len(self._free)

    @property
    def idle(self) -> bool:
        return not self._waiting and self.rows_running == 0

    @property
    def pool_nbytes(self) -> int:
        """Bytes of the cache pool and every per-slot tensor (constant once the caches are written)."""
        caches = [self.target_cache.rows] + ([] if self.rows.drafter is None else [self.rows.drafter.cache.rows])
        return sum(c.nbytes for c in caches) + self.records.nbytes + self.rows.nbytes

    def admit(self, prompts, *, max_new_tokens: int | Sequence[int] = 64, seed: int | Sequence[int] = 0,
              tags: Sequence[Any] | None = None, warps: Sequence[SamplingWarp | None] | None = None,
              stop_token_ids: Sequence[Sequence[int] | None] | None = None,
              prompt_logprobs: Sequence[int | None] | None = None) -> list[int]:
        """Queue prompts (token-id lists), in order; returns their request ids.

        max_new_tokens: an int >= 1 or one per prompt; seed: an int (prompt i uses seed + i) or one
        per prompt; tags: None or one value per prompt, returned with the row; warps: None or one
        `SamplingWarp` (or None: the run's) per prompt, the law that row samples (rows of several
        warps share the batch, each exact for its own; penalties and min_tokens are counted on each draft-tree
        node's own path, `spectr.penalties`); stop_token_ids: None or one entry per prompt, None (the
        run's EOS ids end it) or the token ids that end that row instead (vLLM's stop_token_ids, with its EOS
        unless ignore_eos; an empty list: the row runs its whole budget); prompt_logprobs: None or one
        entry per prompt, None or vLLM's N >= 0 (`FinishedRow.prompt_logprobs`: each prompt token's
        log-probability and rank under the target, and the N most likely tokens at each position).
        """
        checked = check_prompts(prompts)
        budgets = check_max_new_tokens(max_new_tokens, len(checked))
        seeds = check_seeds(seed, len(checked))
        for name, values in (("tags", tags), ("warps", warps), ("stop_token_ids", stop_token_ids),
                             ("prompt_logprobs", prompt_logprobs)):
            if values is not None and len(values) != len(checked):
                raise ValueError(f"{name} has {len(values)} entries but there are {len(checked)} prompts")
        if warps is not None and not all(w is None or isinstance(w, SamplingWarp) for w in warps):
            raise ValueError("warps must be None or one SamplingWarp (or None) per prompt")
        if prompt_logprobs is not None and not all(n is None or (isinstance(n, int) and not isinstance(n, bool)
                                                                 and n >= 0) for n in prompt_logprobs):
            raise ValueError(f"prompt_logprobs must be None or one int >= 0 (or None) per prompt, got {prompt_logprobs!r}")
        for model in (self.target, self.draft):
            if model is not None:
                check_prompts_fit(checked, model, budgets)
        for row, (prompt, budget) in enumerate(zip(checked, budgets)):
            if len(prompt) + budget > self.max_length:
                raise ValueError(f"prompt {row}: {len(prompt)} prompt tokens + max_new_tokens {budget} = "
                                 f"{len(prompt) + budget} exceeds the batcher's max_length {self.max_length}")
        first = self._next_request
        self._next_request += len(checked)
        for row, (prompt, budget, row_seed) in enumerate(zip(checked, budgets, seeds)):
            stops = None if stop_token_ids is None or stop_token_ids[row] is None else tuple(stop_token_ids[row])
            self._waiting.append(_Request(first + row, prompt, budget, row_seed, None if tags is None else tags[row],
                                          None if warps is None else warps[row], stops,
                                          None if prompt_logprobs is None else prompt_logprobs[row]))
        return list(range(first, self._next_request))

    def step(self, config: StepConfig | None = None) -> list[FinishedRow]:
        """Fill free slots, run one iteration with `config` (default: `self.config`), return the rows
        that finished in it (in slot order); `last_step` then says what the iteration did."""
        config = self.config if config is None else self.check_config(config)
        self.last_step = None
        if self.compiled is None:
            self._decide_compile()
        with self._engaged():
            started = time.perf_counter()
            self.fill()
            filled = time.perf_counter()
            if self.rows_running == 0:
                return []
            before = self.rows_running
            self._iterate(config)
            tokens, accepted, tested = self._sync()
            finished = self._retire(before - self.rows_running) if self.rows_running < before else []
            self.loop.timer.collect()
        if self.compiled:
            self._count_fallbacks()
        self.last_step = StepReport(config=config, rows=before, tokens=tokens, seconds=time.perf_counter() - filled,
                                    prefill_seconds=filled - started, accepted=accepted, tested=tested,
                                    finished=len(finished))
        return finished

    def finished(self) -> Iterator[FinishedRow]:
        """Rows as they finish, until nothing waits or runs (admitting more meanwhile is fine)."""
        while not self.idle:
            yield from self.step()

    def snapshot(self) -> GenerationStats:
        """The run's batch-level statistics so far (iterations, widths, seconds); rows are not included."""
        self.loop.timer.write(self.stats)
        self.stats.compile_seconds = self.compile_seconds()
        return self.stats

    def _count_fallbacks(self) -> None:
        """GenerationStats.compile_fallbacks: compiled model calls and selections answered eagerly (host ints)."""
        models = [m for m in (self.target, self.draft) if isinstance(m, NativeCausalLM)]
        self.stats.compile_fallbacks = sum(m.compile_fallbacks for m in models) + self.loop.selection_fallbacks
        self.stats.graph_shapes = sum(len(m.state.graph_shapes) for m in models)

    def compile_seconds(self) -> float:
        """Compiled mode: what this process compiled since this batcher's first step (dynamo's timer; 0 eager)."""
        return max(0.0, compile_seconds_so_far() - self._compile_base) if self.compiled else 0.0

    def _decide_compile(self) -> None:
        """Compile the native models now (compile=True), never (False), or when the queued work pays for it
        ("auto": `spectr.native.auto_compile`); decided once, before the first iteration."""
        models = [m for m in (self.target, self.draft) if isinstance(m, NativeCausalLM)]
        if self.compile == "auto":
            queued = sum(r.budget for r in self._waiting) + sum(r.budget for r in self._in_slot if r is not None)
            compiled = bool(models) and auto_compile(self.device, queued, self.batch_size)
        else:
            compiled = bool(models) and self.compile
        self._compile_base = compile_seconds_so_far()
        for model in models:
            model.set_compiled(compiled)  # may refuse (ValueError): then nothing is decided, nothing half set
        draft_cache = getattr(self.rows.drafter, "cache", None)
        for model, cache in ((self.target, self.target_cache), (self.draft, draft_cache)):
            if compiled and isinstance(model, NativeCausalLM) and cache is not None:
                model.take_pool(cache.rows)  # the model's static pool, before any view of the cache is taken
        self.compiled = self.loop.compiled = self.stats.compiled = compiled

    # -- admission -----------------------------------------------------------------------
    def fill(self) -> None:
        """Move waiting prompts into free slots: prefill of those rows only. No host sync."""
        count = min(len(self._free), len(self._waiting))
        if count == 0:
            return
        if self.in_flight == 0:
            self.loop.draft_lag = 0  # every row is new: their draft caches are prefilled, nothing to catch up
        with self._engaged():
            requests = [self._waiting.popleft() for _ in range(count)]
            slots = sorted(heapq.heappop(self._free) for _ in range(count))
            index = torch.tensor(slots, dtype=torch.int64, device=self.device)  # [N]
            prompts = [r.prompt for r in requests]
            self._prefill(slots, requests)
            self._set_warps(index, requests, slots)
            last_tokens = torch.tensor([p[-1] for p in prompts], dtype=torch.int64, device=self.device)  # [N]
            self.rows.admit(index, last_tokens, row_keys([r.seed for r in requests], self.device))
            self.occupied.index_fill_(0, index, True)
            budgets = torch.tensor([r.budget for r in requests], dtype=torch.int64, device=self.device)  # [N]
            self.records.reset(index, budgets)
            if self.records.custom_stops or any(r.stops is not None for r in requests):
                self.records.set_stops(index, [r.stops for r in requests])
        for slot, request in zip(slots, requests):
            self._in_slot[slot] = request
        self._top = max(self._top, slots[-1] + 1)
        self.rows_running += count
        longest = max(len(p) for p in prompts)
        loop = self.loop
        loop.target_longest = max(loop.target_longest, longest - 1)
        loop.draft_extent = (max(loop.draft_extent[0], longest), max(loop.draft_extent[1], 1))
        self.stats.admissions += 1

    def _prefill(self, slots: list[int], requests: list[_Request]) -> None:
        """Prefill the new rows, once per distinct prompt: a row whose prompt a live row or another new row
        already holds copies that row's prompt slots instead (both caches are left-aligned, so a row's
        first len(prompt) - 1 slots are its prompt whatever it generated since). One forward per model
        for the prompts no slot holds; the samples of a prompt share its prefill this way. Rows that ask
        for prompt_logprobs run in a forward of their own that keeps every position's logits (shared only
        with a row of this admission that asks the same), so that the other rows keep only their last."""
        holders = {tuple(r.prompt): slot for slot, r in enumerate(self._in_slot) if r is not None}  # live rows
        copies: list[tuple[int, int, int]] = []  # (source slot, dest slot, prompt length - 1)
        groups: dict[bool, list[tuple[int, _Request]]] = {False: [], True: []}  # keeps logits -> its rows
        asked: dict[tuple, _Request] = {}  # (prompt, N) -> the row of this admission that computes it
        for slot, request in zip(slots, requests):  # admission (host), not the per-iteration loop
            key, wants = tuple(request.prompt), request.prompt_logprobs is not None
            source = asked.get((key, request.prompt_logprobs)) if wants else None
            if self.share_prefill and key in holders and (not wants or source is not None):
                copies.append((holders[key], slot, len(request.prompt) - 1))
                if source is not None:
                    request.prompt_state = source  # filled in below, with the source's forward
            else:
                holders[key] = slot
                groups[wants].append((slot, request))
                if wants:
                    asked[(key, request.prompt_logprobs)] = request
        for keep, rows in groups.items():
            if rows:
                self._prefill_rows([slot for slot, _ in rows], [r for _, r in rows], keep)
        for request in requests:
            if isinstance(request.prompt_state, _Request):
                request.prompt_state = request.prompt_state.prompt_state
        if copies:
            self._copy_prompts(copies)
        self.stats.prefilled_rows += sum(map(len, groups.values()))
        self.stats.shared_prefill_rows += len(copies)

    def _prefill_rows(self, slots: list[int], requests: list[_Request], keep_logits: bool) -> None:
        """One forward per model over these rows' prompts; keep_logits: the target's logits at every prompt
        position become each row's prompt log-probabilities (`prompt_logprob_tensors`, on the device)."""
        index = torch.tensor(slots, dtype=torch.int64, device=self.device)  # [U]
        prompts = [r.prompt for r in requests]
        with self.loop.timer.phase("target"):
            logits = prefill(self.target, self.target_cache, prompts, self.device, rows=index, keep_logits=keep_logits)
            if keep_logits:
                for row, request in enumerate(requests):  # [P, V] each: only the rows that ask
                    request.prompt_state = prompt_logprob_tensors(logits[row], request.prompt,
                                                                  request.prompt_logprobs)
        del logits
        drafter = self.rows.drafter
        if isinstance(drafter, FeatureDrafter):  # the head reads the prompt with the target's features just made
            with self.loop.timer.phase("draft"):
                features = self.target.tap.take() if self.target.tap.features is not None else None
                drafter.prefill_rows(index, prompts, features, [])
        elif drafter is not None:
            with self.loop.timer.phase("draft"):
                prefill(self.draft, drafter.cache, prompts, self.device, rows=index)

    def _copy_prompts(self, copies: list[tuple[int, int, int]]) -> None:
        """Rows whose prompt another slot holds: (source slot, dest slot, prompt length - 1) each."""
        source, dest, lengths = (torch.tensor(c, dtype=torch.int64, device=self.device)
                                 for c in zip(*copies))  # [C] each
        drafter = self.rows.drafter
        caches = [("target", self.target_cache)]
        if drafter is not None and not isinstance(drafter, FeatureDrafter):
            caches.append(("draft", drafter.cache))
        for phase, cache in caches:
            with self.loop.timer.phase(phase):
                cache.rows.copy_rows(source, dest, max(c[2] for c in copies))
                cache.rows.lengths.index_copy_(0, dest, lengths)
        if isinstance(drafter, FeatureDrafter):
            with self.loop.timer.phase("draft"):
                drafter.prefill_rows(dest[:0], [], None, copies)

    def _set_warps(self, index: torch.Tensor, requests: list[_Request], slots: list[int]) -> None:
        """Rows with their own warp: the pool switches to per-row warps (`RowWarps`) on the first one."""
        if self.row_warps is None:
            if all(r.warp is None for r in requests):
                return
            self.row_warps = RowWarps(self.batch_size, self.settings.warp, self.device, self.target.vocab_size)
            self.loop.warp = self.row_warps
            if self.rows.drafter is not None:
                self.rows.drafter.warp = self.row_warps
        warps = [self.settings.warp if r.warp is None else r.warp for r in requests]
        penalised = self.row_warps.path_dependent or any(w.path_dependent for w in warps)
        self.row_warps.set(index, warps, slots, prompts=[r.prompt for r in requests] if penalised else None,
                           stops=[self.settings.eos_ids if r.stops is None else r.stops for r in requests]
                           if penalised else None)  # repetition reads the prompt, min_tokens masks the stops

    # -- one iteration -------------------------------------------------------------------
    def _iterate(self, config: StepConfig) -> None:
        """One iteration of `config` on the slots [0, top), after packing the live rows down if that is due."""
        self.loop.configure(config.method, config.num_drafts, config.draft_length)
        step = speculative_step if config.speculative else autoregressive_step
        live = self.rows_running
        if self._top > live and live <= self.pack_below * self.batch_size:
            self._pack()
        top = self._top
        if self.compiled and shape_rules(self.device):  # CUDA graphs: rows in power-of-2 buckets (masked)
            top = min(self.batch_size, 1 << (top - 1).bit_length())
        if top == self.batch_size:
            step(self.loop, self.rows)
        else:
            part = self.rows.prefix(top)
            step(self.loop, part)
            self.rows.put_prefix(top, part)
            self.stats.narrow_iterations += 1
        self.stats.iterations += 1

    def _pack(self) -> None:
        """Move the highest live rows into the empty slots below the live count (host bookkeeping, no sync)."""
        live = self.rows_running
        holes = [slot for slot in range(live) if self._in_slot[slot] is None]
        sources = [slot for slot in range(self._top - 1, live - 1, -1) if self._in_slot[slot] is not None]
        source = torch.tensor(sources, dtype=torch.int64, device=self.device)  # [M]
        dest = torch.tensor(holes, dtype=torch.int64, device=self.device)  # [M]
        loop = self.loop
        caches = [(self.target_cache.rows, loop.target_longest)]
        if self.rows.drafter is not None:
            caches.append((self.rows.drafter.cache.rows, loop.draft_extent[0]))
        for cache, used in caches:  # every row's used slots are below the host bound of its lengths
            cache.move_rows(source, dest, min(cache.capacity, used))
        self.rows.move(source, dest)
        self.records.move(source, dest)
        if self.row_warps is not None:
            self.row_warps.move(source, dest, (sources, holes))
        self.occupied.index_fill_(0, dest, True)
        self.occupied.index_fill_(0, source, False)
        for slot, hole in zip(sources, holes):
            self._in_slot[hole], self._in_slot[slot] = self._in_slot[slot], None
        self._free = list(range(live, self.batch_size))  # already a heap
        self._top = live
        self.stats.packed_rows += len(holes)

    def _sync(self) -> tuple[int, int, int]:
        """The iteration's host copy: running rows, the longest cache rows (they size the next forwards)
        and the records' totals; returns the tokens, accepted and tested positions of the iteration."""
        extent = torch.stack([self.rows.running.sum(), self.target_cache.rows.lengths.max()])  # [2]
        parts = [extent, self.records.totals(self.occupied)]  # [2], [3]
        if self.rows.drafter is not None:
            parts.append(self.rows.drafter.host_extent())  # [2]
        if self.watch_tokens:  # the rows' newest tokens ride the same copy: [top * (1 + E)]
            parts.append(self.records.recent(self._top).reshape(-1))
        host = torch.cat(parts).tolist()  # the host sync of every iteration (the only one with a single draft)
        if self.watch_tokens:
            self._note_recent(host[len(host) - self._top * (1 + self.records.emit_width):])
        self.rows_running, self.loop.target_longest = host[0], host[1]
        if self.rows.drafter is not None:
            self.loop.draft_extent = (host[5], host[6])
        done = [now - before for now, before in zip(host[2:5], self._totals)]
        self._totals = host[2:5]
        return done[0], done[1], done[2]

    def _note_recent(self, values: list[int]) -> None:
        """recent_tokens from `Records.recent`'s host copy (watching only: a host loop over the slots)."""
        width = 1 + self.records.emit_width
        self.recent_tokens = {}
        for slot in range(self._top):
            request = self._in_slot[slot]
            if request is None:
                continue
            length, tail = values[slot * width], values[slot * width + 1 : (slot + 1) * width]
            new = length - self._seen.get(request.request, 0)
            if new > 0:
                self.recent_tokens[request.request] = tail[len(tail) - new :]
                self._seen[request.request] = length

    # -- retirement ----------------------------------------------------------------------
    def finish_rows(self, requests) -> list[FinishedRow]:
        """End the given rows now (request ids; the caller found a stop string in their tokens): they come
        back finished, reason "stop", and their slots take the next prompts. Rows not running are ignored.
        One host copy of those rows, none when no row is given."""
        wanted = set(requests)
        slots = [slot for slot, r in enumerate(self._in_slot) if r is not None and r.request in wanted]
        if not slots:
            return []
        with self._engaged():
            index = torch.tensor(slots, dtype=torch.int64, device=self.device)  # [S]
            self.rows.running.index_fill_(0, index, False)
            self.records.reason.index_fill_(0, index, STOP)
            rows = self._retire_slots(index)
        self.rows_running -= len(slots)
        return rows

    def _retire(self, count: int) -> list[FinishedRow]:
        """Read back the `count` rows that finished in this iteration and reset their slots."""
        finished = self.occupied & ~self.rows.running  # [B]
        index = torch.argsort((~finished).to(torch.int8), stable=True)[:count]  # [F] finished slots, in order
        return self._retire_slots(index)

    def _retire_slots(self, index: torch.Tensor) -> list[FinishedRow]:
        """Read back the finished rows of slots `index` ([F] int64) and reset those slots."""
        results = self.records.read(index)  # host copy: the finished rows
        broken = [r.slot for r in results if r.error_flags]
        self.occupied.index_fill_(0, index, False)
        caches = [self.target_cache.rows] + ([] if self.rows.drafter is None else [self.rows.drafter.cache.rows])
        for cache in caches:
            cache.reset_rows(index)
            if broken:  # a row with non-finite logits may have left non-finite cache entries
                cache.reset_rows(torch.tensor(broken, dtype=torch.int64, device=self.device), zero=True)
        rows = [self._finished_row(result) for result in results]
        for result in results:  # their counters leave the occupied slots' totals
            self._totals[0] -= len(result.tokens)
            self._totals[1] -= sum(result.accepted_per_position)
            self._totals[2] -= result.tested_positions
        for result in results:
            self._seen.pop(self._in_slot[result.slot].request, None)
            self._in_slot[result.slot] = None
            heapq.heappush(self._free, result.slot)
        while self._top and self._in_slot[self._top - 1] is None:
            self._top -= 1
        return rows

    def _finished_row(self, result: SlotResult) -> FinishedRow:
        request = self._in_slot[result.slot]
        error = None
        if result.error_flags:
            models = [m.description for bit, m in ((TARGET_NONFINITE, self.target), (DRAFT_NONFINITE, self.draft))
                      if result.error_flags & bit]
            error = (f"row {request.request}: the {' and the '.join(models)} produced non-finite logits (NaN or "
                     f"inf) after {len(result.tokens)} generated tokens; the row stopped there")
        finish_reason = result.finish_reason
        grammar_error = None if self.row_warps is None else self.row_warps.grammar_error(result.slot)
        if error is None and grammar_error is not None:  # spectr.structured: a dead end of the row's grammar
            error, finish_reason = f"row {request.request}: {grammar_error}", "error"
        return FinishedRow(request=request.request, tag=request.tag, tokens=result.tokens,
                           finish_reason=finish_reason, target_calls=result.target_calls, error=error,
                           accepted_per_position=result.accepted_per_position,
                           tested_positions=result.tested_positions, tree_nodes=result.tree_nodes,
                           tokens_per_call_histogram=result.tokens_per_call_histogram, logprobs=result.logprobs,
                           top_logprobs=result.top_logprobs,
                           prompt_logprobs=None if request.prompt_state is None else
                           PromptLogprobs.read(request.prompt, request.prompt_state))

    @contextlib.contextmanager
    def _engaged(self):
        """Inference mode, and both models in eval mode (dropout off) for the duration."""
        models = [m.model for m in (self.target, self.draft) if m is not None]
        training = [m.training for m in models]
        try:
            for m, was in zip(models, training):
                if was:
                    m.eval()  # the output law is the model's, not a dropout ensemble's
            with torch.inference_mode():
                yield
        finally:
            for m, was in zip(models, training):
                if was:
                    m.train(True)
