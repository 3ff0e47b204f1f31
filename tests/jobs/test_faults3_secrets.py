"""A sweep whose `mlflow.tracking_uri` carries `user:password@` leaves the password in no file under its
folders and in nothing it prints (issue #52, item 4).

The fault is injected from outside: a unique password in the URI given on the command line of a real
`python -m jobs.generate -m` process. Before the fix the sweep's report printed each cell's raw overrides
(the password included) and Hydra's `multirun.yaml` kept the whole config, world-readable.

- light: two cells that fail at once (their input is missing), MLflow off: the report and `multirun.yaml`;
- slow: two cells that run, on the session's real MLflow server: the parent and child runs too.
"""

from __future__ import annotations

import stat
import subprocess
import sys
import uuid

import pytest
from test_generate_secrets import files_holding
from test_generate_sweep import REPO, sweep_env


def run_sweep(arguments: list[str], cwd, ray_local, timeout: int):
    command = [sys.executable, "-m", "jobs.generate", "-m", *arguments, "progress=false",
               f"ray.address={ray_local.get_runtime_context().gcs_address}"]  # fmt: skip
    return subprocess.run(command, cwd=cwd, env=sweep_env(), capture_output=True, text=True, timeout=timeout)


def test_a_sweeps_report_and_multirun_yaml_hold_no_password(tmp_path, ray_local):
    password = f"pw-{uuid.uuid4().hex}"
    missing = [tmp_path / "missing-a.jsonl", tmp_path / "missing-b.jsonl"]
    done = run_sweep(
        [f"data.path={missing[0]},{missing[1]}", "mlflow.enabled=false",
         f"mlflow.tracking_uri=http://alice:{password}@127.0.0.1:9", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        tmp_path, ray_local, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2 and "sweep: 2 cell(s), 2 failed" in done.stdout, (done.stdout + done.stderr)[-3000:]
    assert password not in done.stdout + done.stderr
    assert r"mlflow.tracking_uri=http\://alice\:***@127.0.0.1\:9" in done.stdout  # masked (as Hydra escapes it)
    multirun = tmp_path / "sweep" / "multirun.yaml"
    assert "http://alice:***@127.0.0.1:9" in multirun.read_text()
    assert not stat.S_IMODE(multirun.stat().st_mode) & 0o007  # no world access
    assert files_holding([tmp_path], [password]) == []


@pytest.mark.slow  # two whole cells and MLflow runs in a subprocess; the light sibling is above
def test_a_two_cell_sweep_with_a_password_in_the_tracking_uri_leaves_it_nowhere(
    mlflow_server, tiny_pair, prompts_jsonl, tmp_path, tmp_path_factory, ray_local
):
    password = f"pw-{uuid.uuid4().hex}"
    out = tmp_path / "out"
    done = run_sweep(
        ["spectr.num_drafts=1,2", f"model.target={tiny_pair['target']}", f"model.draft={tiny_pair['draft']}",
         f"data.path={prompts_jsonl}", "data.limit=8", f"output_dir={out}", "shard_size=4", "ray.num_actors=1",
         "spectr.method=spectr", "spectr.draft_length=2", "spectr.max_new_tokens=6",
         f"mlflow.tracking_uri={mlflow_server.replace('http://', f'http://alice:{password}@')}",
         "mlflow.experiment=sweep-secrets", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        REPO, ray_local, timeout=400,
    )  # fmt: skip
    assert done.returncode == 0 and "sweep: 2 cell(s), 0 failed" in done.stdout, (done.stdout + done.stderr)[-3000:]
    assert password not in done.stdout + done.stderr
    assert all((out / f"spectr.num_drafts={k}" / "_SUCCESS").exists() for k in (1, 2))
    mlflow_stores = sorted(tmp_path_factory.getbasetemp().glob("mlflow_server*"))
    assert files_holding([tmp_path, *mlflow_stores], [password]) == []
