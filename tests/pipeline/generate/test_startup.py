"""The startup phase line and its MLflow metrics (`pipeline.generate.job.startup_phases`, `startup_line`)."""

from __future__ import annotations

import pytest

from pipeline.generate.job import startup_line, startup_phases
from pipeline.generate.summary import JobSummary


def test_the_phases_add_up_to_the_startup_and_become_metrics():
    workers = [{"startup": {"load_s": 6.0}}, {"startup": {"load_s": 8.5}}, {}]
    phases = startup_phases(checked_s=3.0, ray_s=14.0, actors_s=12.0, workers=workers, waiting_mlflow_s=0.5,
                            mlflow_s=2.0)
    assert phases == pytest.approx({"check": 3.0, "ray_start": 11.0, "actor_spawn": 3.5, "actor_load": 8.5,
                                    "mlflow_wait": 0.5, "mlflow_start": 2.0})
    line = startup_line(phases)
    assert line.startswith("startup 26.5 s = check 3.0 + ray start 11.0 + actor spawn 3.5 + actor load 8.5")
    assert "(mlflow start 2.0 s, overlapped)" in line
    summary = JobSummary.build([{}], [{}], num_prompts=1, wall_time_s=30.0, generation_s=2.0, startup_s=26.5,
                               num_actors=2, actor_device="cpu", output_dir="o", num_shards=1)
    summary.startup_phases = phases
    metrics = summary.metrics()
    assert metrics["startup_actor_load_s"] == 8.5 and metrics["startup_ray_start_s"] == 11.0
    assert startup_line(startup_phases(1.0, 2.0, 3.0, [], 0.0, None)).endswith("mlflow wait 0.0")  # no MLflow
