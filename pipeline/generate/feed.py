"""One continuous batch per actor, across its whole queue of shards: `ShardFeed`.

    feed = ShardFeed(target, draft, spectr, eos_token_id, on_rows)
    run = feed.run(shard.index, [Row(position, prompt_ids, budget, seed), ...])  # blocks until done
    run.outcomes[position]   # a spectr.FinishedRow, or the message of a row the engine could not take

A Ray actor runs `generate_shard` on several threads (`max_concurrency = ray.shards_per_actor`): each
thread queues its shard's rows here and waits. Exactly one thread at a time steps the batcher: the
first waiting thread whose shard is not done finds nobody stepping and takes the turn. It moves queued
rows into the batcher's free slots (admission happens only on the stepping thread, so it never races
with `step()`), runs `step()`, and hands every finished row to its shard. A shard whose rows are all
done goes back to its thread at once; that thread gives up the turn (another waiting thread takes it)
and writes its part file while the batch goes on. So the next shard's prompts fill the slots the
current shard's rows leave, and `spectr.batch_size` is the number of rows in flight per actor.

The pool is one `spectr.ContinuousBatcher` (with `spectr.method=auto`, a `spectr.planner.AutoBatcher`:
the same batcher, whose online chooser picks the exact method, K and L of every iteration from what the
real iterations measure; no calibration phase, no drain: the next iteration simply runs another
configuration on the same rows, pool and random streams). It is built once and reused across shards,
and rebuilt only (no new rows go into the old batcher, its rows finish, then the new one is built and
takes the rows that were held back; a rebuilt auto batcher keeps what its chooser learned):
- when a row needs more positions than the pool holds: the capacity is the first shard's longest
  prompt + the largest budget (the input's, when the caller sets `max_budget`; else the first
  shard's), rounded up to a power of two and at most the models' positions; grown the same way;
- (stop strings) a row whose newest tokens complete one of its `Row.stops` ends at once
  (`ContinuousBatcher.finish_rows`): its slot takes the next prompt instead of running to its budget;
- after a `step()` that raised: the rows that were in the batcher are re-run one by one with
  `spectr.generate` (a row's output does not depend on its batch, so this loses nothing), so only a
  row that fails alone gets an error; the next rows go into a fresh batcher. When every one of them
  fails alone too and so does a probe (the first token of one of them, one new token), the error is the
  device's, not the rows' (a sticky CUDA error): no error row is kept, the shard fails with `ActorFault`
  (its neighbours with `FeedAborted`), and the driver re-queues them uncharged and restarts the actor.
A row with `Row.prompt_logprobs` (vLLM's prompt_logprobs=N) is admitted asking for them (the engine keeps its
prefill's logits); re-run alone, it gets them from a forward of its own over the prompt.
A row the engine refuses at admission (an empty prompt, a prompt too long for the model) gets its error alone,
as a `Refusal`: the worker counts it as a failure of the input (a rerun fails it again, so does not redo it).

Statistics of a shard: its rows' own counters, plus the batch-level ones (`iterations`, i.e. batched
target calls, the seconds, and under auto the tokens and seconds per configuration and the wasted
seconds) accumulated since the previous shard ended, charged to the shard that ends; summed over
shards they are the actor's totals. Under auto a shard's `plan` (its part file's `spectr.plan`) is the
mix of configurations the batch ran while the shard's rows were in it.

Not here: reading and writing shards, the contract rows (`pipeline.generate.worker`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.generate.config import SpectrConfig, logprobs_wanted, top_logprobs
from pipeline.generate.mix import ConfigMix
from pipeline.generate.stats import empty_stats

if TYPE_CHECKING:  # spectr (torch) is imported where it runs: on the actors, not on the driver
    from spectr import ContinuousBatcher, FinishedRow

log = logging.getLogger(__name__)

AUTO_MAX_DRAFTS = 8  # method=auto: the planner's bounds when spectr.max_num_drafts / max_draft_length are null
AUTO_MAX_LENGTH = 8
PHASE_FIELDS = ("draft_seconds", "target_seconds", "selection_seconds")
# prefilled_rows / shared_prefill_rows: rows whose prompt ran through the models, and rows that copied the cache of
# the same prompt in the batch instead (the samples of a prompt: one prefill)
BATCH_FIELDS = ("iterations", *PHASE_FIELDS, "compile_seconds", "compile_fallbacks", "prefilled_rows",
                "shared_prefill_rows")


def engine_logprobs(s: SpectrConfig) -> bool | str:
    """The engine's `logprobs` for spectr.logprobs / logprobs_mode: False, "raw" or True (the warped law)."""
    return ("raw" if s.logprobs_mode == "raw" else True) if logprobs_wanted(s) else False


class Refusal(str):
    """The message of a row the engine refused at admission, alone (an empty prompt; prompt + budget over the
    models' positions; its own settings out of range): a property of the row and the job's settings, so the
    same input fails the same way again. The worker counts it as an input failure: a rerun does not regenerate
    its shard for it (`pipeline.generate.manifest.load_state`)."""


class FeedAborted(RuntimeError):
    """A shard that was in the feed when another shard's thread failed: not this shard's fault (the driver
    re-queues it without charging an attempt)."""


class ActorFault(RuntimeError):
    """The actor's device fails whatever it runs (every row of a failed batch, alone too, and a one-token
    probe): not the shard's fault. The driver re-queues the shard uncharged and restarts the actor."""


@dataclass(frozen=True)
class Row:
    """One prompt of a shard: its position in the shard, token ids, budget and seed; `warp` (temperature,
    top_k, top_p) when the row has its own (`data.sampling_params_column`), else the job's."""

    position: int
    prompt: list[int]
    budget: int
    seed: int
    warp: tuple | None = None  # (temperature, top_k, top_p[, min_p, logit_bias, presence_penalty, frequency_penalty,
    # repetition_penalty, min_tokens]): `spectr.SamplingWarp`'s fields, in its order
    stops: tuple[str, ...] = ()  # its stop strings: the row ends once its newest tokens complete one
    stop_ids: tuple[int, ...] | None = None  # the tokens that end it (None: the model's EOS ids); see the worker
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs=N: `FinishedRow.prompt_logprobs` (None: not asked)
    decode_options: tuple = ()  # the row's text options as (key, value) pairs (vLLM's skip_special_tokens, ...):
    # its stop strings are looked for in the text its completion will have

    @property
    def min_tokens(self) -> int:
        """vLLM's min_tokens (the last of `warp`): no stop token, EOS or stop string ends the row before."""
        return self.warp[8] if self.warp is not None and len(self.warp) > 8 else 0


@dataclass(frozen=True)
class EngineConfig:
    """What one batcher is built for: an exact method with K drafts of L tokens, and its capacity."""

    method: str
    num_drafts: int
    draft_length: int
    capacity: int  # max_length: prompt + new tokens of the longest row the pool takes

    @property
    def label(self) -> str:
        return f"{self.method} K={self.num_drafts} L={self.draft_length}"


@dataclass(eq=False)
class ShardRun:
    """One shard in the feed: its rows, what came out of each, its statistics once done."""

    index: int
    rows: list[Row]
    outcomes: dict[int, FinishedRow | str] = field(default_factory=dict)  # position -> row or error message
    admitted: dict[int, float] = field(default_factory=dict)  # position -> perf_counter at admission
    seconds: dict[int, float] = field(default_factory=dict)  # position -> admission to finish (time_taken_s)
    stats: dict[str, Any] = field(default_factory=empty_stats)
    mix: ConfigMix | None = None  # method=auto: the batch's configurations while this shard's rows were in it
    plan: dict[str, Any] | None = None  # method=auto: the part file's `spectr.plan` (set when done)
    done: bool = False
    error: BaseException | None = None


class ShardFeed:
    """Every shard an actor holds, through one continuous batch; see the module docstring."""

    def __init__(self, target: Any, draft: Any, spectr: SpectrConfig, eos_token_id: Any,
                 on_rows: Callable[[int, int], None] | None = None):
        self.target, self.draft, self.spectr, self.eos_token_id = target, draft, spectr, eos_token_id
        self.on_rows = on_rows  # (shard index, rows done): after each step that finished rows
        self._cond = threading.Condition()
        self._incoming: deque[ShardRun] = deque()  # under the lock: shards not looked at yet
        self._stepping = False  # under the lock: a thread holds the turn
        # the stepping thread's state (one thread at a time touches it)
        self._open: set[ShardRun] = set()  # shards taken from the queue and not done
        self._held: deque[tuple[ShardRun, Row]] = deque()  # rows not admitted yet
        self._in_batcher: dict[int, tuple[ShardRun, Row]] = {}  # request id -> its shard and row
        self.batcher: ContinuousBatcher | None = None
        self.config: EngineConfig | None = None
        self._next: EngineConfig | None = None  # drain-then-switch: built once the batcher is idle
        self._limit: int | None = None  # the models' positions
        self.max_budget: int | None = None  # the input's largest budget, when the caller knows it
        self.allocations = 0  # batchers built (cache pools allocated)
        self.warm_states: dict[str, dict[str, Any]] = {}  # method=auto: cached chooser states by entry key
        self.pair_key: str | None = None  # method=auto: the plan cache's pair key (set by the worker)
        self.plan_cache_key: str | None = None  # method=auto: this actor's entry key (set by the worker)
        self.chooser_state: dict[str, Any] | None = None  # method=auto: what the chooser has learned so far
        self._charged = dict.fromkeys(BATCH_FIELDS, 0)  # the current batcher's counters already charged
        self._uncharged = self._zero_batch()
        self.steps = 0  # iterations of the stepping loop so far (the driver's progress watchdog reads it)
        self._uncharged_mix = ConfigMix()
        self._wasted_charged = 0.0
        self.decode: Callable[[list[int]], str] | None = None  # token ids -> text (set by the worker, for stops)
        self.tokenizer: Any = None  # the pair's tokenizer (set by the worker): grammars and bad words need it
        self.tokenizer_lock: Any = threading.Lock()  # the worker's: a fast tokenizer is not re-entrant
        self._grammar_compiler: Any = None  # a `spectr.structured.StructuredCompiler`, made at the first grammar
        self._tails: dict[int, list[int]] = {}  # request id -> its newest tokens (rows with stop strings)
        self._lengths: dict[int, int] = {}  # request id -> its tokens so far (rows with stop strings)

    # -- the shards' threads ----------------------------------------------------------------------
    def run(self, index: int, rows: list[Row]) -> ShardRun:
        """Generate `rows` of shard `index` (in the batch with every other shard's); blocks until done."""
        shard_run = ShardRun(index, rows)
        if not rows:
            shard_run.done = True
            return shard_run
        with self._cond:
            self._incoming.append(shard_run)
            turn = self._wait_for_turn(shard_run)
        if turn:
            try:
                self._drive(shard_run)
            except BaseException as err:  # noqa: BLE001 - every shard in the feed stops; this one is charged
                self._fail_all(err, shard_run)
            finally:
                with self._cond:
                    self._stepping = False
                    self._cond.notify_all()
        if isinstance(shard_run.error, (FeedAborted, ActorFault)):
            raise shard_run.error
        if shard_run.error is not None:
            raise RuntimeError(f"shard {index}: generation failed: {shard_run.error}") from shard_run.error
        return shard_run

    def _wait_for_turn(self, shard_run: ShardRun) -> bool:
        """Under the lock: True when this thread takes the turn, False when its shard is done."""
        while not shard_run.done:
            if not self._stepping:
                self._stepping = True
                return True
            self._cond.wait()
        return False

    def _fail_all(self, err: BaseException, mine: ShardRun) -> None:
        """`mine` (the stepping thread's shard) fails with `err`; the others stop with `FeedAborted`."""
        log.warning("generation failed (%s: %s); every shard in the feed stops", type(err).__name__, err)
        aborted = FeedAborted(f"stopped: shard {mine.index} failed on this actor ({type(err).__name__}: {err})")
        with self._cond:
            runs = [*self._incoming, *self._open]
            self._incoming.clear()
            self._open.clear()
            for shard_run in runs:
                shard_run.error, shard_run.done = (err if shard_run is mine else aborted), True
            self._cond.notify_all()
        self._held.clear()
        self._in_batcher.clear()
        self._retire_batcher()
        self._next = self.config

    # -- the stepping thread ----------------------------------------------------------------------
    def _drive(self, mine: ShardRun) -> None:
        """Step until `mine` is done (this thread holds the turn)."""
        while not mine.done:
            started = time.perf_counter()
            with self._cond:
                incoming, self._incoming = list(self._incoming), deque()
            refused = []
            for shard_run in incoming:
                self._open.add(shard_run)
                for row in shard_run.rows:
                    too_long = self._over_cap(row)
                    if too_long:
                        refused.append((shard_run, row, too_long))
                    else:
                        self._held.append((shard_run, row))
            outcomes = refused + self._feed()
            if not outcomes and (self.batcher is None or self.batcher.idle):
                raise RuntimeError(f"shard {mine.index} has rows that are neither held nor in the batch")
            outcomes += self._step()
            self.steps += 1
            self._uncharged["wall_seconds"] += time.perf_counter() - started
            self._hand_out(outcomes)

    def _feed(self) -> list[tuple[ShardRun, Row, FinishedRow | str]]:
        """Move held rows into the batcher's free slots (building or switching the batcher when due)."""
        outcomes: list[tuple[ShardRun, Row, FinishedRow | str]] = []
        while self._held:
            if self._next is not None:
                if self.batcher is not None and not self.batcher.idle:
                    break  # draining: the held rows wait for the next batcher
                refused = self._build_or_refuse(self._next)
                if refused is not None:
                    outcomes.append(refused)
                    continue
            elif self.batcher is None:
                self._build(self._first_config())
            take, grow = self._admittable()
            if grow is not None:
                self._next = grow
            if not take and grow is None:
                break  # every slot is taken
            outcomes += self._admit(take)
        return outcomes

    def _over_cap(self, row: Row) -> Refusal | None:
        """A row whose prompt + budget exceeds `spectr.max_row_tokens` (the memory a row may take: one such row
        would size the whole pool, batch x positions): its error, counted as the input's."""
        cap, needed = self.spectr.max_row_tokens, len(row.prompt) + row.budget
        if cap is None or needed <= cap:
            return None
        return Refusal(f"MemoryError: the row needs {needed} positions (prompt {len(row.prompt)} + max_tokens "
                       f"{row.budget}), over spectr.max_row_tokens={cap}")

    def _build_or_refuse(self, config: EngineConfig) -> tuple[ShardRun, Row, Refusal] | None:
        """Build the next batcher; when a pool grown for the first held row does not fit in memory, that row is
        refused (its own error, an input failure: not its shard's charge nor its neighbours') and the pool is
        rebuilt at its former size. None when built."""
        former = self.config
        try:
            self._build(config)
            return None
        except Exception as err:  # noqa: BLE001 - only the allocation of a grown pool is answered here
            grown = former is not None and config.capacity > former.capacity and self._held
            if not grown or not _out_of_memory(err):
                raise
            failure = f"{type(err).__name__}: {err}"
        shard_run, row = self._held.popleft()
        log.warning("a pool of %d positions per row does not fit in memory (%s); the row that needs it fails alone",
                    config.capacity, failure)
        self._build(dataclasses.replace(config, capacity=former.capacity))
        message = (f"MemoryError: the row needs {len(row.prompt) + row.budget} positions; a pool of "
                   f"{self.spectr.batch_size} x {config.capacity} does not fit in memory ({failure})")
        return shard_run, row, Refusal(message)

    def _admittable(self) -> tuple[list[tuple[ShardRun, Row]], EngineConfig | None]:
        """The held rows that fit the free slots, and a bigger config if the next one needs it."""
        batcher = self.batcher
        room = batcher.batch_size - batcher.in_flight - batcher.waiting
        take: list[tuple[ShardRun, Row]] = []
        while self._held and len(take) < room:
            needed = len(self._held[0][1].prompt) + self._held[0][1].budget
            if needed > batcher.max_length and (self._limit is None or needed <= self._limit):
                return take, dataclasses.replace(self._next or self.config, capacity=self._capacity(needed))
            take.append(self._held.popleft())
        return take, None

    def _admit(self, take: list[tuple[ShardRun, Row]]) -> list[tuple[ShardRun, Row, FinishedRow | str]]:
        """Queue rows in the batcher; a call it refuses is retried row by row, and a row it refuses alone
        gets the error (nothing of a refused call is queued)."""
        if not take:
            return []
        rows = [row for _, row in take]
        now = time.perf_counter()
        for shard_run, row in take:
            shard_run.admitted.setdefault(row.position, now)
        warps = None
        if any(r.warp is not None for r in rows):
            warps = [None if r.warp is None else self._engine_warp(r.warp) for r in rows]
        stop_ids = [r.stop_ids for r in rows] if any(r.stop_ids is not None for r in rows) else None
        asked = {}  # prompt_logprobs: the engine's own batcher takes them (method=auto: the AutoBatcher's)
        if any(r.prompt_logprobs is not None for r in rows):
            asked = {"prompt_logprobs": [r.prompt_logprobs for r in rows]}
        engine = getattr(self.batcher, "batcher", self.batcher) if asked else self.batcher
        try:
            ids = engine.admit([r.prompt for r in rows], max_new_tokens=[r.budget for r in rows],
                               seed=[r.seed for r in rows], warps=warps, stop_token_ids=stop_ids, **asked)
        except ValueError as err:
            if len(take) == 1:
                return [(take[0][0], take[0][1], Refusal(f"{type(err).__name__}: {err}"))]
            return [outcome for item in take for outcome in self._admit([item])]
        self._in_batcher.update(zip(ids, take))
        if self.decode is not None and any(r.stops for r in rows):
            getattr(self.batcher, "batcher", self.batcher).watch_tokens = True  # stop strings: watch the tokens
        return []

    def _step(self) -> list[tuple[ShardRun, Row, FinishedRow | str]]:
        if self.batcher is None or self.batcher.idle:
            return []
        try:
            finished = self.batcher.step()
        except Exception as err:  # noqa: BLE001 - isolated below: the rows are re-run one by one
            failure = f"{type(err).__name__}: {err}"
        else:
            if self.config.method == "auto":
                self._note_step()
            finished += self._stopped()
            for row in finished:
                self._tails.pop(row.request, None)
                self._lengths.pop(row.request, None)
            return [(*self._in_batcher.pop(row.request), row) for row in finished]
        return self._recover(failure)  # outside the except block: the traceback no longer holds the pool

    def _stopped(self) -> list[FinishedRow]:
        """Rows whose newest tokens complete one of their stop strings end now, not at their budget: the
        tokens came back with the iteration's one host copy (`ContinuousBatcher.recent_tokens`), so this
        adds no device read. A stop spanning tokens is found in the text of the row's last tokens (its
        longest stop's length in tokens, plus this iteration's); the worker then cuts the completion. As vLLM's,
        a stop string counts once it ends in the text of a token after the row's first min_tokens
        (`pipeline.stops.stop_at`)."""
        from pipeline.stops import stop_at

        engine = getattr(self.batcher, "batcher", self.batcher)  # method=auto: the AutoBatcher's own batcher
        if self.decode is None or not getattr(engine, "watch_tokens", False):
            return []
        found = []
        for request, tokens in engine.recent_tokens.items():
            entry = self._in_batcher.get(request)
            if entry is None or not entry[1].stops:
                continue
            tail = self._tails.setdefault(request, [])
            tail.extend(tokens)
            del tail[: max(0, len(tail) - len(tokens) - max(map(len, entry[1].stops)) - 1)]
            length = self._lengths[request] = self._lengths.get(request, 0) + len(tokens)
            min_tokens = entry[1].min_tokens
            if length <= min_tokens:
                continue  # no stop string counts yet
            early = max(0, min_tokens - (length - len(tail)))  # the tail's tokens among the first min_tokens
            options = dict(entry[1].decode_options)
            after = len(self.decode(tail[:early], **options)) if early else 0
            if stop_at(self.decode(tail, **options), entry[1].stops, after) is not None:
                found.append(request)
        return engine.finish_rows(found) if found else []

    def _recover(self, failure: str) -> list[tuple[ShardRun, Row, FinishedRow | str]]:
        """A step raised: rebuild the batcher later, and run the rows that were in it alone, now."""
        affected = list(self._in_batcher.values())
        log.warning("a batch of %d rows failed (%s); running them one by one", len(affected), failure)
        self._in_batcher.clear()
        config, alone = self.config, self._alone_config()
        self._retire_batcher()
        self._next = self._next or config
        outcomes = [(shard_run, row, self._alone(alone, row)) for shard_run, row in affected]
        if affected and all(isinstance(outcome, str) for _, _, outcome in outcomes):
            probe = self._alone(alone, dataclasses.replace(affected[0][1], prompt=affected[0][1].prompt[:1] or [0],
                                                           budget=1, stops=()))
            if isinstance(probe, str):  # the device fails whatever it runs: the actor's fault, not the rows'
                raise ActorFault(f"every row of a failed batch ({len(affected)}) fails alone, and so does a "
                                 f"one-token probe: {probe}")
        return outcomes

    def _alone_config(self) -> EngineConfig:
        """The configuration a row re-run alone uses: the batcher's, or under auto the chooser's current one."""
        if self.config.method != "auto" or self.batcher is None:
            return self.config
        current = self.batcher.chooser.current
        return dataclasses.replace(self.config, method=current.method, num_drafts=max(1, current.num_drafts),
                                   draft_length=max(1, current.draft_length))

    def _engine_warp(self, fields: tuple) -> Any:
        """`spectr.SamplingWarp(*fields)` with what needs the tokenizer: its grammar compiled by this actor's
        `spectr.structured.StructuredCompiler` (the vocabulary given to llguidance once, each grammar once), its bad
        words tokenized as vLLM's (`spectr.bad_words.bad_words_token_ids`). ValueError: the row's problem."""
        from spectr import SamplingWarp

        warp = SamplingWarp(*fields)
        if self.tokenizer is None:
            return warp
        if warp.structured is not None and warp.structured.compiler is None:
            if self._grammar_compiler is None:
                from spectr.structured import StructuredCompiler

                with self.tokenizer_lock:
                    self._grammar_compiler = StructuredCompiler(self.tokenizer,
                                                                vocab_size=self.target.config.vocab_size)
            warp = dataclasses.replace(warp, structured=warp.structured.with_compiler(self._grammar_compiler))
        strings = [w for w in warp.bad_words if isinstance(w, str)]
        if strings:
            from spectr.bad_words import bad_words_token_ids

            with self.tokenizer_lock:
                ids = bad_words_token_ids(strings, self.tokenizer)
            warp = dataclasses.replace(warp, bad_words=ids + tuple(w for w in warp.bad_words if not isinstance(w, str)))
        return warp

    def _alone(self, config: EngineConfig, row: Row) -> FinishedRow | str:
        """One row through `spectr.generate`: its tokens are those it gets in any batch."""
        import spectr

        s = self.spectr
        try:
            w = self._engine_warp(row.warp or (s.temperature, s.top_k, s.top_p))
            output = spectr.generate(
                self.target, None if config.method == "autoregressive" else self.draft, [row.prompt],
                method=config.method, num_drafts=config.num_drafts, draft_length=config.draft_length,
                max_new_tokens=[row.budget], temperature=w.temperature, top_k=w.top_k, top_p=w.top_p,
                eos_token_id=self.eos_token_id if row.stop_ids is None else list(row.stop_ids), seed=[row.seed],
                logprobs=engine_logprobs(s), top_logprobs=top_logprobs(s), min_p=w.min_p,
                logit_bias=dict(w.logit_bias) or None, presence_penalty=w.presence_penalty,
                frequency_penalty=w.frequency_penalty, repetition_penalty=w.repetition_penalty,
                min_tokens=w.min_tokens, allowed_token_ids=list(w.allowed_token_ids) or None,
                bad_words=[[list(word) for word in w.bad_words]] if w.bad_words else None,
                structured_outputs=None if w.structured is None else [w.structured],
                tokenizer=None if w.structured is None else w.structured.compiler,
            )  # fmt: skip
        except Exception as err:  # noqa: BLE001 - this row's own failure: its error row
            return f"{type(err).__name__}: {err}"
        stats = output.stats
        for name in BATCH_FIELDS:
            self._uncharged[name] += getattr(stats, name)
        prompt_logprobs = None
        if row.prompt_logprobs is not None:  # its own forward over the prompt (this path is a batch's recovery)
            from spectr.rows import prompt_logprobs_alone

            prompt_logprobs = prompt_logprobs_alone(self.target, row.prompt, row.prompt_logprobs)
        return spectr.FinishedRow(
            request=-1, tag=None, tokens=list(output.tokens[0]), finish_reason=stats.finish_reason[0],
            target_calls=stats.target_calls[0], error=stats.errors[0],
            accepted_per_position=list(stats.accepted_per_position), tested_positions=stats.tested_positions,
            tree_nodes=stats.tree_nodes, tokens_per_call_histogram=list(stats.tokens_per_call_histogram),
            logprobs=None if output.logprobs is None else output.logprobs[0],
            top_logprobs=None if output.top_logprobs is None else output.top_logprobs[0],
            prompt_logprobs=prompt_logprobs,
        )  # fmt: skip

    def _hand_out(self, outcomes: list[tuple[ShardRun, Row, FinishedRow | str]]) -> None:
        """Give finished rows to their shards; report progress; close the shards that are complete."""
        counts: dict[ShardRun, int] = {}
        now = time.perf_counter()
        for shard_run, row, outcome in outcomes:
            shard_run.outcomes[row.position] = outcome
            shard_run.seconds[row.position] = now - shard_run.admitted.get(row.position, now)
            counts[shard_run] = counts.get(shard_run, 0) + 1
        for shard_run, count in counts.items():
            if self.on_rows is not None:
                self.on_rows(shard_run.index, count)
        for shard_run in counts:
            if len(shard_run.outcomes) == len(shard_run.rows):
                self._close(shard_run)

    def _close(self, shard_run: ShardRun) -> None:
        """The shard's statistics (its rows, and the batch counters not charged yet); then it is done."""
        stats = shard_run.stats
        for outcome in shard_run.outcomes.values():
            if not isinstance(outcome, str):
                add_row(stats, outcome)
        self._fold_batcher()
        for name, value in self._uncharged.items():
            stats[name] = stats.get(name, 0) + value
        inside = sum(stats[name] for name in PHASE_FIELDS)
        stats["other_seconds"] = max(0.0, stats["wall_seconds"] - inside)
        self._uncharged = self._zero_batch()
        if self.spectr.method == "auto":
            self._close_auto(shard_run)
        self._open.discard(shard_run)
        with self._cond:
            shard_run.done = True
            self._cond.notify_all()

    # -- the pool -----------------------------------------------------------------------------------
    def _first_config(self) -> EngineConfig:
        """The first batcher: sized for the first shard's rows (method=auto: K and L are its bounds)."""
        from spectr.batching import model_limit, wrap_model

        s = self.spectr
        first = [row for shard_run, row in self._held if shard_run is self._held[0][0]]
        self._limit = model_limit([wrap_model(self.target, "target"), wrap_model(self.draft, "draft")])
        fits = [r for r in first if self._limit is None or len(r.prompt) + r.budget <= self._limit]
        budget = max([r.budget for r in fits] + [self.max_budget or 0], default=1)
        capacity = self._capacity(max((len(r.prompt) for r in fits), default=1) + budget)
        if s.method != "auto":
            return EngineConfig(s.method, s.num_drafts, s.draft_length, capacity)
        return EngineConfig("auto", s.max_num_drafts or AUTO_MAX_DRAFTS, s.max_draft_length or AUTO_MAX_LENGTH, capacity)

    def _capacity(self, needed: int) -> int:
        capacity = max(2, 1 << (max(needed, 2) - 1).bit_length())
        if self.spectr.max_row_tokens is not None:  # the memory cap (configured, or the GPU's: the worker's)
            capacity = min(capacity, max(2, self.spectr.max_row_tokens))
        return capacity if self._limit is None else min(capacity, self._limit)

    def _build(self, config: EngineConfig) -> None:
        from spectr import ContinuousBatcher
        from spectr.batching import model_limit

        self._retire_batcher()
        s = self.spectr
        common = dict(batch_size=s.batch_size, max_length=config.capacity, temperature=s.temperature, top_k=s.top_k,
                      top_p=s.top_p, eos_token_id=self.eos_token_id, logprobs=engine_logprobs(s),
                      compile=s.compile, top_logprobs=top_logprobs(s))  # fmt: skip
        if config.method == "auto":
            from spectr.planner import AutoBatcher

            self.batcher = AutoBatcher(self.target, self.draft, max_num_drafts=config.num_drafts,
                                       max_draft_length=config.draft_length, warm_state=self._warm_state(), **common)
            self._wasted_charged = 0.0
        else:
            self.batcher = ContinuousBatcher(self.target, self.draft, method=config.method,
                                             num_drafts=config.num_drafts, draft_length=config.draft_length, **common)
        self.allocations += 1
        self.config, self._next = config, None
        self._limit = model_limit([m for m in (self.batcher.target, self.batcher.draft) if m is not None])
        self._charged = dict.fromkeys(BATCH_FIELDS, 0)
        log.info("continuous batch: %s, %d slots x %d positions", config.label, s.batch_size, self.batcher.max_length)

    def _retire_batcher(self) -> None:
        """Charge what the batcher counted so far, and let its pool go."""
        if self.batcher is not None:
            try:
                self._fold_batcher()
            except Exception as err:  # noqa: BLE001 - a broken batcher's counters are not worth a failure
                log.warning("statistics of a failed batch lost (%s)", err)
        self.batcher = None

    def _fold_batcher(self) -> None:
        if self.batcher is None:
            return
        snapshot = self.batcher.snapshot()
        for name in BATCH_FIELDS:
            now = getattr(snapshot, name)
            self._uncharged[name] += now - self._charged[name]
            self._charged[name] = now

    @staticmethod
    def _zero_batch() -> dict[str, float]:
        return {"iterations": 0, **dict.fromkeys(PHASE_FIELDS, 0.0), "compile_seconds": 0.0, "compile_fallbacks": 0, "wall_seconds": 0.0,
                "predicted_seconds": 0.0, "prefilled_rows": 0, "shared_prefill_rows": 0}

    # -- method=auto ----------------------------------------------------------------------------------
    def _warm_state(self) -> dict[str, Any] | None:
        """What a new auto batcher starts from: its predecessor's chooser (a rebuilt pool), else the cache."""
        if self.chooser_state is not None:
            return self.chooser_state
        if self.plan_cache_key is None:
            from pipeline.generate.plan_cache import entry_key
            from pipeline.generate.stats import device_kind

            dtype = str(self.target.dtype).removeprefix("torch.")
            self.plan_cache_key = entry_key(self.pair_key or "", device_kind(str(self.target.device)), dtype)
        return self.warm_states.get(self.plan_cache_key)

    def _note_step(self) -> None:
        """After an auto iteration: its configuration's tokens and seconds, for the batch and the open shards."""
        report = self.batcher.last_step
        if report is None:
            return
        label, tokens, seconds = report.config.label, report.tokens, report.seconds
        self._uncharged_mix.add(label, tokens, seconds)
        predicted = self.batcher.chooser.predicted_tokens_per_s  # its prediction for this iteration
        if predicted > 0:
            self._uncharged["predicted_seconds"] += tokens / predicted
        for shard_run in self._open:
            if shard_run.mix is None:
                shard_run.mix = ConfigMix()
            shard_run.mix.add(label, tokens, seconds)

    def _close_auto(self, shard_run: ShardRun) -> None:
        """A shard ends under auto: the batch's mix and wasted seconds since the last shard end, the chooser's
        choice (its predictions, iteration by iteration, are in `predicted_seconds`), and the part file's
        plan (the mix while the shard's rows were in the batch)."""
        stats, mix = shard_run.stats, self._uncharged_mix
        stats.update(mix.to_dict())
        self._uncharged_mix = ConfigMix()
        chooser = getattr(self.batcher, "chooser", None)
        if chooser is None:
            return
        wasted = float(chooser.wasted_seconds)
        stats["wasted_seconds"] = max(0.0, wasted - self._wasted_charged)
        self._wasted_charged = wasted
        current = chooser.current
        stats["plan"] = current.label
        stats["plan_choice"] = {"method": current.method, "num_drafts": current.num_drafts,
                                "draft_length": current.draft_length}
        self.chooser_state = chooser.state()
        own = shard_run.mix or ConfigMix()
        shard_run.plan = {"method": "auto", "choice": current.label, "description": own.describe(),
                          "shares": own.shares(), **own.to_dict()}


def _out_of_memory(err: BaseException) -> bool:
    """A failed allocation: torch's OutOfMemoryError (CUDA, or a CPU allocator's), or MemoryError."""
    return isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError" or "out of memory" in str(err)


def add_row(stats: dict[str, Any], row: FinishedRow) -> None:
    """Add one finished row's own counters to a shard's statistics (lists element-wise)."""
    stats["generated_tokens"] += row.generated_tokens
    stats["target_calls"] += row.target_calls
    stats["tested_positions"] += row.tested_positions
    for name in ("accepted_per_position", "tokens_per_call_histogram"):
        mine, theirs = list(stats[name]), list(getattr(row, name))
        width = max(len(mine), len(theirs))
        mine += [0] * (width - len(mine))
        theirs += [0] * (width - len(theirs))
        stats[name] = [a + b for a, b in zip(mine, theirs)]
