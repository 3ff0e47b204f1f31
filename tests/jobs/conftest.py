"""Fixtures of the job tests: one real `mlflow server` on 127.0.0.1 for the whole session.

`mlflow_server` is the server's URI; it stores runs in SQLite and artifacts in a temporary folder, and is
stopped (its whole process group) at the end of the session. The server runs without MLflow's job execution
(`MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`): the tests use no server-side jobs, and its huey consumers
(about ten processes polling for the whole session) slowed the start and every test after it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
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
        cwd=folder, start_new_session=True, stdout=subprocess.DEVNULL,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        stderr=open(folder / "server.log", "w"),
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
