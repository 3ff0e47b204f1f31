"""The generation job, as the driver runs it: prepare, start actors, hand out shards, write, log.

    plan = prepare(config)        # every check; reads and tokenizes prompts; writes nothing
    report = run_generate(config) # prepare -> MLflow run -> Ray actors -> shards -> Parquet -> summary

Ray does the scheduling: each `ShardGenerator` actor asks for `ray.cpus_per_actor` CPUs (and a GPU when
the cluster has GPUs), Ray places them, restarts one that dies (`ray.max_restarts`) and re-runs its
unfinished shard on the restarted actor (`ray.max_task_retries`). The driver keeps the queue of shards,
gives the next shard to whichever actor returns one, and writes each result as it arrives; a shard whose
task still fails (e.g. the actor is gone for good) goes back into the queue for another actor, up to
`ray.shard_attempts` tries.

Not here: reading files (`pipeline.io`), model checks (`pipeline.models`), the output layout
(`pipeline.output`), MLflow (`pipeline.tracking`), the generation itself (`spectr.generate`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import io, models
from pipeline.actor import ShardGenerator, ShardResult
from pipeline.config import GenerateConfig, RayConfig, generation_settings, stable_hash
from pipeline.errors import JobFailedError, JobInputError
from pipeline.output import (
    Manifest,
    finished_shards,
    open_output_dir,
    output_schema,
    remove_stale_temporaries,
    write_shard,
    write_success,
)
from pipeline.shards import Shard, cut_shards, num_shards
from pipeline.summary import JobSummary
from pipeline.tracking import check_reachable, make_tracker

log = logging.getLogger("pipeline")


@dataclass
class JobPlan:
    """Everything decided before any actor starts."""

    config: GenerateConfig
    output_dir: Path
    config_hash: str
    settings: dict[str, Any]
    shards: list[Shard]
    todo: list[Shard]
    manifest: Manifest
    id_kind: str
    num_rows: int


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


@dataclass
class RunHooks:
    """Observation points for tests and tools; the job itself needs none of them."""

    on_actors_ready: Callable[[list[Any], list[dict[str, Any]]], None] | None = None
    on_dispatch: Callable[[Any, Shard], None] | None = None
    on_shard_written: Callable[[ShardResult], None] | None = None
    on_progress: Callable[[int], None] | None = None  # prompts done, shards in flight included (polled)


PROGRESS_POLL_S = 0.5  # how often the driver reads the actors' batch-level progress while it waits


class ShardProgress:
    """Rows generated so far in each in-flight shard, reported batch by batch by the actors (a Ray actor).

    The driver's progress bar reads it while it waits for shards, so a large shard moves the bar batch
    by batch rather than once at its end. A retried shard's count can overshoot (its first attempt's
    batches were reported too); `rows_in_flight` caps each shard at its length, and the bar is exact
    again when the shard's result arrives.
    """

    def __init__(self) -> None:
        self.rows: dict[int, int] = {}

    def add(self, shard_index: int, rows: int) -> None:
        self.rows[shard_index] = self.rows.get(shard_index, 0) + rows

    def forget(self, shard_index: int) -> None:
        self.rows.pop(shard_index, None)

    def snapshot(self) -> dict[int, int]:
        return dict(self.rows)


class BatchReporter:
    """`ShardGenerator`'s on_batch callback: one fire-and-forget call to the `ShardProgress` actor."""

    def __init__(self, progress: Any):
        self.progress = progress

    def __call__(self, shard_index: int, rows: int) -> None:
        self.progress.add.remote(shard_index, rows)


def rows_in_flight(snapshot: dict[int, int], shards: list[Shard]) -> int:
    """Rows generated so far in `shards` according to `snapshot`, each capped at its shard's length."""
    return sum(min(snapshot.get(shard.index, 0), len(shard)) for shard in shards)


def prepare(config: GenerateConfig) -> JobPlan:
    """All input checks, cheapest first. Raises JobInputError; writes nothing."""
    table = io.read_prompts(config.data)
    target_dir = models.check_model_dir(config.model.target, "model.target", config.model.allow_pickle)
    draft_dir = models.check_model_dir(config.model.draft, "model.draft", config.model.allow_pickle)
    target_vocab = models.vocab_size_of(target_dir, config.model.trust_remote_code)
    draft_vocab = models.vocab_size_of(draft_dir, config.model.trust_remote_code)
    if target_vocab != draft_vocab:
        raise JobInputError(
            f"model.draft: vocabulary sizes differ: target {target_dir} has {target_vocab}, draft {draft_dir} has {draft_vocab}"
        )
    target_tok = models.load_tokenizer(target_dir, "model.target", config.model.trust_remote_code)
    draft_tok = models.load_tokenizer(draft_dir, "model.draft", config.model.trust_remote_code)
    models.check_same_tokenizer(target_tok, draft_tok, target_dir, draft_dir)

    texts = models.render_prompts(target_tok, config.data, table.prompts, table.messages)
    # a chat template writes its own special tokens (as apply_chat_template(tokenize=True) does)
    add_special_tokens = config.data.add_special_tokens and not config.data.chat
    token_ids = models.tokenize(target_tok, texts, add_special_tokens)
    shards = cut_shards(table.ids, texts, token_ids, config.shard_size, config.spectr.seed)

    settings = generation_settings(config)
    # the prompts themselves are part of what the output depends on
    settings["prompts_sha256"] = stable_hash([table.ids, token_ids])
    settings["num_prompts"] = len(table)
    config_hash = stable_hash(settings)
    output_dir = Path(config.output_dir or f"runs/generate-{config_hash[:12]}").expanduser().resolve()
    manifest = open_output_dir(
        output_dir, config_hash, settings, len(table), num_shards(len(table), config.shard_size)
    )
    done = finished_shards(output_dir, manifest) if output_dir.exists() else set()
    todo = [shard for shard in shards if shard.index not in done]
    return JobPlan(
        config, output_dir, config_hash, settings, shards, todo, manifest, table.id_kind, len(table)
    )


@contextlib.contextmanager
def ray_session(config: RayConfig) -> Iterator[None]:
    """Join the configured cluster, or start a local Ray; shut down only what we started.

    When this process is already connected to Ray (a notebook, a test session), that connection is used.
    """
    import ray

    if ray.is_initialized():
        yield
        return
    if config.address:
        try:
            ray.init(address=config.address, log_to_driver=True)
        except ConnectionError as err:
            raise JobInputError(
                f"ray.address: cannot join a Ray cluster at {config.address!r}: {err}"
            ) from None
    else:
        ray.init(
            num_cpus=config.local_num_cpus,
            include_dashboard=False,
            object_store_memory=config.local_object_store_mb * 1024 * 1024,
        )
    try:
        yield
    finally:
        ray.shutdown()


def actor_resources(
    config: RayConfig, cluster: dict[str, float], shards_to_do: int
) -> tuple[int, float, float]:
    """(number of actors, CPUs each, GPUs each): one actor per GPU when there are GPUs, else per N CPUs."""
    gpus = float(cluster.get("GPU", 0))
    cpus = float(cluster.get("CPU", 0))
    gpus_each = config.gpus_per_actor if config.gpus_per_actor is not None else (1.0 if gpus > 0 else 0.0)
    cpus_each = float(config.cpus_per_actor)
    if config.num_actors is not None:
        count = config.num_actors
    elif gpus_each > 0:
        count = int(gpus // gpus_each)
    else:
        count = int(cpus // cpus_each)
    if gpus_each > gpus or count * gpus_each > gpus + 1e-9 or count * cpus_each > cpus + 1e-9:
        raise JobInputError(
            f"ray: {count} actor(s) x ({cpus_each:g} CPU, {gpus_each:g} GPU) do not fit the cluster "
            f"({cpus:g} CPUs, {gpus:g} GPUs); lower ray.num_actors or ray.cpus_per_actor"
        )
    count = max(1, min(count, max(1, shards_to_do)))
    return count, cpus_each, gpus_each


class ShardActorPool:
    """The job's actors and the shard queue. Ray places, restarts and retries; we only hand out shards."""

    def __init__(self, config: GenerateConfig, count: int, cpus_each: float, gpus_each: float):
        import ray

        self._ray = ray
        self.config = config
        remote_class = ray.remote(ShardGenerator).options(
            num_cpus=cpus_each,
            num_gpus=gpus_each,
            max_restarts=config.ray.max_restarts,
            max_task_retries=config.ray.max_task_retries,
        )
        threads = max(1, int(cpus_each))
        device = "cuda" if gpus_each > 0 else "cpu"  # a CPU actor stays on CPU even on a GPU node
        self.progress = ray.remote(ShardProgress).options(num_cpus=0).remote()
        reporter = BatchReporter(self.progress)
        self.actors = [
            remote_class.remote(config.model, config.spectr, threads, device, reporter) for _ in range(count)
        ]

    def wait_ready(self) -> list[dict[str, Any]]:
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return self._ray.get([actor.ready.remote() for actor in self.actors])
        except (RayActorError, RayTaskError) as err:
            raise RuntimeError(f"an actor failed to load the model pair: {err}") from err

    def run(
        self,
        shards: list[Shard],
        on_result: Callable[[ShardResult], None],
        hooks: RunHooks | None = None,
        on_partial: Callable[[int], None] | None = None,
    ) -> None:
        """Generate every shard exactly once (as far as the output is concerned), calling `on_result` per
        shard, and `on_partial(rows generated so far in the shards in flight)` every PROGRESS_POLL_S
        while it waits."""
        from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

        ray = self._ray
        pending = deque(shards)
        attempts = dict.fromkeys((s.index for s in shards), 0)
        idle = list(self.actors)
        in_flight: dict[Any, tuple[Any, Shard]] = {}
        while pending or in_flight:
            while idle and pending:
                actor, shard = idle.pop(0), pending.popleft()
                attempts[shard.index] += 1
                in_flight[actor.generate_shard.remote(shard)] = (actor, shard)
                if hooks and hooks.on_dispatch:
                    hooks.on_dispatch(actor, shard)
            if not in_flight:
                raise RuntimeError(f"no live actors left; {len(pending)} shard(s) not generated")
            ready, _ = ray.wait(
                list(in_flight), num_returns=1, timeout=PROGRESS_POLL_S if on_partial is not None else None
            )
            if not ready:
                self._report_partial(on_partial, [shard for _, shard in in_flight.values()])
                continue
            actor, shard = in_flight.pop(ready[0])
            self.progress.forget.remote(shard.index)
            try:
                result = ray.get(ready[0])
            except (RayActorError, RayTaskError) as err:
                if attempts[shard.index] >= self.config.ray.shard_attempts:
                    raise RuntimeError(
                        f"shard {shard.index} failed {attempts[shard.index]} time(s); last error: {err}"
                    ) from err
                log.warning("shard %d: %s; handing it to another actor", shard.index, type(err).__name__)
                pending.appendleft(shard)
                if not isinstance(err, ActorDiedError):
                    idle.append(actor)  # the actor is alive (or restarting): keep using it
                continue
            on_result(result)
            idle.append(actor)

    def _report_partial(self, on_partial: Callable[[int], None], shards: list[Shard]) -> None:
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            snapshot = self._ray.get(self.progress.snapshot.remote(), timeout=PROGRESS_POLL_S)
        except (GetTimeoutError, RayActorError):  # progress is best effort; generation goes on
            return
        on_partial(rows_in_flight(snapshot, shards))


def run_generate(config: GenerateConfig, hooks: RunHooks | None = None) -> JobReport:
    """Run the whole job. Raises JobInputError (before anything starts) for bad input."""
    started = time.perf_counter()
    plan = prepare(config)
    check_reachable(config.mlflow)
    done = plan.num_rows - sum(len(s) for s in plan.todo)
    log.info(
        "checked config, models and %d prompts in %.1f s; %d of %d shards to generate%s",
        plan.num_rows,
        time.perf_counter() - started,
        len(plan.todo),
        len(plan.shards),
        f" (resuming: {done} prompts already done)" if done else "",
    )
    tracker = make_tracker(config.mlflow)
    # MLflow's start-up (import, database, run) overlaps Ray's start and the actors' model loading.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow") as background:
        tracker_started = background.submit(
            tracker.start,
            params=_params(plan),
            tags={"output_dir": str(plan.output_dir), "config_hash": plan.config_hash},
        )
        try:
            report = _execute(plan, tracker, tracker_started, hooks, started)
        except BaseException:
            if tracker_started.done() and tracker_started.exception() is None:
                tracker.fail()
            raise
    return report


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
    params["output_dir"] = str(plan.output_dir)
    params["config_hash"] = plan.config_hash
    params["num_prompts"] = plan.num_rows
    return params


def _execute(
    plan: JobPlan, tracker: Any, tracker_started: Future, hooks: RunHooks | None, started: float
) -> JobReport:
    import ray
    from tqdm import tqdm

    config, output_dir, manifest = plan.config, plan.output_dir, plan.manifest

    def open_output() -> None:  # once the actors are up: a job that cannot start writes nothing
        output_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(output_dir)
        if not (output_dir / "_manifest.json").exists():
            manifest.save(output_dir)

    schema = output_schema(
        plan.id_kind, {**plan.settings, "config_hash": plan.config_hash, "versions": _versions()}
    )
    this_run: list[dict[str, Any]] = []
    num_actors, device = 0, "-"
    generation_started, generation_s = time.perf_counter(), 0.0

    if plan.todo:
        with ray_session(config.ray):
            count, cpus_each, gpus_each = actor_resources(config.ray, ray.cluster_resources(), len(plan.todo))
            log.info("ray ready (%.1f s); starting %d actor(s)", time.perf_counter() - started, count)
            pool = ShardActorPool(config, count, cpus_each, gpus_each)
            workers = pool.wait_ready()
            log.info("actors loaded the pair (%.1f s)", time.perf_counter() - started)
            tracker_started.result()  # re-raises an MLflow failure before any generation
            if tracker.run_id:
                log.info("mlflow run %s (%.1f s)", tracker.run_id, time.perf_counter() - started)
            open_output()
            if hooks and hooks.on_actors_ready:
                hooks.on_actors_ready(pool.actors, workers)
            num_actors = count
            device = (
                f"{workers[0]['device']} ({cpus_each:g} CPU, {gpus_each:g} GPU, "
                f"{workers[0]['torch_threads']} torch threads each)"
            )
            rows_done = plan.num_rows - sum(len(s) for s in plan.todo)
            progress = tqdm(
                total=plan.num_rows,
                initial=rows_done,
                unit="prompt",
                disable=not config.progress,
                dynamic_ncols=True,
            )
            generation_started = time.perf_counter()
            written = [rows_done]  # prompts in written shards

            def show(in_flight: int = 0, redraw: bool = False) -> None:
                shown = min(written[0] + in_flight, plan.num_rows)
                if shown == progress.n and not redraw:
                    return  # nothing new since the last poll: no redraw (a log file gets a line per redraw)
                progress.n = shown
                progress.refresh()
                if hooks and hooks.on_progress:
                    hooks.on_progress(shown)

            def on_result(result: ShardResult) -> None:
                write_shard(output_dir, result.index, result.rows, schema)
                manifest.record_shard(output_dir, result.index, len(result.rows), result.stats, result.worker)
                this_run.append(result.stats)
                tokens = sum(s["generated_tokens"] for s in this_run)
                calls = sum(s["target_calls"] for s in this_run)
                elapsed = time.perf_counter() - generation_started
                progress.set_postfix(
                    tok_per_s=f"{tokens / elapsed:.0f}" if elapsed > 0 else "-",
                    block_eff=f"{tokens / calls:.2f}" if calls else "-",
                    refresh=False,
                )
                written[0] += len(result.rows)
                show(redraw=True)
                if hooks and hooks.on_shard_written:
                    hooks.on_shard_written(result)

            try:
                watching = config.progress or bool(hooks and hooks.on_progress)
                pool.run(plan.todo, on_result, hooks, on_partial=show if watching else None)
            finally:
                progress.close()
            generation_s = time.perf_counter() - generation_started
    else:
        open_output()
    tracker_started.result()
    startup_s = generation_started - started if plan.todo else 0.0

    if manifest.complete:
        write_success(output_dir)
    summary = JobSummary.build(
        [manifest.shards[i]["stats"] for i in sorted(manifest.shards)],
        this_run,
        num_prompts=plan.num_rows,
        wall_time_s=time.perf_counter() - started,
        generation_s=generation_s,
        startup_s=startup_s,
        num_actors=num_actors,
        actor_device=device,
        output_dir=str(output_dir),
        num_shards=manifest.num_shards,
    )
    failed_too_many = summary.failed_fraction > config.max_failed_fraction
    logging_started = time.perf_counter()
    tracker.finish(summary, _params(plan), status="FAILED" if failed_too_many else "FINISHED")
    logging_s = time.perf_counter() - logging_started
    messages = []
    if failed_too_many:
        messages.append(
            f"{summary.prompts_failed} of {summary.num_prompts} prompts failed "
            f"({100 * summary.failed_fraction:.1f}%), more than max_failed_fraction="
            f"{config.max_failed_fraction:g}; their rows have finish_reason=error and the message in column "
            f"'error' of {output_dir}"
        )
    return JobReport(
        plan=plan,
        summary=summary,
        run_id=tracker.run_id,
        tracking_uri=tracker.tracking_uri,
        exit_code=1 if failed_too_many else 0,
        messages=messages,
        tracker_lines=tracker.describe(),
        total_s=time.perf_counter() - started,
        logging_s=logging_s,
    )


def format_report(report: JobReport) -> str:
    lines = ["SpecTr generation summary", report.summary.table()]
    width = 16
    for name, value in report.tracker_lines:
        lines.append(f"  {name.ljust(width)}  {value}")
    lines.extend(f"error: {message}" for message in report.messages)
    return "\n".join(lines)


def raise_if_failed(report: JobReport) -> None:
    if report.exit_code:
        raise JobFailedError("; ".join(report.messages))
