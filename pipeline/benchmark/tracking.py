"""MLflow for the benchmark job: a parent run per job, and one child run per configuration.

- The parent run: the config as params, the per-configuration metrics under slugged names
  (`tokens_per_s/spectr_K4_L4_B16`), the optimality curve and the goals, every output file (tables,
  plots, log) as an artifact.
- One child run per configuration (`mlflow.parentRunId` = the parent), with params `method`, `K`, `L`,
  `batch` and metrics `tokens_per_s`, `block_efficiency`, `speedup_vs_autoregressive` (and the other
  figures of the parent's slugged names), so MLflow's compare and parallel-coordinates views can plot
  them against K and L. A configuration that failed is a FAILED child with its error as a tag.

`mlflow.enabled=false` turns it off (`NullTracker`). Not here: the MLflow client and run
(`pipeline.tracking`).
"""

from __future__ import annotations

import math
import time

from pipeline.benchmark.tables import SPECULATIVE
from pipeline.tracking import MlflowRun, check_reachable


class NullTracker:
    run_id: str | None = None
    tracking_uri: str | None = None

    def start(self, config) -> None:
        pass

    def finish(self, report) -> None:
        pass

    def fail(self) -> None:
        pass


def case_values(r) -> dict[str, float]:
    """One configuration's figures: tokens/s, block efficiency, speedups, memory, prediction, acceptance."""
    c = r.case
    values = {
        "tokens_per_s": r.tokens_per_second,
        "block_efficiency": r.block_efficiency,
        "speedup_vs_autoregressive": r.speedup_vs_autoregressive,
        "speedup_vs_hf_generate": r.speedup_vs_hf_generate,
        "peak_memory_mib": r.peak_memory_bytes / 2**20,
        "predicted_tokens_per_s": r.predicted_tokens_per_second,
    }
    if c.method in SPECULATIVE:
        values["acceptance_rate"] = r.acceptance_rate
    return {key: float(value) for key, value in values.items() if value is not None and math.isfinite(value)}


def case_metrics(report, now: int) -> list:
    """The parent's per-configuration metrics, named `<figure>/<method>_K<K>_L<L>_B<B>`."""
    from mlflow.entities import Metric

    metrics = []
    for r in report.results:
        if not r.ok:
            continue
        c = r.case
        slug = f"{c.method}_K{c.num_drafts}_L{c.draft_length}_B{c.batch_size}"
        metrics.extend(Metric(f"{key}/{slug}", value, now, 0) for key, value in case_values(r).items())
    return metrics


def case_params(case) -> dict[str, str]:
    c = case
    return {"method": c.method, "K": str(c.num_drafts), "L": str(c.draft_length), "batch": str(c.batch_size)}


def log_case_runs(run: MlflowRun, report, now: int) -> list[str]:
    """One child run of `run` per configuration; returns their ids."""
    from mlflow.entities import Metric, Param, RunTag

    client, ids = run.client, []
    for r in report.results:
        tags = {"mlflow.parentRunId": run.run_id, "job": "benchmark-case", **case_params(r.case)}
        if r.error:
            tags["error"] = r.error[:5000]
        child = client.create_run(run.experiment_id, run_name=r.case.label, tags=tags)
        child_id = child.info.run_id
        metrics = [Metric(key, value, now, 0) for key, value in case_values(r).items()] if r.ok else []
        params = [Param(key, value) for key, value in case_params(r.case).items()]
        client.log_batch(child_id, metrics=metrics, params=params, tags=[RunTag("config", r.case.label)])
        client.set_terminated(child_id, status="FINISHED" if r.ok else "FAILED")
        ids.append(child_id)
    return ids


def summary_metrics(report, now: int) -> list:
    """The optimality curve (step = K) and one 0/1 metric per goal that applies."""
    from mlflow.entities import Metric

    metrics = []
    if report.optimality:
        for row in report.optimality.rows:
            for key in ("kseq", "specinfer", "optimum"):
                metrics.append(Metric(f"acceptance_{key}", getattr(row, key), now, row.num_drafts))
    for goal in report.goals:
        if goal.status != "N/A":
            key = "goal_" + "".join(ch if ch.isalnum() else "_" for ch in goal.name)[:200]
            metrics.append(Metric(key, 1.0 if goal.status == "PASS" else 0.0, now, 0))
    return metrics


class MlflowBenchTracker:
    """One MLflow run per benchmark: params, per-configuration metrics, every output file as an artifact."""

    def __init__(self, config):
        check_reachable(config.mlflow)
        self.run = MlflowRun(config.mlflow)
        self.tracking_uri = self.run.tracking_uri

    @property
    def run_id(self) -> str | None:
        return self.run.run_id

    def start(self, config) -> None:
        self.run.start(config.to_dict(), tags={"job": "benchmark"})

    def finish(self, report) -> None:
        now = int(time.time() * 1000)
        self.run.log_metrics(case_metrics(report, now) + summary_metrics(report, now))
        log_case_runs(self.run, report, now)
        for path in report.files:
            self.run.log_artifact(path)
        self.run.terminate("FINISHED")

    def fail(self) -> None:
        self.run.fail()


def make_tracker(config):
    return MlflowBenchTracker(config) if config.mlflow.enabled else NullTracker()
