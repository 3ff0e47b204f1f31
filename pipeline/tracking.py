"""MLflow for the jobs: one run on an explicit client, its params, tags, metrics, inputs and end state.

Only drivers use this (workers never talk to MLflow). `MlflowRun` uses an explicit `MlflowClient` on the
configured tracking URI, never the process-global `mlflow.start_run` state; MLflow's system-metrics
monitor, which the fluent API would start, is started here on the run id (`start_system_metrics`). The
default tracking URI is `MLFLOW_TRACKING_URI` from the environment when set, else a local SQLite file,
`sqlite:///<cwd>/mlflow.db`; `mlflow.tracking_uri` points at a server instead (it wins over the environment). Experiments the jobs create carry `mlflow.experimentKind=custom_model_development`, so the
MLflow UI opens them in its model-training pages.

Each job decides what it logs (`pipeline.generate.tracking`, `pipeline.benchmark.tracking`). Not here:
which run a job continues (the generation job keeps that in its output directory).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pipeline.config import PROJECT_ROOT, MlflowConfig, flatten
from pipeline.errors import JobInputError
from pipeline.redact import install_log_filter, redact

PARAMS_PER_BATCH = 100  # MLflow's limit on params per log_batch call
METRICS_PER_BATCH = 500  # below MLflow's limit of 1000 metrics per log_batch call
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
PARENT_RUN_TAG = "mlflow.parentRunId"

log = logging.getLogger("pipeline")


def resolve_tracking_uri(config: MlflowConfig) -> str:
    """`mlflow.tracking_uri`; unset, MLflow's own `MLFLOW_TRACKING_URI` from the environment (as the `mlflow`
    command reads it: a cluster's job environment may set it once for every job), else a local SQLite file."""
    if config.tracking_uri:
        return config.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{(Path.cwd() / 'mlflow.db').resolve()}"


def ui_command(tracking_uri: str) -> str:
    """The command that opens the MLflow UI on these runs."""
    if tracking_uri.startswith(("http://", "https://")):
        return f"open {tracking_uri} in a browser (the server's own UI)"
    return f"mlflow ui --backend-store-uri {tracking_uri}"


def run_page(tracking_uri: str, experiment_id: str | None, run_id: str | None) -> str:
    """The run's page in the MLflow UI, in its model-training pages (MLflow 3's `workflowType`): on the
    server itself, or where `mlflow ui` serves a local store by default."""
    base = (
        tracking_uri.rstrip("/")
        if tracking_uri.startswith(("http://", "https://"))
        else "http://127.0.0.1:5000"
    )
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def check_reachable(config: MlflowConfig) -> None:
    """Fail fast (before any actor starts) when a configured tracking server does not answer."""
    down = reachable(config)
    if down:
        raise JobInputError(f"mlflow.tracking_uri: {down}")


def reachable(config: MlflowConfig, timeout_s: float = 5.0) -> str | None:
    """None when the configured server's store answers (one request that reads it: the experiment by name),
    else why not: no answer within `timeout_s`, or a 5xx (the caller may go on without MLflow). A 4xx the user
    can fix (credentials, a URL that is no MLflow server) raises JobInputError. Local stores: None."""
    import json
    from urllib.parse import quote

    if not config.enabled:
        return None
    uri = resolve_tracking_uri(config)
    if not uri.startswith(("http://", "https://")):
        return None
    path = f"/api/2.0/mlflow/experiments/get-by-name?experiment_name={quote(config.experiment)}"
    try:
        with urllib.request.urlopen(_server_request(uri, path), timeout=timeout_s) as response:
            response.read()
        return None
    except urllib.error.HTTPError as err:
        body = err.read(2000).decode("utf-8", "replace")
        try:
            code = json.loads(body).get("error_code")
        except (ValueError, AttributeError):
            code = None
        if err.code == 404 and code == "RESOURCE_DOES_NOT_EXIST":
            return None  # the store answers: the experiment is created with the run
        if 400 <= err.code < 500:
            raise JobInputError(
                f"mlflow.tracking_uri: the server at {redact(uri)} refuses the job's requests (HTTP {err.code}"
                f"{', ' + code if code else ''}); check the URI and the credentials (MLFLOW_TRACKING_USERNAME / "
                "MLFLOW_TRACKING_PASSWORD, MLFLOW_TRACKING_TOKEN)"
            ) from None
        return f"the MLflow server at {redact(uri)} answers HTTP {err.code}"
    except (urllib.error.URLError, OSError) as err:  # refused, reset, timed out
        return f"no MLflow server answers at {redact(uri)} within {timeout_s:g} s ({redact(str(err))})"


def _server_request(uri: str, path: str) -> urllib.request.Request:
    """GET <server><path>; a `user:password@` in the URI as a basic-auth header, as MLflow's client sends it
    (urllib would take it for part of the host name), else MLflow's own credential variables."""
    import base64
    import os
    from urllib.parse import unquote, urlsplit, urlunsplit

    parts = urlsplit(uri.rstrip("/") + path)
    if parts.username is None and parts.password is None:
        request = urllib.request.Request(parts.geturl())
        user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
        if os.environ.get("MLFLOW_TRACKING_TOKEN"):
            request.add_header("Authorization", "Bearer " + os.environ["MLFLOW_TRACKING_TOKEN"])
        elif user is not None and password is not None:
            request.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
        return request
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
    request = urllib.request.Request(urlunsplit(parts._replace(netloc=netloc)))
    user_pass = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}".encode()
    request.add_header("Authorization", "Basic " + base64.b64encode(user_pass).decode())
    return request


def param_value(value: Any) -> str:
    """A param's or tag's text: no URI's password (`pipeline.redact`), at most MLflow's 6,000 characters."""
    text = "null" if value is None else redact(str(value))
    return text if len(text) <= 6000 else text[:5997] + "..."


def git_commit(root: Path = PROJECT_ROOT) -> str | None:
    """The project's git commit (with `-dirty` when tracked files changed), or None outside a checkout."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root, capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}-dirty" if dirty else commit or None


class MlflowRun:
    """One MLflow run of a job: `start` (or `reopen`) it, log to it, end it with `terminate` (or `fail`)."""

    def __init__(self, config: MlflowConfig):
        from mlflow.tracking import MlflowClient

        self.config = config
        self.tracking_uri = resolve_tracking_uri(config)
        self.experiment = config.experiment
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        install_log_filter()  # MLflow's own handlers (added at its import) mask credentials too
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self._monitor: Any = None

    def experiment_id_for(self, name: str) -> str:
        """The experiment's id; created with the model-training kind tag, which is also added to an
        existing experiment that has no kind yet."""
        experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            return self.client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        if EXPERIMENT_KIND_TAG not in experiment.tags:
            self.client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return experiment.experiment_id

    def start(self, params: dict[str, Any], tags: dict[str, str], run_name: str | None = None) -> str:
        """Create the experiment if needed, then the run with `tags` and the flattened `params`.

        `mlflow.parent_run_id` nests the run under that run."""
        from mlflow.exceptions import MlflowException

        tags = dict(tags)
        if self.config.parent_run_id:
            tags[PARENT_RUN_TAG] = self.config.parent_run_id
        commit = git_commit()
        if commit:
            tags.setdefault("mlflow.source.git.commit", commit.removesuffix("-dirty"))
            tags.setdefault("git_commit", commit)
        try:
            self.experiment_id = self.experiment_id_for(self.experiment)
            run = self.client.create_run(
                self.experiment_id, run_name=run_name or self.config.run_name, tags=_text(tags)
            )
        except MlflowException as err:
            raise JobInputError(f"mlflow: cannot start a run at {self.tracking_uri}: {err.message}") from None
        self.run_id = run.info.run_id
        self.log_params(params)
        return self.run_id

    def reopen(self, run_id: str, params: dict[str, Any], tags: dict[str, str]) -> str:
        """Continue an existing run (a resumed job): status back to RUNNING, new params added (params
        already there keep their first value: MLflow's params cannot change), tags updated."""
        run = self.client.get_run(run_id)
        self.run_id, self.experiment_id = run_id, run.info.experiment_id
        self.client.update_run(run_id, status="RUNNING")
        present = run.data.params
        changed = sorted(
            key
            for key, value in flatten(params).items()
            if key in present and present[key] != param_value(value)
        )
        if changed:
            log.info(
                "mlflow run %s keeps its first value of %s (params cannot change)", run_id, ", ".join(changed)
            )
        self.log_params({key: value for key, value in flatten(params).items() if key not in present})
        tags = dict(tags)
        if self.config.parent_run_id:
            tags[PARENT_RUN_TAG] = self.config.parent_run_id
        self.set_tags(tags)
        return run_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(key, param_value(value)) for key, value in sorted(flatten(params).items())]
        for start in range(0, len(items), PARAMS_PER_BATCH):
            self.client.log_batch(
                self.run_id, params=items[start : start + PARAMS_PER_BATCH], synchronous=True
            )

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(key, value) for key, value in _text(tags).items()]
        if items:
            self.client.log_batch(self.run_id, tags=items, synchronous=True)

    def log_metrics(self, metrics: list) -> None:
        """`mlflow.entities.Metric`s, in as few batches as MLflow allows."""
        for start in range(0, len(metrics), METRICS_PER_BATCH):
            self.client.log_batch(
                self.run_id, metrics=metrics[start : start + METRICS_PER_BATCH], synchronous=True
            )

    def log_dataset(self, name: str, uri: str, digest: str, num_rows: int, context: str = "prompts") -> None:
        """The input data set as an MLflow dataset input: where it is, its digest and its row count
        (a reference only: the rows are not uploaded). Logging the same one again is a no-op."""
        import json

        from mlflow.entities import Dataset, DatasetInput, InputTag

        scheme = uri.split("://", 1)[0] if "://" in uri else "local"
        dataset = Dataset(
            name=name,
            digest=digest[:36],
            source_type=scheme,
            source=json.dumps({"uri": redact(uri)}),
            profile=json.dumps({"num_rows": num_rows}),
        )
        self.client.log_inputs(
            self.run_id, datasets=[DatasetInput(dataset, [InputTag("mlflow.data.context", context)])]
        )

    def start_system_metrics(self, interval_s: float, resume: bool = False) -> None:
        """MLflow's system-metrics monitor (CPU, memory, disk, network; GPUs when NVML is there) on this
        run, as `system/*` metrics. Best effort: without psutil it logs a warning and does nothing."""
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._monitor = SystemMetricsMonitor(
                self.run_id,
                sampling_interval=interval_s,
                resume_logging=resume,
                tracking_uri=self.tracking_uri,
            )
        except ImportError as err:
            log.warning("mlflow system metrics are off: %s", err)
            return
        self._monitor.start()

    def stop_system_metrics(self) -> None:
        if self._monitor is not None:
            self._monitor.finish()
            self._monitor = None

    def log_artifacts(self, folder: Path) -> None:
        self.client.log_artifacts(self.run_id, str(folder))

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def terminate(self, status: str = "FINISHED") -> None:
        import contextlib
        import io

        self.stop_system_metrics()
        with contextlib.redirect_stdout(io.StringIO()) as printed:  # MLflow prints the run's URL, password and all
            self.client.set_terminated(self.run_id, status=status)
        sys.stdout.write(redact(printed.getvalue()))

    def fail(self) -> None:
        """End the run after an exception: KILLED for an interrupt (Ctrl-C, SIGTERM), else FAILED."""
        if self.run_id is None:
            return
        error = sys.exc_info()[1]
        killed = isinstance(error, (KeyboardInterrupt, SystemExit))
        self.terminate("KILLED" if killed else "FAILED")

    def describe(self) -> list[tuple[str, str]]:
        uri = redact(self.tracking_uri)
        return [
            ("mlflow run", f"{self.run_id} in experiment '{self.experiment}' at {uri}"),
            ("mlflow ui", ui_command(uri)),
            ("run page", run_page(uri, self.experiment_id, self.run_id)),
        ]


def _text(tags: dict[str, Any]) -> dict[str, str]:
    return {key: param_value(value) for key, value in tags.items() if value is not None}
