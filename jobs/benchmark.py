"""`python -m jobs.benchmark [key=value ...]`: the benchmark job, a thin Hydra entry point.

Hydra composes conf/benchmark.yaml (the main job's `model`, `data` and `mlflow` groups plus the
`bench` group); `benchmark(cfg)` turns that into a typed `BenchConfig` and runs
`pipeline.benchmark.job.run_benchmark`, which prints nothing: this entry point prints its table. Tests call
`benchmark` directly. Bad config or input prints one line and exits 2; a configuration that failed to
run exits 1 after the report.

    python -m jobs.benchmark                          # the default grid on the embedded pair
    python -m jobs.benchmark bench=smoke              # seconds-long
    python -m jobs.benchmark output_dir=benchmarks/results bench.batch_sizes=[1]
"""

from __future__ import annotations

import shlex
import sys

import hydra
from omegaconf import DictConfig

from pipeline.benchmark.config import bench_config_from_omegaconf
from pipeline.benchmark.job import BenchmarkReport, run_benchmark
from pipeline.errors import JobInputError
from pipeline.redact import redact


def benchmark(cfg: DictConfig, command: str | None = None) -> BenchmarkReport:
    """Run the benchmark for a composed config; raises JobInputError for user errors."""
    return run_benchmark(bench_config_from_omegaconf(cfg), command=command)


@hydra.main(version_base="1.3", config_path="../conf", config_name="benchmark")
def main(cfg: DictConfig) -> None:
    command = "python -m jobs.benchmark " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    try:
        report = benchmark(cfg, command=command.strip())
    except JobInputError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(report.text)
    print(f"\nresults: {report.output_dir}")
    if report.run_id:
        print(f"mlflow run {report.run_id} at {redact(report.tracking_uri)}")
    sys.exit(report.exit_code)


if __name__ == "__main__":
    main()
