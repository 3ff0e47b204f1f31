"""Hydra sweeps of the main job, as a user runs them: `python -m jobs.generate -m key=a,b ...`.

- A 2-cell sweep against a real `mlflow server`: both cells run, each with its own output directory and
  a FINISHED run, both children of one FINISHED parent run that has the sweep's overrides as params.
  (The driver joins the test session's Ray by address and runs from this checkout, so that Ray's workers
  import this checkout's code.)
- A sweep whose cells all fail: every cell still runs, the process exits 2 once, after the last one, and
  Hydra's sweep directory is under `runs/` of the working directory (no `multirun/` there).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def sweep_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", RAY_AUTH_MODE="token", PYTHONPATH=str(REPO))


# slow: two whole jobs in a subprocess; the default suite runs a sweep in test_every_cell_runs_and_the_sweep_exits_non_zero_after_the_last
@pytest.mark.slow
def test_two_cell_sweep_has_two_child_runs_under_one_parent(
    mlflow_server, tiny_pair, prompts_jsonl, tmp_path, ray_local
):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "jobs.generate", "-m", "spectr.num_drafts=1,2",
        f"model.target={tiny_pair['target']}", f"model.draft={tiny_pair['draft']}",
        f"data.path={prompts_jsonl}", "data.limit=8", f"output_dir={out}", "shard_size=4",
        "ray.num_actors=1", f"ray.address={ray_local.get_runtime_context().gcs_address}",
        "spectr.method=spectr", "spectr.draft_length=2", "spectr.max_new_tokens=6", f"mlflow.tracking_uri={mlflow_server}",
        "mlflow.experiment=sweep-test", "progress=false", f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=sweep_env(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "sweep: 2 cell(s), 0 failed" in done.stdout

    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("sweep-test")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("job") == "generate-sweep"]
    children = sorted(
        (r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id),
        key=lambda r: r.data.params["spectr.num_drafts"],
    )
    assert len(runs) == 3 and parent.info.status == "FINISHED"
    assert parent.data.params["spectr.num_drafts"] == "1,2" and parent.data.params["data.limit"] == "8"
    assert [r.data.params["spectr.num_drafts"] for r in children] == ["1", "2"]
    assert [r.info.run_name for r in children] == ["num_drafts=1", "num_drafts=2"]
    assert [r.info.status for r in children] == ["FINISHED", "FINISHED"]
    dirs = [r.data.tags["output_dir"] for r in children]
    assert dirs == [str(out / "spectr.num_drafts=1"), str(out / "spectr.num_drafts=2")]
    for folder in dirs:
        assert (Path(folder) / "_SUCCESS").exists() and len(list(Path(folder).glob("part-*.parquet"))) == 2
    assert all(r.data.metrics["prompts_completed"] == 8 for r in children)
    assert (tmp_path / "sweep" / "multirun.yaml").exists() and not (REPO / "multirun").exists()


def test_every_cell_runs_and_the_sweep_exits_non_zero_after_the_last(tmp_path, ray_local):
    missing = [tmp_path / "missing-a.jsonl", tmp_path / "missing-b.jsonl"]
    command = [
        sys.executable, "-m", "jobs.generate", "-m", f"data.path={missing[0]},{missing[1]}",
        "mlflow.enabled=false", "progress=false",
        f"ray.address={ray_local.get_runtime_context().gcs_address}",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=sweep_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, (done.stdout + done.stderr)[-4000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: data.path")]
    assert len(errors) == 2 and str(missing[0]) in errors[0] and str(missing[1]) in errors[1]
    assert "sweep: 2 cell(s), 2 failed" in done.stdout
    (sweep_dir,) = (tmp_path / "runs" / "sweeps").iterdir()
    assert (sweep_dir / "multirun.yaml").exists() and not (tmp_path / "multirun").exists()
    assert not (tmp_path / "outputs").exists()
