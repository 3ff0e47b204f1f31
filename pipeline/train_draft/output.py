"""The output directory of a draft run: refuse what is not ours, checkpoint, resume, and the final draft.

Layout: the draft itself at the top (`config.json`, `model.safetensors`, `generation_config.json` and the
target's tokenizer files: a Hugging Face model directory `jobs.generate model.draft=OUT` loads), and the run's
own files under `_train_draft/` (`run.json`: the run key and what the run said at the end; `checkpoint.pt`:
draft, optimiser and step; `completions.pt`: the target's completions). Not here: training.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import JobInputError

RUN_FOLDER = "_train_draft"


def claim_output(out: str, run_key: str) -> Path:
    """The run folder: a new or empty `out`, or a previous run of this job with the same key; else refuse."""
    root = Path(out).expanduser()
    if root.exists() and not root.is_dir():
        raise JobInputError(f"out: {root} is a file; expected a directory for the draft")
    run_file = root / RUN_FOLDER / "run.json"
    if root.exists() and any(root.iterdir()):
        if not run_file.is_file():
            raise JobInputError(f"out: {root} holds something else (not a previous run of jobs.train_draft); "
                                "choose an empty or new directory")
        previous = json.loads(run_file.read_text()).get("run_key")
        if previous != run_key:
            raise JobInputError(f"out: {root} holds a run of jobs.train_draft with another target, data, draft "
                                "or loss; choose another directory (only steps and max_minutes may change)")
    folder = root / RUN_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    if not run_file.exists():
        write_json(run_file, {"run_key": run_key})
    return folder


def write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    tmp.replace(path)


def save_checkpoint(folder: Path, draft: Any, optimizer: Any, step: int, generator: torch.Generator,
                    seconds: float) -> None:
    tmp = folder / "checkpoint.pt.tmp"
    torch.save({"draft": draft.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "generator": generator.get_state(), "seconds": seconds}, tmp)
    tmp.replace(folder / "checkpoint.pt")


def load_checkpoint(folder: Path, draft: Any, optimizer: Any, generator: torch.Generator) -> tuple[int, float]:
    """(step, training seconds so far) of the last checkpoint, restored into draft, optimiser and generator;
    (0, 0.0) when there is none."""
    path = folder / "checkpoint.pt"
    if not path.exists():
        return 0, 0.0
    saved = torch.load(path, weights_only=True, map_location="cpu")
    draft.load_state_dict(saved["draft"])
    optimizer.load_state_dict(saved["optimizer"])
    generator.set_state(saved["generator"])
    return int(saved["step"]), float(saved["seconds"])


def save_draft(root: Path, draft: Any, tokenizer: Any, save_dtype: str) -> None:
    """The draft as a Hugging Face model directory with the target's tokenizer: staged, then moved in."""
    import copy

    staging = root / RUN_FOLDER / "staging"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    copy.deepcopy(draft).cpu().to(getattr(torch, save_dtype)).save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    for path in staging.iterdir():
        path.replace(root / path.name)
    staging.rmdir()
