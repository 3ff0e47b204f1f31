"""`python -m jobs.generate [key=value ...]`: the main job, a thin Hydra entry point.

Hydra composes conf/generate.yaml and its groups; `generate(cfg)` turns that into a typed
`GenerateConfig` and runs `pipeline.generate.job.run_generate`. Tests call `generate` (or the runner)
directly. User errors (bad config, data, models, output dir) print one line and exit 2; a job whose
failed-prompt fraction exceeds `max_failed_fraction` prints the summary and exits 1. SIGTERM ends the job
like Ctrl-C (its MLflow run is marked KILLED).

`python -m jobs.generate -m key=a,b ...` is a sweep: every cell runs, each with its own output directory
and MLflow run, nested under one parent run (`jobs.sweep.SweepCallback`); a cell returns its exit code
instead of exiting, and the process exits non-zero only after the last cell, if any failed. Cells that share
`model.*` and `ray.*` run on one Ray and the same actors: the pair loads once (`pipeline.generate.keep`).
Hydra's sweep directory is `runs/sweeps/<time>` (conf/generate.yaml).
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from pipeline.config import resolved_container
from pipeline.errors import JobInputError
from pipeline.generate.config import from_dict, from_omegaconf
from pipeline.generate.job import JobReport, run_generate
from pipeline.generate.keep import SWEEP_KEEPER
from pipeline.generate.summary import format_report
from pipeline.generate.sweep import cell_output_dir, cell_run_name, read_sweep
from pipeline.redact import redact

log = logging.getLogger("pipeline")


def generate(cfg: DictConfig) -> JobReport:
    """Run the job for a composed config; raises JobInputError for user errors."""
    return run_generate(from_omegaconf(cfg))


def sweep_cell_config(cfg: DictConfig, sweep_dir: str) -> dict[str, Any]:
    """A cell's config: its run nested under the sweep's parent run and named by the cell's swept values,
    and with an explicit `output_dir`, a subfolder per cell named the same way."""
    raw = resolved_container(cfg)
    sweep = read_sweep(sweep_dir)
    if sweep is None:
        return raw
    task = {key: redact(value)  # a swept URI's password names no folder or run
            for key, value in (item.split("=", 1) for item in HydraConfig.get().overrides.task if "=" in item)}
    mlflow = raw.setdefault("mlflow", {})
    if sweep.run_id and not mlflow.get("parent_run_id"):
        mlflow["parent_run_id"] = sweep.run_id
    if not mlflow.get("run_name"):
        mlflow["run_name"] = cell_run_name(task, sweep.swept_keys)
    if raw.get("output_dir"):
        raw["output_dir"] = cell_output_dir(raw["output_dir"], task, sweep.swept_keys)
    return raw


def run_cell(cfg: DictConfig) -> int:
    """One cell of a sweep: the job's exit code, never `sys.exit` (that would end Hydra's sweep). Cells with
    the same `model.*` and `ray.*` share Ray and the actors, the pair loaded once (`SWEEP_KEEPER`)."""
    try:
        report = run_generate(from_dict(sweep_cell_config(cfg, HydraConfig.get().sweep.dir)), keep=SWEEP_KEEPER)
    except JobInputError as err:
        print(f"error: {redact(str(err))}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - one failed cell must not stop the others
        log.exception("sweep cell failed: %s: %s", type(err).__name__, err)
        return 1
    print(redact(format_report(report)))
    return report.exit_code


def _multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


@hydra.main(version_base="1.3", config_path="../conf", config_name="generate")
def main(cfg: DictConfig) -> int | None:
    if _multirun():
        return run_cell(cfg)
    try:
        report = generate(cfg)
    except JobInputError as err:
        print(f"error: {redact(str(err))}", file=sys.stderr)
        sys.exit(2)
    print(redact(format_report(report)))  # no URI's password on the console
    sys.exit(report.exit_code)


def _terminated(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminated)
    main()
