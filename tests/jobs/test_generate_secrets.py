"""No credential the driver holds is written anywhere (issue #40, finding 6).

The fault is injected from outside: unique values in the driver's `AWS_SECRET_ACCESS_KEY`,
`AWS_ACCESS_KEY_ID` and `AWS_SESSION_TOKEN`, and a unique password in `mlflow.tracking_uri`
(`http://user:password@host:port`, on the session's real MLflow server). After a whole job the bytes of
every file under the Ray session's directory (Ray's logs), the output directory and the MLflow server's
store, and everything the job printed, hold none of them. Before the fix the keys were copied into the
actors' runtime_env (Ray's `runtime_env_agent.log` has them), and the password went into MLflow's params,
`_mlflow_run.json` and the console (when the URI got that far: the server check took it for a host name).
"""

from __future__ import annotations

import uuid
from pathlib import Path

from tiny_pair_support import job_config

from pipeline.generate.config import from_dict
from pipeline.generate.job import run_generate
from pipeline.generate.reader import read_output
from pipeline.generate.summary import format_report


def files_holding(folders: list[Path], needles: list[str]) -> list[str]:
    """'path: needle' for every file under `folders` whose bytes hold one of `needles`."""
    found = []
    for folder in folders:
        for path in folder.rglob("*"):
            try:
                data = path.read_bytes() if path.is_file() else b""
            except OSError:
                continue  # a socket, or a file gone meanwhile
            found += [f"{path}: {needle}" for needle in needles if needle.encode() in data]
    return found


def test_no_credential_reaches_ray_logs_the_output_mlflow_or_the_console(
    tiny_pair, prompts_jsonl, tmp_path, tmp_path_factory, ray_local, mlflow_server, monkeypatch, capfd
):
    secrets = {name: f"{name.lower()}-{uuid.uuid4().hex}" for name in
               ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")}  # fmt: skip
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    password = f"pw-{uuid.uuid4().hex}"
    tracking_uri = mlflow_server.replace("http://", f"http://alice:{password}@")
    out = tmp_path / "out"
    raw = job_config(
        tiny_pair, prompts_jsonl, out, shard_size=8,
        **{"data.limit": 8, "ray.num_actors": 1, "mlflow.enabled": True, "mlflow.tracking_uri": tracking_uri,
           "mlflow.experiment": "secrets", "mlflow.system_metrics": False},
    )  # fmt: skip
    report = run_generate(from_dict(raw))
    assert report.exit_code == 0 and read_output(out).num_rows == 8 and report.run_id

    import ray

    session = Path(ray._private.worker.global_worker.node.get_session_dir_path())  # this cluster's logs
    mlflow_stores = sorted(tmp_path_factory.getbasetemp().glob("mlflow_server*"))  # conftest's server folder
    assert mlflow_stores and (session / "logs").is_dir()
    needles = [*secrets.values(), password]
    assert files_holding([session, out, *mlflow_stores], needles) == []
    printed = capfd.readouterr()
    shown = printed.out + printed.err + format_report(report)
    assert not [needle for needle in needles if needle in shown]
    assert f"http://alice:***@{mlflow_server.split('://')[1]}" in format_report(report)  # masked, not dropped

    from mlflow.tracking import MlflowClient

    params = MlflowClient(tracking_uri=mlflow_server).get_run(report.run_id).data.params
    assert params["mlflow.tracking_uri"] == f"http://alice:***@{mlflow_server.split('://')[1]}"
