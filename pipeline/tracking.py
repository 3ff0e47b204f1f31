"""MLflow for the jobs: one run on an explicit client, its params, metrics, artifacts and end state.

Only drivers use this (workers never talk to MLflow). `MlflowRun` uses an explicit `MlflowClient` on the
configured tracking URI, never the process-global `mlflow.start_run` state. The default tracking URI is a
local SQLite file, `sqlite:///<cwd>/mlflow.db`; `mlflow.tracking_uri` points at a server instead.
Each job decides what it logs (`pipeline.generate.tracking`, `pipeline.benchmark.tracking`).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pipeline.config import MlflowConfig, flatten
from pipeline.errors import JobInputError

PARAMS_PER_BATCH = 100  # MLflow's limit on params per log_batch call
METRICS_PER_BATCH = 500  # below MLflow's limit of 1000 metrics per log_batch call


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


def param_value(value: Any) -> str:
    text = "null" if value is None else str(value)
    return text if len(text) <= 6000 else text[:5997] + "..."


class MlflowRun:
    """One MLflow run of a job: `start` it, log to it, end it with `terminate` (or `fail`)."""

    def __init__(self, config: MlflowConfig):
        from mlflow.tracking import MlflowClient

        self.config = config
        self.tracking_uri = resolve_tracking_uri(config)
        self.experiment = config.experiment
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.run_id: str | None = None

    def start(self, params: dict[str, Any], tags: dict[str, str]) -> str:
        """Create the experiment if needed, then the run with `tags` and the flattened `params`."""
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
        items = [Param(key, param_value(value)) for key, value in sorted(flatten(params).items())]
        for start in range(0, len(items), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[start : start + PARAMS_PER_BATCH], synchronous=True)
        return self.run_id

    def log_metrics(self, metrics: list) -> None:
        """`mlflow.entities.Metric`s, in as few batches as MLflow allows."""
        for start in range(0, len(metrics), METRICS_PER_BATCH):
            self.client.log_batch(
                self.run_id, metrics=metrics[start : start + METRICS_PER_BATCH], synchronous=True
            )

    def log_artifacts(self, folder: Path) -> None:
        self.client.log_artifacts(self.run_id, str(folder))

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def terminate(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)

    def fail(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status="FAILED")

    def describe(self) -> list[tuple[str, str]]:
        return [
            ("mlflow run", f"{self.run_id} in experiment '{self.experiment}' at {self.tracking_uri}"),
            ("mlflow ui", ui_command(self.tracking_uri)),
        ]
