"""MLflow for one generation job: which run it continues, its params, tags, dataset, live and final metrics.

One run per job, across resumes. The run id lives in the output directory, in `_mlflow_run.json`
(`RunRecord`, written atomically, independent of the shard bookkeeping), with the generation and wall time
the job's runs have spent so far, so that a resumed job's throughput covers all of it. A resumed job
continues that run; one still RUNNING there belonged to a job that died, and is marked KILLED when this
is detected, then reopened.

Logged: params = the flattened resolved config, plus `num_actors` (and `planner_choice`,
`planner_method`, `planner_num_drafts`, `planner_draft_length` under method="auto", also tags that
follow the planner's latest choice); tags = method, K, L, target and draft
names, device kind, number of workers, git commit, output directory, config hash; the prompts as a dataset
input; MLflow's system metrics on the driver; live metrics while the job runs (`pipeline.generate.live`);
the final metrics (`pipeline.generate.summary.JobSummary.metrics`, the MLflow contract names) at
step = prompts completed; the resolved config, the summary and the tokens-per-call plot as artifacts.
`mlflow.enabled=false` turns all of it off (`NullTracker`).

Not here: the MLflow client and run handling both jobs share (`pipeline.tracking`).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from pipeline import fs
from pipeline.config import MlflowConfig
from pipeline.generate.live import LiveMetrics, NullLive
from pipeline.generate.summary import JobSummary, plot_tokens_per_call
from pipeline.redact import redact, redacted
from pipeline.tracking import MlflowRun

RUN_FILE = "_mlflow_run.json"

log = logging.getLogger("pipeline")


@dataclass
class RunRecord:
    """`_mlflow_run.json`: the job's MLflow run and the time its runs spent (up to the last shard)."""

    run_id: str | None = None
    experiment_id: str | None = None
    tracking_uri: str | None = None
    generation_s: float = 0.0
    wall_time_s: float = 0.0
    invocations: int = 0  # how many times the job was started on this output directory


def _run_file(output: fs.Location | str | os.PathLike) -> fs.Location:
    location = output if isinstance(output, fs.Location) else fs.resolve(str(output), "output_dir")
    return location.child(RUN_FILE)


def read_run_record(output: fs.Location | str | os.PathLike) -> RunRecord | None:
    """The run record of an output directory (local path or any `pipeline.fs` location), or None."""
    location = _run_file(output)
    try:
        if not fs.exists(location):
            return None
        raw = json.loads(fs.read_bytes(location))
        return RunRecord(**{key: raw[key] for key in RunRecord.__dataclass_fields__ if key in raw})
    except (ValueError, TypeError, OSError) as err:
        log.warning("%s is unreadable (%s); the job starts a new MLflow run", location.uri, err)
        return None


def write_run_record(output: fs.Location | str | os.PathLike, record: RunRecord) -> None:
    """Atomically (temporary name + rename, or one PUT on an object store); best effort (retried, then a
    warning): bookkeeping never fails a job."""
    fs.write_bytes_best_effort(_run_file(output), json.dumps(asdict(record), indent=1).encode(), "run record")


def model_name(path_or_id: str) -> str:
    """A model's name for a tag: a local directory's last part, a hub id as it is."""
    path = Path(path_or_id).expanduser()
    return path.name if path.is_absolute() or path.exists() else path_or_id


def job_tags(plan: Any) -> dict[str, str]:
    """The tags known before any actor starts (device kind and workers come with `job_started`)."""
    s, m = plan.config.spectr, plan.config.model
    return {
        "job": "generate",
        "method": s.method,
        "K": str(s.num_drafts),
        "L": str(s.draft_length),
        "target": model_name(m.target),
        "draft": model_name(m.draft),
        "output_dir": str(plan.output_dir),
        "config_hash": plan.config_hash,
        "mlflow.source.name": "jobs.generate",
    }


class MlflowTracker(MlflowRun):
    """The job's run: started (or continued), fed live, finished with the summary's metrics and files."""

    def __init__(self, config: MlflowConfig, plan: Any):
        super().__init__(config)
        self.plan = plan
        self.output_dir = plan.output  # a pipeline.fs location: local, NFS or an object store
        self.record = read_run_record(self.output_dir) or RunRecord()
        self.resumed_run = False
        self.started = time.perf_counter()
        earlier_shards = plan.shards_to_do < plan.num_shards
        # time is known for the earlier runs only when they left a record (an MLflow-enabled run)
        self.earlier_generation_s: float | None = (
            self.record.generation_s if self.record.invocations or not earlier_shards else None
        )
        self.earlier_wall_s = self.record.wall_time_s

    def start(self, params: dict[str, Any], tags: dict[str, str]) -> str:
        """Continue the output directory's run when there is one on this server, else a new run; then
        the dataset input and the system-metrics monitor."""
        tags = {**tags, **job_tags(self.plan), "job_runs": str(self.record.invocations + 1)}
        previous = self._previous_run()
        if previous is None:
            s = self.plan.config.spectr
            super().start(
                params,
                tags,
                run_name=self.config.run_name or f"{s.method} K={s.num_drafts} L={s.draft_length}",
            )
        else:
            if previous.info.status == "RUNNING":  # its job died without ending the run
                log.warning(
                    "mlflow run %s was left RUNNING by a job that died: marked KILLED", previous.info.run_id
                )
                self.client.set_terminated(previous.info.run_id, status="KILLED")
            self.reopen(previous.info.run_id, params, {**tags, "resumed_from_status": previous.info.status})
            self.resumed_run = True
            log.info("mlflow: continuing run %s of this output directory", self.run_id)
        plan = self.plan
        self.log_dataset(
            name=Path(plan.config.data.path).stem or "prompts",
            uri=plan.config.data.path,
            digest=plan.settings.get("prompts_sha256", plan.config_hash),
            num_rows=plan.num_rows,
        )
        if self.config.system_metrics:
            self.start_system_metrics(self.config.system_metrics_interval_s, resume=self.resumed_run)
        return self.run_id

    def _previous_run(self) -> Any:
        from mlflow.exceptions import MlflowException

        record = self.record
        if not record.run_id or record.tracking_uri not in (self.tracking_uri, redact(self.tracking_uri)):
            return None
        try:
            run = self.client.get_run(record.run_id)
        except MlflowException:
            log.warning("mlflow run %s of %s is gone; starting a new run", record.run_id, self.output_dir)
            return None
        if run.info.lifecycle_stage != "active" or run.info.experiment_id != self.experiment_id_for(
            self.experiment
        ):
            return None  # deleted, or the job now logs to another experiment
        return run

    def job_started(self, num_actors: int, workers: list[dict[str, Any]]) -> None:
        """Once the actors are up and the output directory exists: the device and worker tags, the
        actor count as a param, and the run file."""
        device = (workers[0].get("device_kind") or workers[0].get("device", "-")) if workers else "-"
        self.set_tags({"device": device, "num_workers": str(num_actors)})
        if self.resumed_run:
            present = self.client.get_run(self.run_id).data.params
            if "num_actors" not in present:
                self.log_params({"num_actors": num_actors})
        else:
            self.log_params({"num_actors": num_actors})
        self.save_record(generation_s=0.0)

    def save_record(self, generation_s: float, wall_time_s: float | None = None) -> None:
        """The run file with this run's generation (and wall) time so far added to the earlier runs'."""
        wall = time.perf_counter() - self.started if wall_time_s is None else wall_time_s
        record = RunRecord(
            run_id=self.run_id,
            experiment_id=self.experiment_id,
            tracking_uri=redact(self.tracking_uri),  # a run file is no place for a password
            generation_s=(self.earlier_generation_s or 0.0) + generation_s,
            wall_time_s=self.earlier_wall_s + wall,
            invocations=self.record.invocations + 1,
        )
        write_run_record(self.output_dir, record)

    def live_metrics(self, earlier_stats: list[dict[str, Any]], started: float) -> LiveMetrics:
        """The live logger for this run: earlier_stats are the shards done before this run."""
        return LiveMetrics(
            self.log_metrics,
            earlier_stats,
            self.earlier_generation_s,
            num_prompts=self.plan.output_rows,  # rows: prompts x samples
            every_s=self.config.log_every_s,
            started=started,
            checkpoint=self.save_record,
            on_plan=self.planner_chose,
        )

    def planner_chose(self, plan: str, choice: dict | None = None) -> None:
        """method="auto": the planner's choice (its description, and its method, K and L as
        `planner_method`, `planner_num_drafts`, `planner_draft_length`) as tags (its latest) and params
        (its first)."""
        values = {"planner_choice": plan, **{f"planner_{k}": str(v) for k, v in (choice or {}).items()}}
        self.set_tags(values)
        if "planner_choice" not in self.client.get_run(self.run_id).data.params:
            self.log_params(values)

    def finish(self, summary: JobSummary, resolved_config: dict[str, Any], status: str) -> None:
        """The final metrics at step = prompts completed (the live series' last point), the files, the
        run file, and the run's end state."""
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(summary.prompts_completed)
        self.log_metrics([Metric(name, value, now, step) for name, value in summary.metrics().items()])
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            (folder / "config.yaml").write_text(yaml.safe_dump(redacted(resolved_config), sort_keys=False))
            (folder / "summary.json").write_text(json.dumps(redacted(summary.to_dict()), indent=1))
            (folder / "summary.txt").write_text(redact(summary.table()) + "\n")
            plot_tokens_per_call(
                summary.tokens_per_call_histogram,
                str(folder / "tokens_per_target_call.png"),
                title=f"block efficiency {summary.block_efficiency:.2f}",
            )
            self.log_artifacts(folder)
        self.save_record(summary.generation_s, summary.wall_time_this_run_s)
        self.terminate(status)


class NullTracker:
    """`mlflow.enabled=false`: logs nothing, keeps no run file."""

    run_id: str | None = None
    tracking_uri: str | None = None
    experiment: str | None = None
    earlier_generation_s: float | None = None
    earlier_wall_s: float = 0.0

    def start(self, params: dict[str, Any], tags: dict[str, str]) -> None:
        pass

    def job_started(self, num_actors: int, workers: list[dict[str, Any]]) -> None:
        pass

    def live_metrics(self, earlier_stats: list[dict[str, Any]], started: float) -> NullLive:
        return NullLive()

    def finish(self, summary: JobSummary, resolved_config: dict[str, Any], status: str) -> None:
        pass

    def fail(self) -> None:
        pass

    def describe(self) -> list[tuple[str, str]]:
        return [("mlflow", "disabled (mlflow.enabled=false)")]


def make_tracker(config: MlflowConfig, plan: Any) -> MlflowTracker | NullTracker:
    return MlflowTracker(config, plan) if config.enabled else NullTracker()
