"""MLflow for the draft trainer (on the driver, through `pipeline.tracking.MlflowRun`): the config as params,
the loss as it trains (at most one point per `mlflow.log_every_s`), the final size and acceptance.

`tracker_for(config)` is None when `mlflow.enabled=false`. Not here: training.
"""

from __future__ import annotations

import time
from typing import Any

from pipeline.tracking import MlflowRun, check_reachable


class DraftTracker:
    def __init__(self, config):
        check_reachable(config.mlflow)
        self.mlflow = config.mlflow
        self.run: MlflowRun | None = None  # made once the checks pass: a refused job leaves no MLflow store
        self.every_s = float(config.mlflow.log_every_s)
        self._last = 0.0

    def started(self, config, draft_parameters: int, target_parameters: int, train_sequences: int) -> None:
        params = {**config.to_dict(), "draft_parameters": draft_parameters, "target_parameters": target_parameters,
                  "train_sequences": train_sequences}
        self.run = MlflowRun(self.mlflow)
        self.run.start(params, tags={"job": "train_draft", "target": config.model.target})

    def step(self, step: int, loss: float) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        self._log({"train_loss": loss}, step)

    def finished(self, result) -> None:
        self._log({"acceptance": result.acceptance, "final_loss": result.final_loss,
                   "train_seconds": result.train_seconds, "draft_parameters": result.draft_parameters,
                   **({"compare_acceptance": result.compare_acceptance}
                      if result.compare_acceptance is not None else {}),
                   **({"fit_acceptance": result.fit_acceptance} if result.fit_acceptance is not None else {})},
                  result.steps)
        self.run.terminate()

    def fail(self) -> None:
        if self.run is not None:
            self.run.fail()

    def _log(self, values: dict[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.run.log_metrics([Metric(key, float(value), now, step) for key, value in values.items()])


def tracker_for(config) -> DraftTracker | None:
    return DraftTracker(config) if config.mlflow.enabled else None
