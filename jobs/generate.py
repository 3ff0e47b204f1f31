"""`python -m jobs.generate [key=value ...]`: the main job, a thin Hydra entry point.

Hydra composes conf/generate.yaml and its groups; `generate(cfg)` turns that into a typed
`GenerateConfig` and runs `pipeline.generate.job.run_generate`. Tests call `generate` (or the runner)
directly. User errors (bad config, data, models, output dir) print one line and exit 2; a job whose
failed-prompt fraction exceeds `max_failed_fraction` prints the summary and exits 1.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from pipeline.errors import JobInputError
from pipeline.generate.config import from_omegaconf
from pipeline.generate.job import JobReport, run_generate
from pipeline.generate.summary import format_report


def generate(cfg: DictConfig) -> JobReport:
    """Run the job for a composed config; raises JobInputError for user errors."""
    return run_generate(from_omegaconf(cfg))


@hydra.main(version_base="1.3", config_path="../conf", config_name="generate")
def main(cfg: DictConfig) -> None:
    try:
        report = generate(cfg)
    except JobInputError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(format_report(report))
    sys.exit(report.exit_code)


if __name__ == "__main__":
    main()
