"""A sweep of the generation job (`python -m jobs.generate -m key=a,b ...`): its parent MLflow run and cells.

Every cell is an ordinary job with its own output directory and MLflow run; this module holds what ties
them together, without Hydra (the Hydra callback that drives it is `jobs.sweep`):

- `SweepRun`: the parent run, with the sweep's overrides as params (`spectr.num_drafts` = `1,2`), each
  cell's outcome as tags, FINISHED when every cell succeeded, else FAILED (KILLED when the sweep was
  interrupted). Its id goes into `<sweep dir>/_mlflow_sweep.json`, which each cell reads
  (`read_sweep`) to nest its run under it.
- `cell_output_dir`: with an explicit `output_dir`, each cell writes into a subfolder named by its swept
  values (with `output_dir=null` each cell already gets its own `runs/generate-<config hash>`);
  `cell_run_name` names its run the same way (`num_drafts=2 draft_length=4`).

Not here: running a cell (`pipeline.generate.job`), Hydra's sweep itself.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.config import MlflowConfig
from pipeline.redact import redact
from pipeline.tracking import MlflowRun

SWEEP_FILE = "_mlflow_sweep.json"

log = logging.getLogger("pipeline")


@dataclass
class SweepRecord:
    """`_mlflow_sweep.json`: the parent run and which overrides the sweep varies."""

    run_id: str | None
    tracking_uri: str | None
    swept_keys: list[str] = field(default_factory=list)


def read_sweep(sweep_dir: str | Path) -> SweepRecord | None:
    path = Path(sweep_dir) / SWEEP_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return SweepRecord(raw.get("run_id"), raw.get("tracking_uri"), list(raw.get("swept_keys", [])))


def write_sweep(sweep_dir: str | Path, record: SweepRecord) -> None:
    path = Path(sweep_dir) / SWEEP_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{SWEEP_FILE}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(asdict(record), indent=1))
    os.replace(tmp, path)


def cell_name(cell_overrides: dict[str, str], swept_keys: list[str]) -> str:
    """A folder name from a cell's swept values: `spectr.num_drafts=2,spectr.draft_length=4`."""
    parts = [f"{key}={cell_overrides[key]}" for key in swept_keys if key in cell_overrides]
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", ",".join(parts)) or "cell"


def cell_run_name(cell_overrides: dict[str, str], swept_keys: list[str]) -> str:
    """A cell's MLflow run name from its swept values: `num_drafts=2 draft_length=4`."""
    parts = [f"{key.rsplit('.', 1)[-1]}={cell_overrides[key]}" for key in swept_keys if key in cell_overrides]
    return " ".join(parts)[:250] or "cell"


def cell_output_dir(output_dir: str, cell_overrides: dict[str, str], swept_keys: list[str]) -> str:
    return f"{output_dir.rstrip('/')}/{cell_name(cell_overrides, swept_keys)}"


@dataclass
class CellOutcome:
    number: int
    overrides: str  # the cell's overrides as typed: "spectr.num_drafts=2 spectr.draft_length=4"
    exit_code: int


class SweepRun:
    """The parent MLflow run of one sweep (`mlflow.enabled=false`: no run, outcomes only)."""

    def __init__(self, config: MlflowConfig, sweep_dir: str | Path):
        self.config = config
        self.sweep_dir = Path(sweep_dir)
        self.run = MlflowRun(config) if config.enabled else None
        self.cells: list[CellOutcome] = []
        self.ended = False

    @property
    def run_id(self) -> str | None:
        return self.run.run_id if self.run else None

    def start(self, overrides: dict[str, str], swept_keys: list[str]) -> None:
        """The parent run with the sweep's overrides as params; then the sweep file for the cells."""
        if self.run is not None:
            name = "sweep " + " ".join(f"{key}={overrides[key]}" for key in swept_keys)
            tags = {"job": "generate-sweep", "sweep_dir": str(self.sweep_dir.resolve()),
                    "sweep_overrides": " ".join(f"{k}={v}" for k, v in overrides.items())}  # fmt: skip
            self.run.start(overrides, tags, run_name=self.config.run_name or name[:250])
            log.info("mlflow: sweep run %s (parent of every cell's run)", self.run_id)
        record = SweepRecord(self.run_id, redact(self.run.tracking_uri) if self.run else None, list(swept_keys))
        write_sweep(self.sweep_dir, record)

    def cell_ended(self, number: int, overrides: str, exit_code: int) -> None:
        self.cells.append(CellOutcome(number, overrides, exit_code))
        if self.run is not None:
            self.run.set_tags({f"cell_{number}": f"exit {exit_code}: {overrides}"})

    @property
    def exit_code(self) -> int:
        """0 when every cell succeeded, else the largest cell exit code (2: bad input, 1: failed)."""
        return max((cell.exit_code for cell in self.cells), default=0)

    def finish(self, status: str | None = None) -> int:
        """End the parent run (FINISHED, or FAILED when a cell failed); returns the sweep's exit code."""
        if self.ended:
            return self.exit_code
        self.ended = True
        failed = [cell for cell in self.cells if cell.exit_code]
        if self.run is not None:
            self.run.set_tags({"cells": str(len(self.cells)), "cells_failed": str(len(failed))})
            self.run.terminate(status or ("FAILED" if failed else "FINISHED"))
        return self.exit_code

    def report(self) -> str:
        lines = [f"sweep: {len(self.cells)} cell(s), {sum(1 for c in self.cells if c.exit_code)} failed"]
        lines += [f"  #{c.number} exit {c.exit_code}  {redact(c.overrides)}" for c in self.cells]
        if self.run is not None:
            lines.append(f"  mlflow parent run {self.run_id} at {redact(self.run.tracking_uri)}")
        return "\n".join(lines)
