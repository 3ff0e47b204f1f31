"""The job on a real 2-node Ray cluster, submitted with `ray job submit`, as docker/README.md does it.

Both nodes run on 127.0.0.1 with one CPU each (`ray start --head` + `ray start --address=...`, token
auth on), so the job's two CPU actors necessarily land on different nodes. The driver runs on the head as
a Ray job and joins the cluster with `ray.address=auto`. The cluster is stopped by killing the process
groups this test started (never `ray stop`, which would stop every Ray on the machine).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pipeline.generate.reader import read_output

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

BIN = Path(sys.executable).parent


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


def commit_records(out: Path) -> list[dict]:
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


@pytest.fixture
def cluster():
    # a short temp dir: Ray's unix socket paths must stay under ~107 characters
    root = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))
    cluster = LocalCluster(root / "ray")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_job_submitted_to_a_two_node_cluster(cluster, tiny_pair, prompts_jsonl, tmp_path):
    out = tmp_path / "out"
    db = tmp_path / "mlflow.db"
    submitted = cluster.submit(
        "--",
        "python", "-m", "jobs.generate", "ray=cluster",
        f"model.target={tiny_pair['target']}", f"model.draft={tiny_pair['draft']}",
        f"data.path={prompts_jsonl}", f"output_dir={out}", "shard_size=5", "ray.num_actors=2",
        "spectr.max_new_tokens=16", f"mlflow.tracking_uri=sqlite:///{db}", "progress=false",
    )  # fmt: skip
    logs = submitted.stdout + submitted.stderr
    assert submitted.returncode == 0, logs[-4000:]
    assert "SpecTr generation summary" in logs and "succeeded" in logs

    ids = [json.loads(line)["id"] for line in prompts_jsonl.read_text().splitlines()]
    assert read_output(out).column("id").to_pylist() == ids
    assert (out / "_SUCCESS").exists()
    nodes = {record["worker"]["node_id"] for record in commit_records(out)}
    assert len(nodes) == 2, f"shards ran on {nodes}: expected one actor on each node"

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (run,) = client.search_runs([client.get_experiment_by_name("spectr-generate").experiment_id])
    assert run.data.metrics["prompts_completed"] == 40 and run.data.params["ray.address"] == "auto"


def test_a_node_lost_mid_job_its_shards_finish_on_the_other(cluster, tiny_pair, prompts_jsonl, tmp_path):
    """Kill the worker node once both nodes have committed shards: the driver (on the head) re-queues the
    lost node's shards on the head's actor within the heartbeat timeout, and the job ends with exit 0 and
    every row once."""
    out = tmp_path / "out"
    driver = subprocess.Popen(
        [
            sys.executable, "-m", "jobs.generate", f"ray.address=127.0.0.1:{cluster.gcs_port}",
            f"model.target={tiny_pair['target']}", f"model.draft={tiny_pair['draft']}",
            f"data.path={prompts_jsonl}", f"output_dir={out}", "shard_size=2", "ray.num_actors=2",
            "spectr.max_new_tokens=24", "spectr.batch_size=1", "ray.heartbeat_s=1", "ray.heartbeat_timeout_s=10",
            "mlflow.enabled=false", "progress=false",
        ],
        env=cluster.env, cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        head = json.loads(cluster.ray("list", "nodes", "--format=json", f"--address={cluster.dashboard}").stdout)
        head_id = next(node["node_id"] for node in head if node["is_head_node"])
        deadline = time.monotonic() + 240
        while len({r["worker"]["node_id"] for r in commit_records(out)}) < 2:
            assert driver.poll() is None, driver.stdout.read()[-4000:]
            assert time.monotonic() < deadline, "both nodes did not commit a shard in time"
            time.sleep(0.2)
        lost = {r["worker"]["pid"] for r in commit_records(out) if r["worker"]["node_id"] != head_id}
        cluster.kill_worker_node()
        for pid in lost:  # its actor process too, should it have outlived its raylet
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed_at = len(commit_records(out))
        logs, _ = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert driver.returncode == 0, logs[-4000:]
    assert ("handing it to another actor" in logs or "its shards go to the others" in logs) and (
        "constructor arguments" not in logs
    )
    assert killed_at < 20, "the node was killed too late to lose anything"
    ids = [json.loads(line)["id"] for line in prompts_jsonl.read_text().splitlines()]
    assert read_output(out).column("id").to_pylist() == ids  # every row once
    assert (out / "_SUCCESS").exists()
    latest = {r["shard"]: r for r in commit_records(out)}
    assert len(latest) == 20 and {r["worker"]["node_id"] for r in list(latest.values())[killed_at:]} == {head_id}


def test_a_node_lost_and_another_added_ends_with_both_nodes_working(cluster, tiny_pair, tmp_path):
    """Kill the worker node mid-job, then start a new one: Ray restarts the lost actor (ray.max_restarts)
    once the new node gives it room, the driver hands it shards again, and shards committed after that come
    from both nodes; every row once, `_SUCCESS`."""
    import random

    from tiny_pair_support import WORDS

    prompts = tmp_path / "prompts.jsonl"
    rng = random.Random(3)
    prompts.write_text("".join(
        json.dumps({"id": f"q{i:03d}", "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))}) + "\n"
        for i in range(160)))  # fmt: skip
    out = tmp_path / "out"
    driver = subprocess.Popen(
        [
            sys.executable, "-m", "jobs.generate", f"ray.address=127.0.0.1:{cluster.gcs_port}",
            f"model.target={tiny_pair['target']}", f"model.draft={tiny_pair['draft']}",
            f"data.path={prompts}", f"output_dir={out}", "shard_size=4", "ray.num_actors=2",
            "spectr.max_new_tokens=40", "spectr.batch_size=1", "ray.heartbeat_s=1", "ray.heartbeat_timeout_s=10",
            "mlflow.enabled=false", "progress=false",
        ],
        env=cluster.env, cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        nodes = json.loads(cluster.ray("list", "nodes", "--format=json", f"--address={cluster.dashboard}").stdout)
        head_id = next(node["node_id"] for node in nodes if node["is_head_node"])
        deadline = time.monotonic() + 240
        while len({r["worker"]["node_id"] for r in commit_records(out)}) < 2:
            assert driver.poll() is None, driver.stdout.read()[-4000:]
            assert time.monotonic() < deadline, "both nodes did not commit a shard in time"
            time.sleep(0.2)
        lost = {r["worker"]["node_id"] for r in commit_records(out)} - {head_id}
        cluster.kill_worker_node()
        cluster.add_worker_node()
        returned_at = len(commit_records(out))
        logs, _ = driver.communicate(timeout=540)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert driver.returncode == 0, logs[-4000:]
    latest = {r["shard"]: r for r in commit_records(out)}
    after = {r["worker"]["node_id"] for r in commit_records(out)[returned_at:]}
    assert len(latest) == 40 and head_id in after and after - {head_id} - lost, (after, logs[-3000:])
    ids = [json.loads(line)["id"] for line in prompts.read_text().splitlines()]
    assert read_output(out).column("id").to_pylist() == ids
    assert (out / "_SUCCESS").exists()
