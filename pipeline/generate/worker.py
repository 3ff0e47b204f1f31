"""The stateful predictor each Ray actor runs: load the pair once, then turn shards into part files.

`ShardGenerator(model, spectr, num_threads, device, on_batch, job)` loads the target, the draft and the
target's tokenizer in `__init__`. For the job, `generate_shard(task)` does all the row work of one shard on
the worker: it reads the shard's rows from the input (`pipeline.generate.shards.load_shard`), renders chat
messages and tokenizes, generates, and writes the part file to the output filesystem itself; it returns
only a `ShardResult` of statistics, the file's name, size and row count (never the rows). `__call__(shard)`
is the in-memory core (a `Shard` in, contract rows out) that tests call directly without Ray;
`pipeline.generate.scheduler` wraps the class with `ray.remote`.

Generation is one continuous batch per actor across all the shards it holds (`pipeline.generate.feed`):
the scheduler queues `ray.shards_per_actor` shards on an actor, which runs them on as many threads; each
thread's prompts join the actor's one `spectr.ContinuousBatcher` (`spectr.batch_size` rows in flight, one
cache pool), and a shard is written as soon as its own rows are done, while the others' go on.

A batch step that fails is isolated by re-running its rows one by one, so that only a failing row gets
`finish_reason="error"` and the message; a prompt the engine refuses (too long for the model) gets its
error alone; a row the engine stopped (non-finite logits) keeps its tokens and the engine's message; a
row the input reading already found unusable (a null prompt, malformed chat messages) is written the
same way without being generated. This class does not talk to MLflow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pipeline import busy
from pipeline.config import DataConfig, ModelConfig
from pipeline.generate.config import SpectrConfig, logprobs_wanted, top_logprobs
from pipeline.generate.feed import AUTO_MAX_DRAFTS, AUTO_MAX_LENGTH, Refusal, Row, ShardFeed
from pipeline.generate.memory import device_memory, kv_bytes_per_position, memory_message, memory_row_cap
from pipeline.generate.shards import Shard, ShardTask, load_shard
from pipeline.generate.stats import ResourceMeter, device_kind, empty_stats, merge_stats
from pipeline.redact import install_log_filter
from pipeline.source import Source

log = logging.getLogger(__name__)

@dataclass
class ShardResult:
    index: int
    rows: list[dict[str, Any]] | None  # only from `__call__`; the job's results carry no rows
    stats: dict[str, Any]  # see `empty_stats`
    worker: dict[str, Any] = field(default_factory=dict)  # node, pid, device: where it ran
    num_rows: int = 0
    failed: int = 0  # rows with finish_reason=error
    failed_input: int = 0  # of which the input's own (unreadable record, unusable prompt): a retry fails them again
    file: str = ""  # the part file's name in the output directory
    bytes: int = 0  # and its size
    plan: dict[str, Any] | None = None  # method=auto: the configurations that generated the shard (`with_plan`)
    attempt: int = 0  # the task's attempt (`ShardTask.attempt`; its fence names the file)
    planner_state: dict[str, Any] | None = None  # method=auto: {"key": cache entry key, "state": the chooser's}
    inputs: list[int] | None = None  # only from `__call__`: each output row's row of the shard (n rows per row)
    first_errors: list[list[Any]] = field(default_factory=list)  # [id, error] of its first failed rows (FIRST_ERRORS)


@dataclass(frozen=True)
class WorkerJob:
    """What a worker needs to read and write shards itself (sent once, when the actor starts)."""

    data: DataConfig
    source: Source
    output_uri: str
    part_digits: int
    schema: Any  # pyarrow.Schema of the part files, with the run's settings in its metadata
    plan_pair: str = ""  # method=auto: the plan cache's pair key (`pipeline.generate.plan_cache`)
    plan_states: dict[str, Any] = field(default_factory=dict)  # method=auto: cached chooser states by entry key
    spectr: SpectrConfig | None = None  # the job's engine settings: an actor built for another (kept) takes them
    lease_token: str = ""  # the job's lease: a part is written only while the job holds the directory ('' no check)
    model_fingerprints: dict[str, Any] = field(default_factory=dict)  # {role: tensor_fingerprint} of the plan's pair


class MemoryRefusal(ValueError):
    """A row whose pool could never fit in the actor's GPU memory (`pipeline.generate.memory`): its error row,
    counted as a failure of its input (a rerun does not redo it)."""


class ModelMismatch(RuntimeError):
    """The pair this actor loaded is not the one the job was planned with (another copy on this node, or files
    rewritten since): it generates nothing."""


PLAN_METADATA_KEY = b"spectr.plan"
FIRST_ERRORS = 3  # failed rows a shard's result names (the job's last lines name the job's first few)
ERROR_CHARS = 500  # of each one's message


def with_plan(schema: Any, plan: dict[str, Any] | None) -> Any:
    """The part file's schema, with what method=auto ran (its mix of configurations) under `spectr.plan`."""
    if plan is None:
        return schema
    import json

    return schema.with_metadata({**(schema.metadata or {}), PLAN_METADATA_KEY: json.dumps(plan).encode()})


IO_TICK_S = 1.0  # while a worker's read or write runs, one tick of progress (pipeline.busy) this often
IO_LIMIT_S = 600.0  # an I/O call that has not returned after this long no longer counts: a hang, restarted


@contextlib.contextmanager
def io_progress() -> Iterator[None]:
    """A slow read or write (a row group from a far store, the lease check, a part upload) is work, not a hang:
    while the block runs, a daemon thread ticks the stall watchdog's progress (`pipeline.busy.advance`) every
    `IO_TICK_S`, for at most `IO_LIMIT_S` (a call hung past that is left to the watchdog: the actor is
    restarted, its shards re-queued)."""
    done = threading.Event()

    def tick() -> None:
        deadline = time.monotonic() + IO_LIMIT_S
        while not done.wait(IO_TICK_S) and time.monotonic() < deadline:
            busy.advance()

    thread = threading.Thread(target=tick, name="io-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=1.0)  # no tick lands after the block (it would count a later block's progress)


def first_errors(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """[id, error] of the first `FIRST_ERRORS` rows with finish_reason=error (what the job's last lines name)."""
    failed = (row for row in rows if row["finish_reason"] == "error")
    return [[row["id"], str(row["error"])[:ERROR_CHARS]] for _, row in zip(range(FIRST_ERRORS), failed)]


class ShardGenerator:
    """Holds one draft/target pair; turns a shard into output rows (and, for the job, a part file)."""

    def __init__(
        self,
        model: ModelConfig,
        spectr: SpectrConfig,
        num_threads: int | None = None,
        device: str | None = None,
        on_batch: Any = None,
        job: WorkerJob | None = None,
        data: DataConfig | None = None,
    ):
        """on_batch(shard_index, rows): called as a shard's rows finish (the driver's progress bar), from
        the actor's stepping thread; an exception in it is logged and ignored: progress must never fail
        generation.
        job: what `generate_shard` needs (the pool sends it with each shard instead, by reference).
        data: where rows' own settings are when there is no job (the Ray Data stage, `pipeline.ray_data`)."""
        init_started = time.time()
        import torch

        from pipeline import models
        from pipeline.prompts import ReadCache

        install_log_filter()  # the actor's log (Ray forwards it to the driver) masks credentials too
        busy.watch_compiles()  # a compile reports itself to the ping: the stall watchdog does not take it for a hang
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu" and num_threads:
            torch.set_num_threads(int(num_threads))
        self.device = device
        self.spectr = spectr
        self.on_batch = on_batch
        self.job = job
        self.data = data
        self._job_ref: Any = None
        self._job_lock = threading.Lock()  # the shards' threads fetch the job (and take its settings) once
        self.cache = ReadCache()
        # the shards' threads share the read cache and the tokenizer (a fast tokenizer is not re-entrant)
        self._text_lock = threading.Lock()
        self._shard_steps = 0  # shards read and written (progress outside the engine's iterations)
        self.tokenizer = models.load_tokenizer(
            models.check_model_dir(model.target, "model.target", model.allow_pickle),
            "model.target",
            model.trust_remote_code,
        )
        # model.device_map=auto with several GPUs: the target split over them (pipeline.placement), the draft whole
        gpus = torch.cuda.device_count() if device.startswith("cuda") else 0
        plan = models.target_plan(model.target, model, gpus)
        if plan is not None:
            log.info("model.device_map=auto: the target is split over the actor's %d GPUs", gpus)
        before = self._fingerprints(model)
        self.target = models.load_model(model.target, model, device, plan=plan)
        self.draft = models.load_model(model.draft, model, device)
        after = self._fingerprints(model)  # the same before and after: the files loaded are these
        self.model_fingerprints = after if after == before else {"changed while loading": True}
        self._models_checked: Any = None  # the WorkerJob whose fingerprints this pair matched
        self.eos_token_id = models.eos_token_ids_of(self.target, self.tokenizer)  # every EOS id
        self._memory = device_memory(device) if plan is None else None  # (free, total) before any pool
        self.memory_cap: int | None = None  # the most positions a row may need on this GPU (None: no cap)
        self._new_feed(spectr)
        self.startup = {"load_s": time.time() - init_started}  # torch, the stack's imports, the pair's load

    @staticmethod
    def _fingerprints(model: ModelConfig) -> dict[str, Any]:
        from pipeline import models
        from pipeline.hashing import tensor_fingerprint

        return {role: tensor_fingerprint(models.check_model_dir(path, f"model.{role}", model.allow_pickle))
                for role, path in (("target", model.target), ("draft", model.draft))}

    def _check_models(self, job: WorkerJob) -> None:
        """Raise ModelMismatch unless the pair loaded here is the job's, tensor for tensor (once per job)."""
        if not job.model_fingerprints or self._models_checked is job:
            return
        import socket

        for role, wanted in job.model_fingerprints.items():
            here = self.model_fingerprints.get(role)
            if here != wanted:
                files = sorted(n for n in set(wanted) | set(here or {}) if (here or {}).get(n) != wanted.get(n))
                why = "its files changed while it loaded" if "changed while loading" in self.model_fingerprints \
                    else f"files that differ: {', '.join(files[:3])}"
                raise ModelMismatch(f"model.{role}: the model this actor loaded on host {socket.gethostname()} is not "
                                    f"the one the job was planned with ({why}); every node needs the same copy, "
                                    "unchanged while the job runs")
        self._models_checked = job

    def _new_feed(self, spectr: SpectrConfig) -> None:
        """One continuous batch (one cache pool) for every shard this actor holds, built at the first shard."""
        self.spectr = spectr
        self.memory_cap = self._row_cap(spectr)
        caps = [cap for cap in (spectr.max_row_tokens, self.memory_cap) if cap is not None]
        pool = dataclasses.replace(spectr, max_row_tokens=min(caps)) if caps else spectr  # the pool's bound too
        self.feed = ShardFeed(self.target, self.draft, pool, self.eos_token_id, on_rows=self._report_rows)
        self.feed.decode = self._decode  # stop strings end rows early (pipeline.generate.feed)
        self.feed.tokenizer, self.feed.tokenizer_lock = self.tokenizer, self._text_lock  # grammars, bad words

    def device_memory(self, free_bytes: int, total_bytes: int) -> None:
        """Admit rows against a GPU with these free and total bytes (what `torch.cuda.mem_get_info()` said when the
        pair was loaded; tests inject it): a new feed with the cap, called while the actor holds no shard."""
        self._memory = (int(free_bytes), int(total_bytes))
        self._new_feed(self.spectr)

    def _row_cap(self, spectr: SpectrConfig) -> int | None:
        """The most positions a row may need on this actor's GPU (`memory_row_cap`); None: not measured, or
        no row of the models' positions is over it."""
        if self._memory is None:
            return None
        from spectr.batching import model_limit, wrap_model

        try:
            kv_bytes = kv_bytes_per_position(self.target) + kv_bytes_per_position(self.draft)
        except ValueError as err:
            log.warning("rows are not admitted against the GPU's memory: %s", err)
            return None
        if spectr.method == "auto":
            tree = (spectr.max_num_drafts or AUTO_MAX_DRAFTS) * (spectr.max_draft_length or AUTO_MAX_LENGTH)
        else:
            tree = spectr.num_drafts * spectr.draft_length
        limit = model_limit([wrap_model(self.target, "target"), wrap_model(self.draft, "draft")])
        cap = memory_row_cap(*self._memory, kv_bytes, spectr.batch_size, tree, limit)
        if cap is not None:
            log.info("GPU memory: rows of at most %d positions (prompt + max_tokens) fit a pool of %d rows", cap,
                     spectr.batch_size)
        return cap

    def _check_memory(self, shard: Shard, i: int, settings: Any) -> None:
        """MemoryRefusal when row i needs more positions than this GPU's pool can hold for any row."""
        cap = self.memory_cap
        if cap is None:
            return
        needed = len(shard.prompt_token_ids[i]) + (settings.max_tokens or self._budget(shard, i))
        if needed > cap:
            raise MemoryRefusal(f"row {shard.ids[i]!r}: " + memory_message(needed, cap, *self._memory,
                                                                           self.spectr.batch_size))

    def reconfigure(self, spectr: SpectrConfig) -> dict[str, Any]:
        """The next sweep cell on this actor (`pipeline.generate.keep`): its engine settings, with the pair
        loaded already. A new feed (a new batch, statistics from zero) on the same models; called while the
        actor holds no shard. Returns `ready()`, whose startup then says that nothing was loaded."""
        started = time.time()
        self._new_feed(spectr)
        self._shard_steps = 0
        self.startup = {"load_s": 0.0, "reconfigure_s": time.time() - started}
        return self.ready()

    def ready(self) -> dict[str, Any]:
        """Where this generator runs (called once so that load errors surface before any shard)."""
        import socket

        import ray
        import torch

        node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        return {
            "host": socket.gethostname(),
            "node_id": node_id,
            "pid": os.getpid(),
            "device": self.device,
            "device_kind": device_kind(self.device),
            "torch_threads": torch.get_num_threads(),
            "startup": getattr(self, "startup", {}),  # the actor's own seconds: imports and loading the pair
        }

    def ping(self) -> dict[str, Any]:
        """The heartbeat the driver polls (in its own concurrency group, so it answers mid-shard). The answer
        proves the process is alive; `progress` (engine iterations + shards read + shards written + long reads
        and compiles, `pipeline.busy`) proves that it works: the driver replaces a busy actor whose progress
        stays put for `ray.stall_timeout_s`, not counting the time of a compile (`compiling_s`)."""
        work = busy.report()
        return {"time": time.time(), "progress": self.feed.steps + self._shard_steps + work["busy_ticks"],
                "compiling_s": work["compiling_s"], "pid": os.getpid()}

    def generate_shard(self, task: ShardTask, job_ref: list[Any] | None = None) -> ShardResult:
        """Read, generate and write one shard; return its statistics and the part file's name and size.

        job_ref: [ObjectRef of the WorkerJob] (nested, so that Ray passes the reference, not the object):
        fetched from the object store once per actor process, a restarted one included."""
        from pipeline import fs
        from pipeline.generate.lease import check_holder
        from pipeline.generate.output import write_shard

        if job_ref is not None and job_ref[0] != self._job_ref:
            self._take_job(job_ref[0])
        job = self.job
        if job is None:
            raise RuntimeError(
                "ShardGenerator.generate_shard needs a `job` (at construction or with the shard)"
            )
        self._check_models(job)  # no row from a pair other than the plan's
        with self._text_lock, io_progress():
            shard = load_shard(task, job.source, self.tokenizer, job.data, self.spectr.seed, self.cache)
        self._shard_steps += 1
        self.feed.max_budget = job.source.max_budget  # the pool is sized for the input's largest budget
        self.feed.pair_key, self.feed.warm_states = job.plan_pair, job.plan_states  # method=auto: warm start
        result = self(shard)
        output = fs.resolve(job.output_uri, "output_dir")
        schema = with_plan(job.schema, result.plan)  # method=auto: the plan that generated this shard
        with io_progress():  # a slow store's check and upload are work for the stall watchdog
            if job.lease_token:  # a late writer of a job that no longer holds the directory writes nothing
                check_holder(output, job.lease_token)
            result.file, result.bytes = write_shard(
                output, task.index, result.rows, schema, job.part_digits, task.fence
            )  # named for the attempt: a late writer never replaces the part the commit log names
        self._shard_steps += 1
        result.rows, result.attempt = None, task.attempt  # the driver gets statistics only
        return result

    def _take_job(self, ref: Any) -> None:
        """The job's WorkerJob, once per job and process; a process Ray restarted with the arguments it was
        first built with (an earlier sweep cell's settings) takes the job's own before its first shard."""
        import ray

        with self._job_lock:
            if ref == self._job_ref:
                return  # another shard's thread took it
            job = ray.get(ref)
            if job.spectr is not None and job.spectr != self.spectr:
                self._new_feed(job.spectr)
            self.job, self._job_ref = job, ref

    def __call__(self, shard: Shard) -> ShardResult:
        """One shard's contract rows, generated in the actor's continuous batch (`ShardFeed.run` blocks until
        this shard's rows are done; other shards' rows may share the batch meanwhile)."""
        from spectr import FinishedRow

        started, meter = time.perf_counter(), ResourceMeter(self.device)
        slots: list[tuple[int, int]] = []  # position -> (row, sample index): the output's order
        by_position: dict[int, dict[str, Any]] = {}
        rows: list[Row] = []
        stops: dict[int, list[str]] = {}
        own: dict[int, Any] = {}  # row -> its RowSettings (stop tokens, include_stop_str_in_output)
        failed_input = 0
        for i in range(len(shard)):
            try:
                settings = self._settings(shard, i)
                samples = self._sample_range(shard, i, settings)
                self._check_memory(shard, i, settings)
            except ValueError as err:
                failed = self._failed_range(shard, i)  # a failed row: its error on each sample the plan counted
                failed_input += len(failed)  # its record, its own settings, its n or its memory: a rerun fails it again
                for sample in failed:
                    by_position[len(slots)] = self._error_row(shard, i, str(err), sample)
                    slots.append((i, sample))
                continue
            stops[i] = list(self.spectr.stop or ()) + settings.stop
            own[i] = settings
            rows += self._samples(shard, i, settings, samples, len(slots))
            slots += [(i, sample) for sample in samples]
        run = self.feed.run(shard.index, rows)
        seeds = {r.position: r.seed for r in rows}
        with self._text_lock:
            for position, outcome in run.outcomes.items():
                i, sample = slots[position]
                if isinstance(outcome, FinishedRow):
                    row = self._row(shard, i, outcome, sample, stops[i], own[i])
                else:
                    row = self._error_row(shard, i, outcome, sample)
                    failed_input += isinstance(outcome, Refusal)  # the engine refused the row: its input's fault
                row["time_taken_s"] = run.seconds.get(position)
                row["seed"] = seeds.get(position, row["seed"])  # the seed this sample was generated with
                by_position[position] = row
        out = [by_position[p] for p in range(len(slots))]
        stats = merge_stats(empty_stats(), run.stats)
        stats["prompts_failed"] = sum(row["finish_reason"] == "error" for row in out)
        stats["prompts_completed"] = len(out) - stats["prompts_failed"]
        stats["shard_seconds"] = time.perf_counter() - started
        stats["resources"] = meter.usage()  # per worker, not summed (merge_stats leaves it alone)
        return ShardResult(
            index=shard.index,
            rows=out,
            stats=stats,
            worker=self.ready(),
            num_rows=len(out),
            failed=stats["prompts_failed"],
            failed_input=failed_input,
            plan=run.plan,
            planner_state=self._planner_state(),
            inputs=[i for i, _ in slots],
            first_errors=first_errors(out),
        )

    def _planner_state(self) -> dict[str, Any] | None:
        """method=auto: what this actor's chooser has learned, keyed for the plan cache (the driver saves it)."""
        feed = self.feed
        if feed.chooser_state is None or feed.plan_cache_key is None:
            return None
        return {"key": feed.plan_cache_key, "state": feed.chooser_state}

    def _settings(self, shard: Shard, i: int) -> Any:
        """Row i's own settings (`data.sampling_params_column`, `data.stop_column`); ValueError: its problem."""
        from pipeline.row_columns import RowSettings, row_settings

        problem = shard.problem(i)
        if problem:
            raise ValueError(problem)
        data = self.job.data if self.job is not None else self.data
        extras = shard.extras or {}
        if data is None or not (data.sampling_params_column or data.stop_column):
            return RowSettings().over(self.spectr)  # the job's spectr.min_p, penalties, stop_token_ids, ...
        params = extras.get(data.sampling_params_column, [None] * len(shard))[i] if data.sampling_params_column else None
        stop = extras.get(data.stop_column, [None] * len(shard))[i] if data.stop_column else None
        try:
            settings = row_settings(params, stop, f"data.sampling_params_column '{data.sampling_params_column}'",
                                    f"data.stop_column '{data.stop_column}'")
        except ValueError as err:
            raise ValueError(f"row {shard.ids[i]!r}: {err}") from None
        own, settings = settings, settings.over(self.spectr)  # a row's own value replaces the job's
        budget = settings.max_tokens or self._budget(shard, i)
        if settings.min_tokens > budget:  # vLLM's rule: min_tokens <= max_tokens
            source = "" if own.min_tokens is not None else " of spectr.min_tokens"
            raise ValueError(f"row {shard.ids[i]!r}: min_tokens ({settings.min_tokens}{source}) must be <= the "
                             f"row's max_tokens ({budget})")
        return settings

    def _sample_range(self, shard: Shard, i: int, settings: Any) -> range:
        """The sample indices of row i this shard generates: the shard's range [a, b) of the row's n samples
        (its own `n`, else `spectr.num_samples`). ValueError: a row whose n the job's plan did not place (over
        `data.max_samples` when the user set it: the plan places every n the scan found otherwise)."""
        n = self.spectr.num_samples if settings.n is None else settings.n
        data = self.job.data if self.job is not None else None  # the Ray Data stage places any n (no plan)
        if data is not None:
            placed = self._placed(data)
            if n > placed:
                key = "data.max_samples" if data.max_samples else "spectr.num_samples (data.max_samples unset)"
                raise ValueError(f"row {shard.ids[i]!r}: n={n} is more samples than the job's plan places per "
                                 f"prompt: {key} = {placed}, the most a row may ask for; raise data.max_samples, "
                                 f"or set it to null (the plan then places every row's n of "
                                 f"{data.sampling_params_column!r})")
        return self._in_shard(shard, n)

    def _failed_range(self, shard: Shard, i: int) -> range:
        """A failed row's sample indices in this shard: its own n when it has a usable one the plan placed
        (`params_n`, as the scan counted it), else the job's n."""
        from pipeline.row_columns import params_n

        data = self.job.data if self.job is not None else None
        n = None
        if data is not None and data.sampling_params_column:  # an unreadable record's value is None: the job's n
            n = params_n((shard.extras or {}).get(data.sampling_params_column, [None] * len(shard))[i])
            if n is not None and n > self._placed(data):
                n = None
        return self._in_shard(shard, self.spectr.num_samples if n is None else n)

    def _placed(self, data: Any) -> int:
        """Samples per prompt the job's plan placed (`data.max_samples`: the plan sets it)."""
        return data.max_samples or self.spectr.num_samples

    @staticmethod
    def _in_shard(shard: Shard, n: int) -> range:
        """Of a row's n samples, the indices this shard holds."""
        stop = n if shard.sample_stop is None else min(n, shard.sample_stop)
        return range(shard.sample_start, stop)

    def _samples(self, shard: Shard, i: int, settings: Any, samples: range, first: int) -> list[Row]:
        """Row i's engine rows for `samples`, at positions from `first`: seeds from (the row's seed, the
        sample index), whatever shard holds the sample."""
        from pipeline.generate.shards import sample_seed

        s = self.spectr
        warp = settings.engine_warp(s)  # None: the job's temperature / top_k / top_p and nothing else
        budget = settings.max_tokens or self._budget(shard, i)
        seed = shard.seeds[i] if settings.seed is None else settings.seed
        stops = tuple(s.stop or ()) + tuple(settings.stop)
        stop_ids = settings.stop_ids(self.eos_token_id)  # None: the model's EOS ids end the row
        prompt = settings.prompt_ids(shard.prompt_token_ids[i])  # vLLM's truncate_prompt_tokens
        return [Row(first + k, prompt, budget, sample_seed(seed, sample), warp, stops, stop_ids,
                    prompt_logprobs=settings.prompt_logprobs,
                    decode_options=tuple(settings.decode_options().items()) if stops else ())
                for k, sample in enumerate(samples)]

    def _budget(self, shard: Shard, i: int) -> int:
        """Row i's max_new_tokens: its `data.max_new_tokens_column` value, else `spectr.max_new_tokens`."""
        budgets = shard.max_new_tokens
        return int(budgets[i]) if budgets is not None and budgets[i] is not None else self.spectr.max_new_tokens

    def _report_rows(self, shard_index: int, rows: int) -> None:
        if self.on_batch is None:
            return
        try:
            self.on_batch(shard_index, rows)
        except Exception as err:  # noqa: BLE001 - progress is best effort
            log.warning("progress report failed (%s: %s); generation goes on", type(err).__name__, err)

    def _decode(self, ids: list[int], **options) -> str:
        """Token ids -> text, as the completion is decoded (the feed's stop check, on the stepping thread):
        special tokens skipped unless the row's `options` say otherwise."""
        with self._text_lock:
            return self.tokenizer.decode(ids, **{"skip_special_tokens": True, **options})

    def _row(self, shard: Shard, i: int, finished: Any, sample: int = 0, stops: list[str] | None = None,
             settings: Any = None) -> dict[str, Any]:
        """Row i from its `spectr.FinishedRow`; a row the engine stopped (non-finite logits) keeps its
        tokens so far, finish_reason "error" and the engine's message. As vLLM's: finish_reason "stop" for an
        end-of-sequence token, a stop token (stop_reason: its id as text) or a stop string (stop_reason: the
        string; the completion is cut before it, or after it with include_stop_str_in_output:
        `pipeline.stops`), "length" for the budget."""
        from pipeline.generate.output import with_vllm_fields
        from pipeline.stops import cut_at_stop

        tokens = [int(t) for t in finished.tokens]
        logprobs = finished.logprobs
        top = getattr(finished, "top_logprobs", None)
        calls = int(finished.target_calls)
        reason = str(finished.finish_reason)
        stop_reason = stop_token_id = None
        options = {"skip_special_tokens": True} if settings is None else settings.decode_options()

        def decode(ids):
            return self.tokenizer.decode(ids, **options)

        include = bool(settings is not None and settings.include_stop_str_in_output)
        min_tokens = (settings.min_tokens or 0) if settings is not None else 0  # stop strings count after them
        cut = cut_at_stop(decode, tokens, stops or [], include=include, min_tokens=min_tokens) \
            if reason != "error" else None
        if cut is not None:
            tokens, reason, stop_reason = tokens[: cut.num_tokens], "stop", cut.stop
            logprobs = None if logprobs is None else logprobs[: cut.num_tokens]
            top = None if top is None else top[: cut.num_tokens]
        elif reason == "eos":  # the engine's end-of-sequence: the model's EOS, or one of the row's stop tokens
            reason = "stop"
            last = tokens[-1] if tokens else None
            eos = set(self.eos_token_id or []) if settings is None or not settings.ignore_eos else set()
            if settings is not None and last in (settings.stop_token_ids or ()) and last not in eos:
                stop_reason, stop_token_id = str(last), last
        row = {
            "id": shard.ids[i],
            "prompt": shard.prompts[i],
            "completion": cut.text if cut is not None else decode(tokens),
            "completion_token_ids": tokens,
            "prompt_tokens": len(shard.prompt_token_ids[i]),
            "completion_tokens": len(tokens),
            "finish_reason": reason,
            "stop_reason": stop_reason,
            "stop_token_id": stop_token_id,
            "target_calls": calls,
            "block_efficiency": len(finished.tokens) / calls if calls else 0.0,
            "seed": shard.seeds[i],
            "error": finished.error,
            "sample_index": sample,
        }
        if logprobs_wanted(self.spectr):
            row["completion_logprobs"] = logprobs
        if top_logprobs(self.spectr):
            row["completion_top_logprobs"] = [[{"token_id": i, "logprob": v} for i, v in entries]
                                              for entries in (top or [])]
        prompt = shard.prompt_token_ids[i] if settings is None else settings.prompt_ids(shard.prompt_token_ids[i])
        row = with_vllm_fields(row, finished, settings, prompt, self.spectr.logprobs)
        return self._with_extras(shard, i, row)

    def _with_extras(self, shard: Shard, i: int, row: dict[str, Any]) -> dict[str, Any]:
        """The row with its `data.keep_columns` (and the seed it was generated with)."""
        from pipeline.row_columns import carried

        source = self.job.source if self.job is not None else None
        if source is not None and shard.extras:
            for name, arrow_type in source.columns.kept:
                row[name] = carried(shard.extras[name][i], source.format, arrow_type)
        return row

    def _error_row(self, shard: Shard, i: int, message: str, sample: int = 0) -> dict[str, Any]:
        row = {
            "id": shard.ids[i],
            "prompt": shard.prompts[i],
            "completion": "",
            "completion_token_ids": [],
            "prompt_tokens": len(shard.prompt_token_ids[i]),
            "completion_tokens": 0,
            "finish_reason": "error",
            "stop_reason": None,
            "target_calls": 0,
            "block_efficiency": None,
            "seed": shard.seeds[i],
            "error": message,
            "sample_index": sample,
        }
        return self._with_extras(shard, i, row)
