"""MLflow for the benchmark job: one run per job, metrics per configuration, every output file as an artifact.

`mlflow.enabled=false` turns it off (`NullTracker`). Not here: the MLflow client and run (`pipeline.tracking`).
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


def case_metrics(report, now: int) -> list:
    """Per configuration: tokens/s, block efficiency, speedups, memory, prediction, acceptance."""
    from mlflow.entities import Metric

    metrics = []
    for r in report.results:
        if not r.ok:
            continue
        c = r.case
        slug = f"{c.method}_K{c.num_drafts}_L{c.draft_length}_B{c.batch_size}"
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
        for key, value in values.items():
            if value is not None and math.isfinite(value):
                metrics.append(Metric(f"{key}/{slug}", float(value), now, 0))
    return metrics


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
        for path in report.files:
            self.run.log_artifact(path)
        self.run.terminate("FINISHED")

    def fail(self) -> None:
        self.run.fail()


def make_tracker(config):
    return MlflowBenchTracker(config) if config.mlflow.enabled else NullTracker()
