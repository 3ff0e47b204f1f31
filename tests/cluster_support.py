"""A real multi-node Ray cluster on this machine for tests and measurements: `ray start` processes.

`LocalCluster(temp_dir)` starts a head node and worker nodes on 127.0.0.1 (one CPU each by default, token
authentication on), each `ray start --block` in a session of its own, so that exactly its processes can
be stopped or killed (never `ray stop`, which would stop every Ray on the machine). Used by
`tests/jobs/test_generate_cluster.py` and `scripts/measure_faults.py`, as `tiny_pair_support` is for the
tiny pair.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def commit_records(out: Path) -> list[dict]:
    """The commit log's records so far (a line being written is skipped)."""
    try:
        lines = (out / "_commits.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # being written
    return records


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class LocalCluster:
    """`ray start --block` processes in their own sessions, so that we can stop exactly them."""

    def __init__(self, temp_dir: Path):
        self.temp_dir = temp_dir
        # as with an activated venv (or the Docker image): `python` is the interpreter that has the project
        path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
        self.env = dict(
            os.environ, PATH=path, RAY_AUTH_MODE="token", OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0"
        )
        self.nodes: list[subprocess.Popen] = []
        self.gcs_port, self.dashboard_port, self.client_port = free_ports(3)

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _start(self, args: list[str], log_name: str) -> None:
        log = open(self.temp_dir.parent / log_name, "w")
        self.nodes.append(
            subprocess.Popen(
                [str(BIN / "ray"), "start", "--block", "--node-ip-address=127.0.0.1", "--num-cpus=1", *args],
                env=self.env,
                start_new_session=True,
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        )

    def start(self) -> None:
        self._start(
            [
                "--head", f"--port={self.gcs_port}", f"--temp-dir={self.temp_dir}",
                "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
                f"--ray-client-server-port={self.client_port}",
            ],
            "head.log",
        )  # fmt: skip
        self.wait_for_nodes(1)
        self._start([f"--address=127.0.0.1:{self.gcs_port}"], "worker.log")
        self.wait_for_nodes(2)

    def ray(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(BIN / "ray"), *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def submit(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """`ray job submit`, retried while the head's job agent is still starting (a loaded machine)."""
        deadline = time.monotonic() + 120
        while True:
            result = self.ray("job", "submit", f"--address={self.dashboard}", *args, timeout=timeout)
            if "No available agent" not in result.stdout + result.stderr or time.monotonic() > deadline:
                return result
            time.sleep(3)

    def wait_for_nodes(self, count: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for node in self.nodes:
                assert node.poll() is None, (self.temp_dir.parent / "head.log").read_text()[-3000:]
            status = self.ray("status", f"--address=127.0.0.1:{self.gcs_port}", timeout=60)
            if status.returncode == 0 and status.stdout.count("node_") >= count:
                return
            assert time.monotonic() < deadline, (
                f"cluster did not reach {count} node(s):\n{status.stdout}{status.stderr}"
            )
            time.sleep(1)

    def add_worker_node(self, log_name: str = "worker2.log") -> None:
        """Start another worker node (a node that joins, or comes back)."""
        self._start([f"--address=127.0.0.1:{self.gcs_port}"], log_name)

    def kill_worker_node(self) -> None:
        """SIGKILL the second node's processes (its raylet and everything it started), as if it died."""
        os.killpg(self.nodes[1].pid, signal.SIGKILL)
        self.nodes[1].wait(timeout=30)

    def stop(self) -> None:
        for node in reversed(self.nodes):  # worker first, then head
            try:
                os.killpg(node.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            try:
                node.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for node in self.nodes:  # anything left in our sessions
            try:
                os.killpg(node.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
