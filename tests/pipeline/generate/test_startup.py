"""The job's startup: its phase line and MLflow metrics (`pipeline.generate.job.startup_phases`,
`startup_line`), and what runs off its critical path.

- The phases add up to the startup; when Ray started during the check, the check is shown as overlapped and
  the driver's wait for it after Ray was up is its own phase (`check_wait`).
- MLflow's run (its import, store and run) starts on the background thread once the actors are spawned.
- A job that starts its own Ray starts it while the input is checked; one refused then still exits 2 with its error (a
  fresh process: the slow test).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
from tiny_pair_support import job_config

from pipeline.generate import job as runner
from pipeline.generate.config import from_dict
from pipeline.generate.job import run_generate, startup_line, startup_phases
from pipeline.generate.summary import JobSummary

REPO = Path(__file__).resolve().parents[3]


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


def test_a_check_that_overlapped_rays_start_is_shown_aside():
    workers = [{"startup": {"load_s": 4.0}}]
    phases = startup_phases(checked_s=5.0, ray_s=3.0, actors_s=4.5, workers=workers, waiting_mlflow_s=0.0,
                            mlflow_s=2.5, ray_during_check=True)
    assert phases == pytest.approx({"ray_start": 3.0, "check_wait": 2.0, "check": 5.0, "actor_spawn": 0.5,
                                    "actor_load": 4.0, "mlflow_wait": 0.0, "mlflow_start": 2.5})
    assert startup_line(phases) == ("startup 9.5 s = ray start 3.0 + check wait 2.0 + actor spawn 0.5 + actor load "
                                    "4.0 + mlflow wait 0.0 (check 5.0 s, mlflow start 2.5 s, overlapped)")
    quick = startup_phases(2.0, 3.0, 4.5, workers, 0.0, None, ray_during_check=True)  # the check ended first
    assert quick["check_wait"] == 0.0 and startup_line(quick).endswith("(check 2.0 s, overlapped)")


def test_mlflow_starts_off_the_driver_thread_once_the_actors_are_spawned(
    tiny_pair, prompts_jsonl, tmp_path, ray_local, monkeypatch
):
    events: list[tuple[str, str]] = []
    make_tracker, pool_class = runner.make_tracker, runner.ShardActorPool

    def tracker_made(*args, **kwargs):
        events.append(("mlflow", threading.current_thread().name))
        return make_tracker(*args, **kwargs)

    def pool_spawned(*args, **kwargs):
        pool = pool_class(*args, **kwargs)
        events.append(("actors spawned", threading.current_thread().name))
        return pool

    monkeypatch.setattr(runner, "make_tracker", tracker_made)
    monkeypatch.setattr(runner, "ShardActorPool", pool_spawned)
    raw = job_config(tiny_pair, prompts_jsonl, tmp_path / "out", **{
        "data.limit": 4, "shard_size": 4, "ray.num_actors": 1, "spectr.max_new_tokens": 4,
        "mlflow.enabled": True, "mlflow.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "mlflow.system_metrics": False})  # fmt: skip
    report = run_generate(from_dict(raw))
    assert report.exit_code == 0 and report.run_id
    assert [what for what, _ in events] == ["actors spawned", "mlflow"]
    assert events[0][1] == "MainThread" and events[1][1].startswith("mlflow")
    assert "mlflow_start" in report.summary.startup_phases


@pytest.mark.slow  # two fresh processes, each starting a local Ray (~30 s); the phase rules stay in the default suite
def test_a_job_starts_ray_while_it_checks_the_input_and_a_refused_one_exits_2(tiny_pair, prompts_jsonl, tmp_path):
    common = [sys.executable, "-m", "jobs.generate", f"model.target={tiny_pair['target']}",
              f"model.draft={tiny_pair['draft']}", "model.dtype=float32", "spectr.max_new_tokens=4",
              "ray.num_actors=1", "ray.local_num_cpus=1", "mlflow.enabled=false", "progress=false"]
    good = subprocess.run([*common, f"data.path={prompts_jsonl}", "data.limit=4", f"output_dir={tmp_path}/out"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-3000:]
    line = next(line for line in good.stdout.splitlines() if line.startswith("startup "))
    assert " = ray start " in line and " + check wait " in line and ", overlapped)" in line, line
    # duplicate ids: found by the input's scan, after the cheap checks, while Ray starts
    dupes = tmp_path / "dupes.jsonl"
    dupes.write_text('{"id": 1, "prompt": "def"}\n{"id": 1, "prompt": "x"}\n')
    refused = subprocess.run([*common, f"data.path={dupes}", f"output_dir={tmp_path}/refused"],
                             capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines()[-1].startswith("error: ") and "duplicate ids" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "refused").exists()
