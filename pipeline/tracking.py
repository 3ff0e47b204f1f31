"""MLflow logging for one job: one run, params = the flattened resolved config, metrics, artifacts.

Only the driver uses this (actors never talk to MLflow). It uses an explicit `MlflowClient` on the
configured tracking URI, never the process-global `mlflow.start_run` state. The default tracking URI is
a local SQLite file, `sqlite:///<cwd>/mlflow.db`; `mlflow.tracking_uri` points at a server instead, and
`mlflow.enabled=false` turns logging off (`NullTracker`).

The metric names are the contract of DESIGN.md; they come from `pipeline.summary.JobSummary.metrics`.
"""

from __future__ import annotations

import json
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from pipeline.config import MlflowConfig, flatten
from pipeline.errors import JobInputError
from pipeline.summary import JobSummary, plot_tokens_per_call

_BATCH = 100  # MLflow's limit on params per log_batch call


def resolve_tracking_uri(config: MlflowConfig) -> str:
    if config.tracking_uri:
        return config.tracking_uri
    return f"sqlite:///{(Path.cwd() / 'mlflow.db').resolve()}"


def ui_command(tracking_uri: str) -> str:
    """The command that opens the MLflow UI on these runs."""
    if tracking_uri.startswith(("http://", "https://")):
        return f"open {tracking_uri} in a browser (the server's own UI)"
    return f"mlflow ui --backend-store-uri {tracking_uri}"


def check_reachable(config: MlflowConfig) -> None:
    """Fail fast (before any actor starts) when a configured tracking server does not answer."""
    if not config.enabled:
        return
    uri = resolve_tracking_uri(config)
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5) as response:
            response.read()
    except (urllib.error.URLError, OSError) as err:
        raise JobInputError(f"mlflow.tracking_uri: no MLflow server answers at {uri} ({err})") from None


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


class MlflowTracker:
    def __init__(self, config: MlflowConfig):
        from mlflow.tracking import MlflowClient

        self.config = config
        self.tracking_uri = resolve_tracking_uri(config)
        self.experiment = config.experiment
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.run_id: str | None = None

    def start(self, params: dict[str, Any], tags: dict[str, str]) -> None:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        try:
            experiment = self.client.get_experiment_by_name(self.experiment)
            experiment_id = (
                experiment.experiment_id if experiment else self.client.create_experiment(self.experiment)
            )
            run = self.client.create_run(experiment_id, run_name=self.config.run_name, tags=tags)
        except MlflowException as err:
            raise JobInputError(f"mlflow: cannot start a run at {self.tracking_uri}: {err.message}") from None
        self.run_id = run.info.run_id
        items = [Param(key, _param_value(value)) for key, value in sorted(flatten(params).items())]
        for start in range(0, len(items), _BATCH):
            self.client.log_batch(self.run_id, params=items[start : start + _BATCH], synchronous=True)

    def finish(self, summary: JobSummary, resolved_config: dict[str, Any], status: str) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(name, value, now, 0) for name, value in summary.metrics().items()]
        for position, count in enumerate(summary.accepted_per_position):
            metrics.append(Metric("accepted_at_position", float(count), now, position))
        self.client.log_batch(self.run_id, metrics=metrics, synchronous=True)
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
            self.client.log_artifacts(self.run_id, str(folder))
        self.client.set_terminated(self.run_id, status=status)

    def fail(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status="FAILED")

    def describe(self) -> list[tuple[str, str]]:
        return [
            ("mlflow run", f"{self.run_id} in experiment '{self.experiment}' at {self.tracking_uri}"),
            ("mlflow ui", ui_command(self.tracking_uri)),
        ]


def make_tracker(config: MlflowConfig) -> MlflowTracker | NullTracker:
    return MlflowTracker(config) if config.enabled else NullTracker()


def _param_value(value: Any) -> str:
    text = "null" if value is None else str(value)
    return text if len(text) <= 6000 else text[:5997] + "..."
