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

The batcher's jobs live in one module each: admission and prefill sharing (`spectr.admission`), packing and
retirement (`spectr.retirement`), the compile decision (`spectr.compile_decision`), the pair's wrapping and
checks (`spectr.pair`); here: the pool, `step` and the iteration. This module knows nothing about tokenizers,
Ray or files: prompts are lists of token ids.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator

import torch

from spectr.admission import Admission, _Request
from spectr.compile_decision import CompileDecision
from spectr.drafting import TreeDrafter
from spectr.feature_draft import FeatureDrafter, FeatureDraftLM
from spectr.iteration import Loop, autoregressive_step, speculative_step
from spectr.native import check_compile, shape_rules
from spectr.pair import feature_tap, known_methods, load_models, model_limit, wrap_model
from spectr.records import Records
from spectr.retirement import FinishedRow, Retirement
from spectr.rows import RowState, prefill, prompt_logprob_tensors
from spectr.settings import Settings
from spectr.stats import GenerationStats, PhaseTimer
from spectr.steps import StepConfig, StepReport
from spectr.warps import RowWarps

# the names callers import from here (the batcher's parts live in their own modules)
__all__ = ["DEFAULT_PACK_BELOW", "ContinuousBatcher", "FinishedRow", "feature_tap", "known_methods", "load_models",
           "model_limit", "wrap_model"]

# Pack live rows into the holes below them when at most this fraction of the slots is live, by device type. On
# the CPU a forward costs about in proportion to its rows, so packing pays as soon as a slot is free (measured:
# benchmarks/results/engine/README.md, "DEFAULT_PACK_BELOW"); on CUDA never (not measured on a GPU yet): see
# the module docstring.
DEFAULT_PACK_BELOW = {"cpu": 1.0}


class ContinuousBatcher(Admission, Retirement, CompileDecision):
    """Rows in flight over one cache pool; see the module docstring. Its parts: `Admission` (admit, fill,
    prefill sharing: `spectr.admission`), `Retirement` (packing, the host copy, retiring rows:
    `spectr.retirement`), `CompileDecision` (`spectr.compile_decision`); here: the pool, `step`, the iteration.

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
