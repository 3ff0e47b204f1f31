"""The generation job, as the driver runs it: plan, start actors, run the shards, write, log, summarise.

    report = run_generate(config)   # prepare -> MLflow run -> Ray actors -> shards -> Parquet -> summary

Each step lives in its own module: the plan (`plan`), Ray and the pool's size (`cluster`), handing out
shards (`scheduler`), the actors (`worker`), the files (`output`, `manifest`), MLflow (`tracking`), the
progress bar (`progress`) and the summary (`summary`). This module only puts them in order.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pipeline.errors import JobFailedError
from pipeline.generate.cluster import actor_resources, ray_session
from pipeline.generate.config import GenerateConfig
from pipeline.generate.output import output_schema, remove_stale_temporaries, write_shard, write_success
from pipeline.generate.plan import JobPlan, prepare
from pipeline.generate.progress import ProgressBar
from pipeline.generate.scheduler import RunHooks, ShardActorPool
from pipeline.generate.summary import JobSummary, format_report
from pipeline.generate.tracking import make_tracker
from pipeline.generate.worker import ShardResult
from pipeline.tracking import check_reachable

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


@dataclass
class GenerationRun:
    """What this invocation generated (a resumed job's earlier shards are in the manifest, not here)."""

    stats: list[dict[str, Any]] = field(default_factory=list)  # one per shard written by this run
    num_actors: int = 0
    device: str = "-"
    generation_started: float = 0.0
    generation_s: float = 0.0


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
    tracker = make_tracker(config.mlflow, plan)
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


def _open_output(plan: JobPlan) -> None:
    """Once the actors are up: a job that cannot start writes nothing."""
    plan.output_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(plan.output_dir)
    if not (plan.output_dir / "_manifest.json").exists():
        plan.manifest.save(plan.output_dir)


def _execute(
    plan: JobPlan, tracker: Any, tracker_started: Future, hooks: RunHooks | None, started: float
) -> JobReport:
    schema = output_schema(
        plan.id_kind, {**plan.settings, "config_hash": plan.config_hash, "versions": _versions()}
    )
    if plan.todo:
        run = _generate(plan, schema, tracker, tracker_started, hooks, started)
    else:
        _open_output(plan)
        run = GenerationRun()
    tracker_started.result()
    startup_s = run.generation_started - started if plan.todo else 0.0
    return _finish(plan, tracker, run, started, startup_s)


def _generate(
    plan: JobPlan, schema: Any, tracker: Any, tracker_started: Future, hooks: RunHooks | None, started: float
) -> GenerationRun:
    """Start the actors, then generate every shard still to do."""
    import ray

    config = plan.config
    with ray_session(config.ray):
        count, cpus_each, gpus_each = actor_resources(config.ray, ray.cluster_resources(), len(plan.todo))
        log.info("ray ready (%.1f s); starting %d actor(s)", time.perf_counter() - started, count)
        pool = ShardActorPool(config, count, cpus_each, gpus_each)
        workers = pool.wait_ready()
        log.info("actors loaded the pair (%.1f s)", time.perf_counter() - started)
        tracker_started.result()  # re-raises an MLflow failure before any generation
        if tracker.run_id:
            log.info("mlflow run %s (%.1f s)", tracker.run_id, time.perf_counter() - started)
        _open_output(plan)
        tracker.job_started(count, workers)  # device and worker tags; the run id into the output dir
        if hooks and hooks.on_actors_ready:
            hooks.on_actors_ready(pool.actors, workers)
        device = (
            f"{workers[0]['device']} ({cpus_each:g} CPU, {gpus_each:g} GPU, "
            f"{workers[0]['torch_threads']} torch threads each)"
        )
        run = GenerationRun(num_actors=count, device=device)
        _run_shards(plan, pool, schema, hooks, run, tracker)
    return run


def _run_shards(
    plan: JobPlan, pool: ShardActorPool, schema: Any, hooks: RunHooks | None, run: GenerationRun, tracker: Any
):
    """Every shard to do through the pool; each result is written and recorded as it arrives."""
    config = plan.config
    rows_done = plan.num_rows - sum(len(s) for s in plan.todo)
    bar = ProgressBar(plan.num_rows, rows_done, config.progress, hooks.on_progress if hooks else None)
    run.generation_started = time.perf_counter()
    todo = {shard.index for shard in plan.todo}
    earlier = [plan.manifest.shards[i]["stats"] for i in sorted(plan.manifest.shards) if i not in todo]
    live = tracker.live_metrics(earlier, started=run.generation_started)

    def on_result(result: ShardResult) -> None:
        write_shard(plan.output_dir, result.index, result.rows, schema)
        plan.manifest.record_shard(plan.output_dir, result.index, len(result.rows), result.stats, result.worker)
        run.stats.append(result.stats)
        bar.shard_written(len(result.rows), result.stats)
        live.shard_written(result.stats, result.worker)
        if hooks and hooks.on_shard_written:
            hooks.on_shard_written(result)

    def on_partial(rows_in_flight: int) -> None:
        bar.show(rows_in_flight)
        live.tick()  # a live MLflow point when no shard arrived for 30 s (heartbeat)

    try:
        watching = config.progress or bool(hooks and hooks.on_progress) or config.mlflow.enabled
        pool.run(plan.todo, on_result, hooks, on_partial=on_partial if watching else None)
    finally:
        bar.close()
        live.stop()
    run.generation_s = time.perf_counter() - run.generation_started


def _finish(plan: JobPlan, tracker: Any, run: GenerationRun, started: float, startup_s: float) -> JobReport:
    """`_SUCCESS` when complete, the summary, the final MLflow logging, the exit code."""
    config, output_dir, manifest = plan.config, plan.output_dir, plan.manifest
    if manifest.complete:
        write_success(output_dir)
    summary = JobSummary.build(
        [manifest.shards[i]["stats"] for i in sorted(manifest.shards)],
        run.stats,
        num_prompts=plan.num_rows,
        wall_time_s=time.perf_counter() - started,
        generation_s=run.generation_s,
        startup_s=startup_s,
        num_actors=run.num_actors,
        actor_device=run.device,
        output_dir=str(output_dir),
        num_shards=manifest.num_shards,
        earlier_generation_s=tracker.earlier_generation_s,
        earlier_wall_s=tracker.earlier_wall_s,
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


def raise_if_failed(report: JobReport) -> None:
    if report.exit_code:
        raise JobFailedError("; ".join(report.messages))
