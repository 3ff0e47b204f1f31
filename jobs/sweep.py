"""The Hydra callback behind `python -m jobs.generate -m key=a,b ...`: a parent MLflow run over the cells.

Registered in conf/generate.yaml (`hydra.callbacks.mlflow_sweep`); it acts only in a multirun:

- `on_multirun_start`: the parent run (`pipeline.generate.sweep.SweepRun`) with the sweep's overrides as
  params, and `<sweep dir>/_mlflow_sweep.json`, from which every cell nests its run under it;
- `on_job_end`: records each cell's exit code (the cell returns it; it never calls `sys.exit`, which
  would end the sweep);
- `on_multirun_end`: ends the parent run and, once every cell ran, exits non-zero if any cell failed.

Ray is started (or joined) once, before the first cell, with that cell's `ray` settings, and kept for the
whole sweep: each cell's job finds it running and uses it (its actors are its own).
An interrupted sweep (Ctrl-C, SIGTERM) marks the parent run KILLED on the way out (atexit).
Not here: the cells themselves (`jobs.generate`).
"""

from __future__ import annotations

import atexit
import contextlib
import sys
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from pipeline.config import MlflowConfig, build_section, check_mlflow
from pipeline.generate.cluster import ray_session
from pipeline.generate.config import RayConfig
from pipeline.generate.sweep import SweepRun


def parse_overrides(overrides: list[str]) -> tuple[dict[str, str], list[str]]:
    """({key: value as typed}, the keys that are swept) of a sweep's task overrides."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    values = {o.get_key_element(): o.input_line.split("=", 1)[1] for o in parsed if "=" in o.input_line}
    swept = [o.get_key_element() for o in parsed if o.is_sweep_override()]
    return values, swept


class SweepCallback(Callback):
    """See the module docstring."""

    def __init__(self) -> None:
        self.sweep: SweepRun | None = None
        self.ray: contextlib.ExitStack | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        mlflow = build_section(
            MlflowConfig, OmegaConf.to_container(config.mlflow, resolve=True), prefix="mlflow"
        )
        check_mlflow(mlflow)
        overrides, swept = parse_overrides(list(config.hydra.overrides.task))
        self.sweep = SweepRun(mlflow, config.hydra.sweep.dir)
        self.sweep.start(overrides, swept)
        atexit.register(self._killed)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self.sweep is None or self.ray is not None:
            return
        ray = build_section(RayConfig, OmegaConf.to_container(config.ray, resolve=True), prefix="ray")
        self.ray = contextlib.ExitStack()
        self.ray.enter_context(ray_session(ray))  # ended by on_multirun_end (or at exit)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if self.sweep is None:
            return  # a single run: nothing to tie together
        value = getattr(job_return, "_return_value", None)
        code = value if isinstance(value, int) and not isinstance(value, bool) else 1
        overrides = " ".join(config.hydra.overrides.task)
        self.sweep.cell_ended(int(config.hydra.job.num), overrides, code)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.sweep is None:
            return
        code = self.sweep.finish()
        self._stop_ray()
        print(self.sweep.report())
        if code:
            sys.exit(code)  # after every cell ran: Hydra's sweep is over

    def _stop_ray(self) -> None:
        if self.ray is not None:
            self.ray.close()
            self.ray = None

    def _killed(self) -> None:
        self._stop_ray()
        if self.sweep is not None and not self.sweep.ended:
            self.sweep.finish(status="KILLED")
