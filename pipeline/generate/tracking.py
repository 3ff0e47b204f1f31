"""MLflow logging for one generation job: params = the flattened resolved config, metrics, artifacts.

The metric names are the MLflow contract (docs/architecture.md); they come from
`pipeline.generate.summary.JobSummary.metrics`. `mlflow.enabled=false` turns logging off (`NullTracker`).

Not here: the MLflow client and run handling both jobs share (`pipeline.tracking`).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from pipeline.config import MlflowConfig
from pipeline.generate.summary import JobSummary, plot_tokens_per_call
from pipeline.tracking import MlflowRun


class NullTracker:
    """`mlflow.enabled=false`: logs nothing."""

    run_id: str | None = None
    tracking_uri: str | None = None
    experiment: str | None = None

    def start(self, params: dict[str, Any], tags: dict[str, str]) -> None:
        pass

    def finish(self, summary: JobSummary, resolved_config: dict[str, Any], status: str) -> None:
        pass

    def fail(self) -> None:
        pass

    def describe(self) -> list[tuple[str, str]]:
        return [("mlflow", "disabled (mlflow.enabled=false)")]


class MlflowTracker(MlflowRun):
    """The job's run: started with the params and tags, finished with the summary's metrics and files."""

    def finish(self, summary: JobSummary, resolved_config: dict[str, Any], status: str) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(name, value, now, 0) for name, value in summary.metrics().items()]
        for position, count in enumerate(summary.accepted_per_position):
            metrics.append(Metric("accepted_at_position", float(count), now, position))
        self.log_metrics(metrics)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            (folder / "config.yaml").write_text(yaml.safe_dump(resolved_config, sort_keys=False))
            (folder / "summary.json").write_text(json.dumps(summary.to_dict(), indent=1))
            (folder / "summary.txt").write_text(summary.table() + "\n")
            plot_tokens_per_call(
                summary.tokens_per_call_histogram,
                str(folder / "tokens_per_target_call.png"),
                title=f"block efficiency {summary.block_efficiency:.2f}",
            )
            self.log_artifacts(folder)
        self.terminate(status)


def make_tracker(config: MlflowConfig) -> MlflowTracker | NullTracker:
    return MlflowTracker(config) if config.enabled else NullTracker()
