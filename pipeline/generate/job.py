"""The generation job, as the driver runs it: plan, take the lease, start actors, commit shards, summarise.

    report = run_generate(config)   # prepare -> MLflow run -> lease -> Ray actors -> shards -> summary

Each step lives in its own module: the plan (`plan`), the lease (`lease`), Ray and the pool's size
(`cluster`), handing out shards (`scheduler`), the actors, which read their rows and write their part files
(`worker`), the commit log (`commit_log`), the files (`output`, `manifest`), MLflow (`tracking`), the
progress bar (`progress`) and the summary (`summary`). This module only puts them in order. The driver holds
no rows: it receives each shard's statistics, file name and size, and appends them to the commit log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from pipeline import fs
from pipeline.errors import JobFailedError, JobInputError
from pipeline.generate import plan_cache
from pipeline.generate.cluster import actor_resources, ray_session
from pipeline.generate.commit_log import (
    CommitWriter,
    compact_commit_log,
    fenced,
    open_commit_log,
    read_commit_records,
)
from pipeline.generate.config import GenerateConfig
from pipeline.generate.keep import PairKeeper, pair_key
from pipeline.generate.lease import Lease
from pipeline.generate.manifest import JOB_FIRST_ERRORS, incomplete_shards, keep_first_errors
from pipeline.generate.output import (
    SUCCESS_NAME,
    output_schema,
    remove_stale_temporaries,
    remove_success,
    remove_uncommitted_parts,
    write_success,
)
from pipeline.generate.plan import JobPlan, prepare, samples_line
from pipeline.generate.progress import ProgressBar
from pipeline.generate.scheduler import RunHooks, ShardActorPool, ShardQueue
from pipeline.generate.stats import empty_stats, merge_stats
from pipeline.generate.summary import JobSummary, format_report
from pipeline.generate.tracking import NullTracker, make_tracker
from pipeline.generate.worker import ShardResult, WorkerJob
from pipeline.models import check_model_dir
from pipeline.redact import install_log_filter
from pipeline.source import list_source
from pipeline.tracking import reachable

__all__ = ["JobPlan", "JobReport", "RunHooks", "format_report", "prepare", "raise_if_failed", "run_generate"]

log = logging.getLogger("pipeline")


@dataclass
class JobReport:
    plan: JobPlan
    summary: JobSummary
    run_id: str | None
    tracking_uri: str | None
    exit_code: int
    messages: list[str] = field(default_factory=list)
    tracker_lines: list[tuple[str, str]] = field(default_factory=list)  # where the MLflow run is
    total_s: float = 0.0  # run_generate's wall time, including the final MLflow logging
    logging_s: float = 0.0  # the final MLflow logging (metrics, artifacts, plot)
    mlflow_dropped: int = 0  # live MLflow points never sent (a slow or down server; the final ones are logged)


@dataclass
class GenerationRun:
    """What this invocation generated (a resumed job's earlier shards are in `plan.state`, not here)."""

    stats: dict[str, Any] = field(default_factory=empty_stats)  # summed over the shards this run wrote
    planner_states: dict[str, Any] = field(default_factory=dict)  # method=auto: the actors' latest, by cache key
    shards_written: int = 0
    num_actors: int = 0
    device: str = "-"
    generation_started: float = 0.0
    generation_s: float = 0.0
    startup_phases: dict[str, float] = field(default_factory=dict)  # seconds per phase (`startup_line`)
    live: Any = None  # the live MLflow metrics, stopped once the results are written (they never wait on MLflow)
    first_errors: list[tuple[int, Any, str]] = field(default_factory=list)  # (shard, id, error): the first few


def startup_phases(checked_s: float, ray_s: float, actors_s: float, workers: list[dict[str, Any]],
                   waiting_mlflow_s: float, mlflow_s: float | None, ray_during_check: bool = False) -> dict[str, float]:
    """Seconds per startup phase, from the job's start: the config and input check (`checked_s`, its end);
    Ray's start (`ray_s`, Ray up); the actors (`actors_s`, from the later of the two to all loaded), split into
    their own import-and-load seconds (the slowest actor's) and the rest (spawning them, Ray's scheduling);
    MLflow's run creation (it overlaps the actors' loading) and how long the driver then still waited for it.

    ray_during_check: Ray started while the driver checked the input (`run_generate`): the phases that add up
    are Ray's start and the wait for the check's end after it ("check_wait"); the check's own seconds are
    shown as overlapped."""
    load = max((float(w.get("startup", {}).get("load_s", 0.0)) for w in workers), default=0.0)
    if ray_during_check:
        phases = {"ray_start": ray_s, "check_wait": max(0.0, checked_s - ray_s), "check": checked_s}
    else:
        phases = {"check": checked_s, "ray_start": max(0.0, ray_s - checked_s)}
    phases.update({"actor_spawn": max(0.0, actors_s - load), "actor_load": min(load, actors_s),
                   "mlflow_wait": waiting_mlflow_s})
    if mlflow_s is not None:
        phases["mlflow_start"] = mlflow_s
    return phases


def startup_line(phases: dict[str, float]) -> str:
    """One line: where the startup went (the phases that add up, then what overlapped them: the check when Ray
    started during it, MLflow's start)."""
    overlapping = "check_wait" in phases  # the check ran while Ray started
    order = ("ray_start", "check_wait") if overlapping else ("check", "ray_start")
    own = [k for k in (*order, "actor_spawn", "actor_load", "mlflow_wait") if k in phases]
    total = sum(phases[k] for k in own)
    parts = " + ".join(f"{k.replace('_', ' ')} {phases[k]:.1f}" for k in own)
    aside = [f"check {phases['check']:.1f} s"] if overlapping else []
    aside += [f"mlflow start {phases['mlflow_start']:.1f} s"] if "mlflow_start" in phases else []
    overlapped = f" ({', '.join(aside)}, overlapped)" if aside else ""
    return f"startup {total:.1f} s = {parts}{overlapped}"


def quiet_libraries(verbose: bool) -> None:
    """Without `verbose`, the libraries' INFO lines stay out of the job's output (MLflow's database creation and
    system-metrics messages, Ray's start); their warnings and errors still show."""
    level = logging.INFO if verbose else logging.WARNING
    if not verbose:
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # read when mlflow is first imported
    for name in ("mlflow", "ray"):  # and for an mlflow imported already
        logging.getLogger(name).setLevel(level)


def run_generate(config: GenerateConfig, hooks: RunHooks | None = None, keep: PairKeeper | None = None) -> JobReport:
    """Run the whole job. Raises JobInputError (before anything starts) for bad input.

    keep: a sweep's cells (`pipeline.generate.keep`): Ray and the actors stay up for the next cell, and this
    one runs on the last cell's when it has the same pair (None: both shut down at the end)."""
    started = time.perf_counter()
    install_log_filter()  # no URI's password in the log
    quiet_libraries(config.verbose)
    with contextlib.ExitStack() as ray_early:  # Ray, when it started during the check (`_check`)
        return _run(config, hooks, keep, _Startup(started, ray_early))


@dataclass
class _Startup:
    """When the job started, and the Ray it started while checking the input (shut down by `_generate`, or at
    the job's end)."""

    started: float
    ray_early: contextlib.ExitStack
    ray_ready_s: float | None = None  # Ray up, seconds from `started`, when it started during the check


def _run(config: GenerateConfig, hooks: RunHooks | None, keep: PairKeeper | None, startup: _Startup) -> JobReport:
    plan = _check(config, keep, startup)
    done = plan.state.rows_done
    unit = "prompts" if plan.output_rows == plan.num_rows else "rows"  # output rows: prompts x samples
    log.info(
        "checked config, models and %s in %.1f s; %d of %d shards to generate%s",
        samples_line(plan),
        plan.checked_s,  # the check's own seconds (Ray may have started meanwhile)
        plan.shards_to_do,
        plan.num_shards,
        (f" (resuming: {done} {unit} already done)" if done else "") + (f"; {plan.limit_note}" if plan.limit_note else ""),
    )
    tracking = _TrackingStart(plan)
    try:
        return _execute(plan, tracking, hooks, startup, keep)
    except BaseException:
        if tracking.started_ok():
            tracking.result().fail()
        raise


def _check(config: GenerateConfig, keep: PairKeeper | None, startup: _Startup) -> JobPlan:
    """The config and input check (`prepare`, MLflow's server reachable). When the job will start Ray itself,
    it starts it meanwhile: the cheap checks first (the input listed, both model directories), so that a typo
    is refused before Ray starts; then the rest of the check (tokenizers, the input's scan) on a thread while
    this thread starts Ray. ray.init stays on this thread: Ray's processes end when the thread that started
    them ends. A refused job waits for Ray's start and shuts it down."""
    if not _starts_ray(config, keep):
        plan = _prepare_checked(config)
        plan.checked_s = time.perf_counter() - startup.started
        return plan
    list_source(config.data)
    for key, path in (("model.target", config.model.target), ("model.draft", config.model.draft)):
        check_model_dir(path, key, config.model.allow_pickle)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="check") as checking:
        checked = checking.submit(_prepare_checked, config, startup.started)
        startup.ray_early.enter_context(_ray_session(config, keep))
        startup.ray_ready_s = time.perf_counter() - startup.started
        return checked.result()


def _prepare_checked(config: GenerateConfig, started: float | None = None) -> JobPlan:
    plan = prepare(config)
    plan.mlflow_down = _mlflow_check(config)
    if started is not None:
        plan.checked_s = time.perf_counter() - started
    return plan


def _mlflow_check(config: GenerateConfig) -> str | None:
    """The tracking server's store, read once (bounded by mlflow.shutdown_timeout_s): None when it answers;
    a server that does not answer, or answers 5xx, is a warning and the job goes on without MLflow (with
    `mlflow.required`, a refusal: exit 2); a 4xx the user can fix is a refusal (`reachable`)."""
    down = reachable(config.mlflow, timeout_s=config.mlflow.shutdown_timeout_s)
    if down and getattr(config.mlflow, "required", False):
        raise JobInputError(f"mlflow.tracking_uri: {down} (mlflow.required=true)")
    if down:
        log.warning("mlflow: %s; the job goes on without MLflow (its results are in the output directory)", down)
    return down


def _starts_ray(config: GenerateConfig, keep: PairKeeper | None) -> bool:
    """Whether this job starts (or joins) Ray itself, so that Ray's start can overlap the check: not when this
    process is connected already (a notebook, a test session, the sweep's next cell), nor when the output
    directory holds a finished job (a re-run that most likely has nothing to generate starts no Ray)."""
    import ray

    if ray.is_initialized():
        return False
    if config.output_dir:
        try:
            return not fs.exists(fs.resolve(config.output_dir, "output_dir").child(SUCCESS_NAME))
        except JobInputError:
            return False  # the check names what is wrong with output_dir
    return True


def _ray_session(config: GenerateConfig, keep: PairKeeper | None) -> contextlib.AbstractContextManager:
    """The job's Ray: the sweep keeper's (kept for the next cell), or a session of its own."""
    return keep.ray_session(config.ray, config.verbose) if keep else ray_session(config.ray, config.verbose)


class _TrackingStart:
    """The job's MLflow run, started on a thread of its own once the actors are spawned (`begin`): MLflow's
    import, store creation (a new SQLite database takes seconds) and run then overlap the actors' loading,
    not Ray's start or the check on the driver's critical path. `result()` begins it when nothing did, and
    waits for it at most `mlflow.shutdown_timeout_s` after the actors are up (MLflow's client retries a
    request for minutes): a start not done by then is given up, a warning, and the job goes on without MLflow
    (a run it creates later is ended FAILED). The thread is a daemon: a hanging server never holds the end."""

    def __init__(self, plan: JobPlan):
        self._plan = plan
        self._future: Future | None = None
        self._given_up: Any = None  # the NullTracker that stands in for a start given up
        self._lock = threading.Lock()

    def begin(self) -> None:
        if self._future is None:
            plan = self._plan
            tags = {"output_dir": str(plan.output_dir), "config_hash": plan.config_hash}
            self._future = Future()
            threading.Thread(target=self._start, args=(plan, _params(plan), tags), name="mlflow-start",
                             daemon=True).start()

    def _start(self, plan: JobPlan, params: dict[str, Any], tags: dict[str, str]) -> None:
        try:
            tracker = _make_and_start_tracking(plan, params, tags)
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread (JobInputError: exit 2)
            self._future.set_exception(err)
            return
        with self._lock:
            late = self._given_up is not None
            self._future.set_result(tracker)
        if late and tracker.run_id:  # the job went on without it: the run it made is not this job's record
            _best_effort("mlflow: ending the run that started too late", tracker.fail, attempts=1)

    def result(self) -> Any:
        self.begin()
        timeout_s = self._plan.config.mlflow.shutdown_timeout_s
        try:
            return self._future.result(timeout=timeout_s)
        except FutureTimeout:
            pass
        with self._lock:
            if self._future.done():
                return self._future.result()
            if self._given_up is None:
                log.warning("mlflow: the run's start did not finish in %g s (mlflow.shutdown_timeout_s; the tracking "
                            "server is slow or down): the job goes on without MLflow", timeout_s)
                self._given_up = NullTracker()
            return self._given_up

    def started_ok(self) -> bool:
        return self._future is not None and self._future.done() and self._future.exception() is None


def _make_and_start_tracking(plan: JobPlan, params: dict[str, Any], tags: dict[str, str]) -> Any:
    if plan.mlflow_down:  # the check found no answering server: no run (a warning said so)
        return NullTracker()
    began = time.perf_counter()
    tracker = _start_tracking(make_tracker(plan.config.mlflow, plan), params, tags)
    if getattr(tracker, "start_s", None) is not None:
        tracker.start_s = time.perf_counter() - began  # the startup line's "mlflow start": the store's creation too
    return tracker


def _start_tracking(tracker: Any, params: dict[str, Any], tags: dict[str, str]) -> Any:
    """Start (or continue) the job's MLflow run; the tracker the job then logs to. A run MLflow refuses
    to create (`JobInputError`: exit 2 before anything is generated) stops the job; any other failure
    (MLflow's client has already retried its requests) is a warning, and the job goes on without MLflow:
    bookkeeping never fails a job."""
    started = time.perf_counter()
    try:
        tracker.start(params=params, tags=tags)
        tracker.start_s = time.perf_counter() - started  # the startup line's "mlflow start"
        return tracker
    except JobInputError:
        raise
    except Exception as err:  # noqa: BLE001 - the output directory is the result; MLflow reports on it
        log.warning("mlflow: job start failed (%s: %s); the job goes on without MLflow", type(err).__name__, err)
        _best_effort("mlflow: ending the run that failed to start", tracker.fail, attempts=1)
        return NullTracker()


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("spectr-pipeline", "torch", "transformers", "ray"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "unknown"
    return found


def _params(plan: JobPlan) -> dict[str, Any]:
    params = plan.config.to_dict()
    params["output_dir"] = plan.output_dir
    params["config_hash"] = plan.config_hash
    params["num_prompts"] = plan.num_rows
    return params


def _open_output(plan: JobPlan) -> None:
    """Once the actors are up (under the lease): the manifest, and no leftovers of a killed run."""
    remove_stale_temporaries(plan.output)
    dropped = compact_commit_log(plan.output) if plan.manifest_on_disk else 0
    if dropped:
        log.info("compacted the commit log (%d superseded record(s) dropped)", dropped)
    if not plan.manifest_on_disk:
        plan.manifest.save(plan.output)
        plan.manifest_on_disk = True
    if plan.shards_to_do and plan.state.has_success:
        remove_success(plan.output)  # shards are regenerated: not a success until this run says so


def _execute(plan: JobPlan, tracking: _TrackingStart, hooks: RunHooks | None, startup: _Startup,
             keep: PairKeeper | None = None) -> JobReport:
    started = startup.started
    schema = output_schema(plan.id_kind, _schema_settings(plan), logprobs=plan.config.spectr.logprobs,
                           kept=plan.source.columns.kept)
    with Lease.acquire(plan.output, plan.config.lease_timeout_s) as lease:
        plan.lease = lease
        plan.refresh()  # the directory as it is now that this job holds it
        if plan.shards_to_do:
            run = _generate(plan, schema, tracking, hooks, startup, keep)
        else:
            startup.ray_early.close()  # nothing to generate: a Ray started during the check is not needed
            _open_output(plan)
            run = GenerationRun()
        tracker = tracking.result()
        startup_s = run.generation_started - started if run.generation_started else 0.0
        return _finish(plan, tracker, run, started, startup_s)


def _schema_settings(plan: JobPlan) -> dict[str, Any]:
    """The run-level settings in each part file's schema metadata (not the file lists: they can be long)."""
    settings = {k: v for k, v in plan.settings.items() if k not in ("inputs", "models")}
    return {**settings, "config_hash": plan.config_hash, "versions": _versions()}


def _worker_job(plan: JobPlan, schema: Any) -> WorkerJob:
    pair = plan_cache.pair_key(plan)
    states = plan_cache.load_states(plan, pair) if plan.config.spectr.method == "auto" else {}
    return WorkerJob(plan.config.data, plan.source, plan.output.uri, plan.manifest.part_digits, schema, pair, states,
                     plan.config.spectr, lease_token=plan.lease.holder.token if plan.lease is not None else "",
                     model_fingerprints=plan.model_fingerprints)


def _generate(
    plan: JobPlan, schema: Any, tracking: _TrackingStart, hooks: RunHooks | None, startup: _Startup,
    keep: PairKeeper | None = None,
) -> GenerationRun:
    """Start the actors (or, in a sweep, take the last cell's), then generate every shard still to do."""
    import ray

    config = plan.config
    started = startup.started
    with startup.ray_early if startup.ray_ready_s is not None else _ray_session(config, keep):
        resources = actor_resources(config.ray, ray.cluster_resources(), plan.shards_to_do)
        count, cpus_each, gpus_each = resources
        kept = keep.take(pair_key(config, resources)) if keep else None
        ray_ready = started + startup.ray_ready_s if startup.ray_ready_s is not None else time.perf_counter()
        log.info("ray ready (%.1f s); %s %d actor(s)", ray_ready - started,
                 "the last sweep cell's pair stays loaded on its" if kept else "starting", count)
        spawning = time.perf_counter()
        pool = ShardActorPool(config, count, cpus_each, gpus_each, _worker_job(plan, schema), kept=kept,
                              fence_sick=hooks.fence_sick if hooks else None)
        tracking.begin()  # MLflow's start overlaps the actors' loading
        ended = False
        try:
            run = _generate_on(pool, plan, schema, tracking, hooks, startup, resources, ray_ready, spawning)
            ended = True
            return run
        finally:
            if keep is not None and ended:
                keep.hold(pair_key(config, resources), pool)  # for the next cell, when it ended clean
            else:
                pool.shutdown()


def _generate_on(
    pool: ShardActorPool, plan: JobPlan, schema: Any, tracking: _TrackingStart, hooks: RunHooks | None,
    startup: _Startup, resources: tuple[int, float, float], ray_ready: float, spawning: float,
) -> GenerationRun:
    """Wait for the pool's actors (`resources`: their count, CPUs and GPUs each; spawned at `spawning`), then
    generate every shard still to do on them."""
    count, cpus_each, gpus_each = resources
    started = startup.started
    workers = pool.wait_ready()
    loaded = time.perf_counter()
    log.info("actors loaded the pair (%.1f s)", loaded - started)
    tracker = tracking.result()  # MLflow's start overlapped the actors' loading
    if tracker.run_id:
        log.info("mlflow run %s (%.1f s)", tracker.run_id, time.perf_counter() - started)
    # the actors' phases run from the later of Ray's start and the check's end (the lease, the job's schema
    # and the actors' spawning after it count as spawning)
    actors_from = max(ray_ready, started + plan.checked_s)
    phases = startup_phases(plan.checked_s, ray_ready - started, loaded - actors_from, workers,
                            time.perf_counter() - loaded, getattr(tracker, "start_s", None),
                            ray_during_check=startup.ray_ready_s is not None)
    log.info("%s", startup_line(phases))
    _open_output(plan)
    _within(plan.config.mlflow.shutdown_timeout_s, "mlflow: job start", _best_effort, "mlflow: job start",
            tracker.job_started, count, workers)  # tags; the run file (bounded: the actors are waiting)
    if hooks and hooks.on_actors_ready:
        hooks.on_actors_ready(pool.actors, workers)
    device = (
        f"{workers[0]['device']} ({cpus_each:g} CPU, {gpus_each:g} GPU, "
        f"{workers[0]['torch_threads']} torch threads each)"
    )
    run = GenerationRun(num_actors=len(workers), device=device, startup_phases=phases)
    _run_shards(plan, pool, schema, hooks, run, tracker)
    return run


def _run_shards(
    plan: JobPlan, pool: ShardActorPool, schema: Any, hooks: RunHooks | None, run: GenerationRun, tracker: Any
):
    """Every shard to do through the pool; each result is committed (appended to the log) as it arrives,
    and fed to the live MLflow metrics."""
    config = plan.config
    bar = ProgressBar(plan.output_rows, plan.state.rows_done, config.progress, hooks.on_progress if hooks else None)
    run.generation_started = time.perf_counter()
    # appended on a thread of its own (a slow store never holds the scheduling thread), under the lease
    commits = CommitWriter(open_commit_log(plan.output), check=plan.lease.confirm)  # the lease read before each append
    unfenced = [True]  # until the run's first record, its fence (`commit_log.fenced`), is submitted
    live = tracker.live_metrics([plan.state.earlier_stats], started=run.generation_started)

    def on_result(result: ShardResult) -> None:
        record = _commit_record(result, plan.lease.holder.token)
        if unfenced:
            record = fenced(record)
            unfenced.clear()
        commits.submit(record, result)

    def committed(result: ShardResult) -> None:  # its record is in the log: the shard is done
        plan.state.done[result.index] = 1
        plan.state.rows_done += result.num_rows
        merge_stats(run.stats, result.stats)
        if result.planner_state:
            run.planner_states[result.planner_state["key"]] = result.planner_state["state"]
        run.shards_written += 1
        keep_first_errors(run.first_errors, result.index, result.first_errors)
        bar.shard_written(result.num_rows, result.stats)
        live.shard_written(result.stats, result.worker)
        if hooks and hooks.on_shard_written:
            hooks.on_shard_written(result)

    def on_partial(rows_in_flight: int) -> None:
        bar.show(rows_in_flight)
        live.tick()  # a live MLflow point when no shard arrived for 30 s (heartbeat)

    def check() -> None:  # between the scheduler's waits
        plan.lease.check()
        for result in commits.committed():
            committed(result)

    try:
        watching = config.progress or bool(hooks and hooks.on_progress) or config.mlflow.enabled
        pool.run(
            ShardQueue(plan.todo(), plan.shard), on_result, hooks,
            on_partial=on_partial if watching else None, check=check,
        )  # fmt: skip
        for result in commits.flush():
            committed(result)
    except BaseException:
        live.stop(timeout_s=0.0)  # the job fails: what waits for MLflow is dropped
        raise
    finally:
        bar.close()
        commits.close()
    run.live = live  # stopped by `_finish`, after _SUCCESS and the actors' release
    run.generation_s = time.perf_counter() - run.generation_started


def _commit_record(result: ShardResult, run_token: str) -> dict[str, Any]:
    return {
        "shard": result.index,
        "file": result.file,
        "rows": result.num_rows,
        "bytes": result.bytes,
        "failed": result.failed,
        "failed_input": result.failed_input,
        "errors": result.first_errors,
        "attempt": result.attempt,
        "stats": result.stats,
        "worker": result.worker,
        "run": run_token,
        "time": time.time(),
    }


def _finish(plan: JobPlan, tracker: Any, run: GenerationRun, started: float, startup_s: float) -> JobReport:
    """`_SUCCESS` when the job succeeded, the summary, the final MLflow logging, the exit code."""
    output = plan.output
    total = merge_stats(merge_stats(empty_stats(), plan.state.earlier_stats), run.stats)
    summary = JobSummary.build(
        [total],
        [run.stats],
        num_prompts=plan.output_rows,  # rows: prompts x samples
        wall_time_s=time.perf_counter() - started,
        generation_s=run.generation_s,
        startup_s=startup_s,
        num_actors=run.num_actors,
        actor_device=run.device,
        output_dir=plan.output_dir,
        num_shards=plan.num_shards,
        earlier_generation_s=tracker.earlier_generation_s,
        earlier_wall_s=tracker.earlier_wall_s,
    )
    summary.startup_phases = dict(run.startup_phases)
    summary.input_prompts = plan.num_rows
    messages = _failure_messages(plan, summary, [*plan.state.first_errors, *run.first_errors])
    plan_cache.save_states(plan, plan_cache.pair_key(plan), run.planner_states)  # method=auto; best effort
    if not messages:
        plan.lease.check()
        messages = _incomplete_messages(plan)  # re-read from the directory: _SUCCESS only over every shard
    if not messages:
        committed = {record["shard"]: record["file"] for record in read_commit_records(output)}
        removed = remove_uncommitted_parts(output, set(committed.values()))
        if removed:
            log.info("removed %d part file(s) of attempts that were not committed", len(removed))
        write_success(output)
    # MLflow last, each step bounded: the results above never wait on it, nor does the job's end
    logging_started = time.perf_counter()
    timeout_s = plan.config.mlflow.shutdown_timeout_s
    dropped = run.live.stop(timeout_s) if run.live is not None else 0
    _within(timeout_s, "mlflow: final logging", _best_effort, "mlflow: final logging", tracker.finish, summary,
            _params(plan), "FAILED" if messages else "FINISHED")  # fmt: skip
    logging_s = time.perf_counter() - logging_started
    return JobReport(
        plan=plan,
        summary=summary,
        run_id=tracker.run_id,
        tracking_uri=tracker.tracking_uri,
        exit_code=1 if messages else 0,
        messages=messages,
        tracker_lines=tracker.describe(),
        total_s=time.perf_counter() - started,
        logging_s=logging_s,
        mlflow_dropped=dropped,
    )


def _within(timeout_s: float, what: str, function: Any, *args: Any) -> bool:
    """`function(*args)` on a daemon thread, waited for at most `timeout_s`: MLflow's client retries a
    request for minutes, and a down or hanging server must hold neither the actors nor the job's end. False
    (and a warning) when it had not finished; it may still finish later, or end with the process."""
    thread = threading.Thread(target=function, args=args, name="mlflow-bounded", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        log.warning(
            "%s did not finish in %g s (mlflow.shutdown_timeout_s; the tracking server is slow or down): the job "
            "goes on without waiting for it; its results are in the output directory", what, timeout_s,
        )  # fmt: skip
        return False
    return True


def _best_effort(what: str, function: Any, *args: Any, attempts: int = 3) -> None:
    """Bookkeeping (MLflow, run records) never fails a job: retried (`attempts` tries), then a warning."""
    for attempt in range(attempts):
        try:
            function(*args)
            return
        except Exception as err:  # noqa: BLE001 - the output directory is the result; MLflow reports on it
            if attempt == attempts - 1:
                log.warning("%s failed (%s: %s); the job goes on", what, type(err).__name__, err)
                return
            time.sleep(1.0 + attempt)


def _incomplete_messages(plan: JobPlan) -> list[str]:
    """Why the directory is not complete although every shard was committed (a part deleted or cut since, or
    written where the driver cannot see it: an output_dir local to each node), or nothing."""
    count, first = incomplete_shards(plan.output, plan.num_shards)
    if not count:
        return []
    return [
        f"{count} of {plan.num_shards} shards have no committed part file in {plan.output_dir} as the driver sees "
        f"it ({'; '.join(first)}); no _SUCCESS. When the actors run on other nodes, output_dir must be storage "
        "that every node shares (NFS, s3://, gs://), not a path local to each; re-run to regenerate them"
    ]


def _failure_messages(plan: JobPlan, summary: JobSummary, failures: list[tuple[int, Any, str]] = ()) -> list[str]:
    """Why the job failed; the last lines name its first failed rows (by shard) and their reasons."""
    messages = []
    if plan.shards_to_do:
        messages.append(f"{plan.shards_to_do} of {plan.num_shards} shards were not generated; re-run to resume")
    if summary.failed_fraction > plan.config.max_failed_fraction:
        messages.append(
            f"{summary.prompts_failed} of {summary.num_prompts} {'rows' if summary.counts_rows else 'prompts'} failed "
            f"({100 * summary.failed_fraction:.1f}%), more than max_failed_fraction="
            f"{plan.config.max_failed_fraction:g}; their rows have finish_reason=error and the message in column "
            f"'error' of {plan.output_dir} (a re-run regenerates those that did not fail for their input: "
            f"retry_failed={plan.config.retry_failed})"
        )
        named = sorted(failures, key=lambda failure: failure[0])[:JOB_FIRST_ERRORS]
        messages += [f"row {row_id!r} failed: {error}" for _, row_id, error in named]
    return messages


def raise_if_failed(report: JobReport) -> None:
    if report.exit_code:
        raise JobFailedError("; ".join(report.messages))
