"""MLflow at a job's start never holds the job (issue #52, item 3).

Faults injected from outside: a stub HTTP server on 127.0.0.1 in front of nothing, which
- answers 503 to everything (an overloaded or broken server);
- accepts every connection and never answers (a hung server);
- answers the job's check (the experiment is not there yet: MLflow's own 404) and then hangs every
  request (the run's creation hangs: MLflow's client would retry it for minutes);
- answers 401 (wrong credentials).
The first three degrade to no tracking with a warning, and the job finishes (exit 0, `_SUCCESS`); only a
4xx the user can fix is a config error (JobInputError: exit 2, nothing written). Before the fix a server
that did not answer was refused (exit 2), and a hanging run creation held the job for minutes.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from tiny_pair_support import job_config

from pipeline.config import MlflowConfig
from pipeline.errors import JobInputError
from pipeline.generate.config import from_dict
from pipeline.generate.job import run_generate
from pipeline.tracking import reachable


class StubServer:
    """An HTTP server on 127.0.0.1: `mode` picks how it answers (see the module docstring)."""

    def __init__(self, mode: str):
        self.release = threading.Event()  # set at the end: hung requests return
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                stub.answer(self)

            do_POST = do_GET  # noqa: N815

            def log_message(self, *args):
                pass

        self.mode = mode
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, request: BaseHTTPRequestHandler) -> None:
        checking = request.command == "GET" and "experiments/get-by-name" in request.path
        if self.mode == "hang" or (self.mode == "hang-after-check" and not checking):
            self.release.wait(600)
            return self._send(request, 503, {})
        if self.mode == "hang-after-check":
            return self._send(request, 404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no experiment"})
        self._send(request, 503 if self.mode == "503" else 401, {"error_code": "UNAUTHENTICATED"})

    @staticmethod
    def _send(request, status, body) -> None:
        data = json.dumps(body).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub(request):
    server = StubServer(request.param)
    yield server
    server.close()


@pytest.mark.parametrize("stub", ["503", "hang"], indirect=True)
def test_the_check_says_why_a_server_that_does_not_serve_is_down(stub):
    config = MlflowConfig(tracking_uri=stub.uri.replace("http://", "http://alice:pw-secret@"))
    down = reachable(config, timeout_s=0.5)
    assert down and stub.uri.split("//")[1] in down and "pw-secret" not in down
    assert ("HTTP 503" in down) if stub.mode == "503" else ("within 0.5 s" in down)


@pytest.mark.parametrize("stub", ["401"], indirect=True)
def test_a_server_that_refuses_the_credentials_is_a_config_error(stub, tiny_pair, prompts_jsonl, tmp_path):
    raw = job_config(tiny_pair, prompts_jsonl, tmp_path / "out",
                     **{"mlflow.enabled": True, "mlflow.tracking_uri": stub.uri})  # fmt: skip
    with pytest.raises(JobInputError, match="refuses the job's requests \\(HTTP 401, UNAUTHENTICATED\\)"):
        run_generate(from_dict(raw))
    assert not (tmp_path / "out").exists()


# the check's hang in a whole job is slow (the check's own answer: the first test above; a server that is not
# there at all: test_generate_mlflow_server.py); the run's creation hanging is the default suite's
@pytest.mark.parametrize("stub", [pytest.param("hang", marks=pytest.mark.slow), "hang-after-check"], indirect=True)
def test_a_server_that_hangs_at_the_start_leaves_the_job_to_finish_without_mlflow(
    stub, tiny_pair, prompts_jsonl, tmp_path, ray_local, caplog
):
    out = tmp_path / "out"
    raw = job_config(
        tiny_pair, prompts_jsonl, out,
        **{"data.limit": 8, "ray.num_actors": 1, "mlflow.enabled": True, "mlflow.tracking_uri": stub.uri,
           "mlflow.shutdown_timeout_s": 1, "mlflow.system_metrics": False},
    )  # fmt: skip
    with caplog.at_level("WARNING"):
        report = run_generate(from_dict(raw))
    assert report.exit_code == 0 and (out / "_SUCCESS").exists() and report.run_id is None
    said = "no MLflow server answers" if stub.mode == "hang" else "the run's start did not finish in 1 s"
    assert said in caplog.text and "the job goes on without MLflow" in caplog.text


def test_a_sweep_whose_server_does_not_answer_runs_its_cells_without_a_parent_run(tmp_path, ray_local):
    """Nothing listens at the URI: the sweep's parent run is skipped with a warning (before: the sweep's start
    retried it for minutes and then failed), and every cell runs (here each fails at once: its input is
    missing)."""
    import socket
    import subprocess
    import sys

    from test_generate_sweep import sweep_env

    def free_port() -> int:  # not `from conftest import`: in the whole suite that name is another folder's conftest
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    missing = [tmp_path / "missing-a.jsonl", tmp_path / "missing-b.jsonl"]
    command = [
        sys.executable, "-m", "jobs.generate", "-m", f"data.path={missing[0]},{missing[1]}", "progress=false",
        f"mlflow.tracking_uri=http://127.0.0.1:{free_port()}", "mlflow.shutdown_timeout_s=2",
        f"ray.address={ray_local.get_runtime_context().gcs_address}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=sweep_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "sweep: 2 cell(s), 2 failed" in done.stdout, (done.stdout + done.stderr)[-3000:]
    assert "the sweep goes on without a parent run" in done.stderr
