"""MLflow against a real tracking server: `mlflow server` on 127.0.0.1, metrics read back with MlflowClient.

The data has one prompt too long for the model, and max_failed_fraction allows it: the job succeeds and
the server holds prompts_failed = 1. An unreachable server is refused before anything starts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from tiny_pair_support import job_config

from pipeline.errors import JobInputError
from pipeline.generate.config import from_dict
from pipeline.generate.job import run_generate
from pipeline.generate.reader import read_output


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mlflow_server")
    port = free_port()
    mlflow_bin = str(Path(sys.executable).with_name("mlflow"))
    server = subprocess.Popen(
        [
            mlflow_bin, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{folder / 'server.db'}",
            "--artifacts-destination", str(folder / "artifacts"),
        ],
        cwd=folder, start_new_session=True, stdout=subprocess.DEVNULL, stderr=open(folder / "server.log", "w"),
    )  # fmt: skip
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2):
                    break
            except OSError:
                assert server.poll() is None, (folder / "server.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "mlflow server did not start"
                time.sleep(0.5)
        yield uri
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(server.pid, signal.SIGKILL)


def test_job_logs_to_a_tracking_server(mlflow_server, tiny_pair, tmp_path, ray_local):
    from mlflow.tracking import MlflowClient

    rows = [{"id": f"q{i}", "prompt": "def x return"} for i in range(6)]
    rows[2]["prompt"] = " ".join(["x"] * 60)
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = job_config(
        tiny_pair, data, tmp_path / "out", shard_size=3, max_failed_fraction=0.2,
        **{"ray.num_actors": 1, "mlflow.enabled": True, "mlflow.tracking_uri": mlflow_server,
           "mlflow.experiment": "server-test", "mlflow.run_name": "tiny"},
    )  # fmt: skip
    report = run_generate(from_dict(raw))
    assert report.exit_code == 0  # 1 of 6 failed <= 0.2
    assert read_output(tmp_path / "out").column("finish_reason").to_pylist()[2] == "error"

    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("server-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == report.run_id and run.info.run_name == "tiny" and run.info.status == "FINISHED"
    metrics = run.data.metrics
    assert metrics["prompts_failed"] == 1 and metrics["prompts_completed"] == 5
    assert metrics["generated_tokens"] == report.summary.generated_tokens > 0
    assert metrics["target_calls"] == report.summary.target_calls
    assert metrics["throughput_tokens_per_s"] > 0 and metrics["wall_time_s"] > 0
    assert run.data.params["mlflow.tracking_uri"] == mlflow_server
    assert run.data.params["max_failed_fraction"] == "0.2"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert "tokens_per_target_call.png" in artifacts and "config.yaml" in artifacts
    assert f"open {mlflow_server}" in "\n".join(value for _, value in report.tracker_lines)


def test_unreachable_server_is_refused_up_front(tiny_pair, prompts_jsonl, tmp_path):
    raw = job_config(
        tiny_pair, prompts_jsonl, tmp_path / "out",
        **{"mlflow.enabled": True, "mlflow.tracking_uri": f"http://127.0.0.1:{free_port()}"},
    )  # fmt: skip
    with pytest.raises(JobInputError, match="mlflow.tracking_uri: no MLflow server answers"):
        run_generate(from_dict(raw))
    assert not (tmp_path / "out").exists()
