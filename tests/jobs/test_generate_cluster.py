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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from cluster_support import LocalCluster, commit_records

from pipeline.generate.reader import read_output

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


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
    requeued = ("handing it to another actor", "its shards go to the others", "shard(s) re-queued")
    assert any(line in logs for line in requeued) and "constructor arguments" not in logs, logs[-3000:]
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
        for i in range(1200)))  # fmt: skip  (long enough that Ray marks the node dead and restarts the actor)
    out = tmp_path / "out"
    driver = subprocess.Popen(
        [
            sys.executable, "-m", "jobs.generate", f"ray.address=127.0.0.1:{cluster.gcs_port}",
            f"model.target={tiny_pair['target']}", f"model.draft={tiny_pair['draft']}",
            f"data.path={prompts}", "data.limit=null", f"output_dir={out}", "shard_size=4", "ray.num_actors=2",
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
        lost_pids = {r["worker"]["pid"] for r in commit_records(out) if r["worker"]["node_id"] in lost}
        cluster.kill_worker_node()
        for pid in lost_pids:  # its actor process too: one that outlived its raylet kept committing as the lost node
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        cluster.add_worker_node()
        returned_at = len(commit_records(out))
        logs, _ = driver.communicate(timeout=540)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert driver.returncode == 0, logs[-4000:]
    latest = {r["shard"]: r for r in commit_records(out)}
    after = {r["worker"]["node_id"] for r in commit_records(out)[returned_at:]}
    assert len(latest) == 300 and head_id in after and after - {head_id} - lost, (after, logs[-3000:])
    ids = [json.loads(line)["id"] for line in prompts.read_text().splitlines()]
    assert read_output(out).column("id").to_pylist() == ids
    assert (out / "_SUCCESS").exists()
