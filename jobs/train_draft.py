"""Hydra entry point: ``python -m jobs.train_draft model.target=DIR data.path=PROMPTS out=DIR [train.loss=tv]``.

Thin on purpose: the composed config becomes a typed `DraftJobConfig`, and
`pipeline.train_draft.training.run_train_draft` distils the draft. Bad config, target, prompts or a held
output directory: one line on stderr, exit 2. Tests call :func:`run` with a composed config.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from pipeline.config import resolved_container
from pipeline.errors import JobInputError
from pipeline.train_draft.config import draft_config_from_mapping
from pipeline.train_draft.tracking import tracker_for
from pipeline.train_draft.training import DraftResult, run_train_draft


def run(cfg: DictConfig) -> DraftResult:
    config = draft_config_from_mapping(resolved_container(cfg))
    tracker = tracker_for(config)
    try:
        result = run_train_draft(config, tracker)
    except BaseException:
        if tracker is not None:
            tracker.fail()
        raise
    if tracker is not None:
        tracker.finished(result)
    return result


OVERFIT_GAP = 0.05  # training-sequence acceptance this far above the held-out one: say that more data would help


def summary_line(result: DraftResult, target: str) -> str:
    compare = ("" if result.compare_acceptance is None
               else f" (compare_draft: {result.compare_acceptance:.3f})")
    fit = ""
    if result.fit_acceptance is not None:
        fit = f"; on training sequences {result.fit_acceptance:.3f}"
        if result.fit_acceptance - result.acceptance >= OVERFIT_GAP:
            fit += " (the head fits its training text better than new text: more prompts help more than more steps)"
    return (f"draft of {result.draft_parameters:,} parameters (target {result.target_parameters:,}) in "
            f"{result.out}: {result.steps} steps, {result.train_seconds / 60:.1f} min, stopped by "
            f"{result.stopped_by}; acceptance sum_x min(p, q) on {result.heldout_positions} held-out positions "
            f"{result.acceptance:.3f}{compare}{fit}; use it: {result.generate_command(target)}")


@hydra.main(config_path="../conf", config_name="train_draft", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        result = run(cfg)
    except JobInputError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(summary_line(result, str(cfg.model.target)))


if __name__ == "__main__":
    main()
