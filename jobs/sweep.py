"""The Hydra callback behind `python -m jobs.generate -m key=a,b ...`: a parent MLflow run over the cells.

Registered in conf/generate.yaml (`hydra.callbacks.mlflow_sweep`); it acts only in a multirun:

- `on_multirun_start`: the parent run (`pipeline.generate.sweep.SweepRun`) with the sweep's overrides as
  params, and `<sweep dir>/_mlflow_sweep.json`, from which every cell nests its run under it (a server that
  does not answer within `mlflow.shutdown_timeout_s`, or answers 5xx: no parent run, a warning);
- `on_job_start`: masks the credentials in Hydra's `multirun.yaml` (saved by the sweeper before the first
  cell, with the whole config), mode 0o640;
- `on_job_end`: records each cell's exit code (its overrides as the report prints them: redacted) (the cell returns it; it never calls `sys.exit`, which
  would end the sweep);
- `on_multirun_end`: ends the parent run and, once every cell ran, exits non-zero if any cell failed.

Ray and the actors are the cells' (`pipeline.generate.keep.SWEEP_KEEPER`): started by the first cell and
kept while the next cells share its `model.*` and `ray.*`; shut down here after the last cell.
An interrupted sweep (Ctrl-C, SIGTERM) marks the parent run KILLED on the way out (atexit).
Not here: the cells themselves (`jobs.generate`).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from pipeline.config import MlflowConfig, build_section, check_mlflow
from pipeline.generate.keep import SWEEP_KEEPER
from pipeline.generate.sweep import SweepRun
from pipeline.redact import redact
from pipeline.tracking import reachable


def redact_file(path: Path) -> None:
    """Rewrite a text file with its credentials masked (`pipeline.redact`), mode 0o640; nothing if absent."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return
    masked = redact(text)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    with os.fdopen(fd, "w") as f:
        f.write(masked)
    os.replace(tmp, path)


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

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        mlflow = build_section(
            MlflowConfig, OmegaConf.to_container(config.mlflow, resolve=True), prefix="mlflow"
        )
        check_mlflow(mlflow)
        down = reachable(mlflow, timeout_s=mlflow.shutdown_timeout_s)  # a 4xx raises: the sweep's config error
        if down:  # as a job does: no parent run, a warning (each cell checks for itself)
            print(f"warning: mlflow: {down}; the sweep goes on without a parent run", file=sys.stderr)
            mlflow = dataclasses.replace(mlflow, enabled=False)
        overrides, swept = parse_overrides(list(config.hydra.overrides.task))
        overrides = {key: redact(value) for key, value in overrides.items()}
        self.sweep = SweepRun(mlflow, config.hydra.sweep.dir)
        self.sweep.start(overrides, swept)
        atexit.register(self._killed)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Hydra's sweeper saved `multirun.yaml` (the whole config, world-readable) before the first cell: its
        credentials masked, and read by its owner and group only."""
        if self.sweep is not None:
            redact_file(Path(config.hydra.sweep.dir) / "multirun.yaml")

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if self.sweep is None:
            return  # a single run: nothing to tie together
        value = getattr(job_return, "_return_value", None)
        code = value if isinstance(value, int) and not isinstance(value, bool) else 1
        overrides = redact(" ".join(config.hydra.overrides.task))  # the report prints them
        self.sweep.cell_ended(int(config.hydra.job.num), overrides, code)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.sweep is None:
            return
        code = self.sweep.finish()
        SWEEP_KEEPER.close()  # the cells' actors and Ray
        print(self.sweep.report())
        if code:
            sys.exit(code)  # after every cell ran: Hydra's sweep is over

    def _killed(self) -> None:
        SWEEP_KEEPER.close()
        if self.sweep is not None and not self.sweep.ended:
            self.sweep.finish(status="KILLED")
