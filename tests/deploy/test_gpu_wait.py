"""`pipeline.generate.cluster.wait_for_gpus`: a job that joins a cluster whose GPU group scales from zero asks the
autoscaler for the pool's GPUs and waits for them, instead of starting CPU actors or exiting.

With a simulated cluster (its GPU count a function of the polls, a fake clock): it waits until the GPUs come,
asking for one bundle per actor; it gives up after `ray.actor_start_timeout_s` naming the keys, dropping its
request; it does not wait for a local Ray, without `gpus_per_actor`, or when the GPUs are there (the
controls). On the session's real local Ray (no GPU, no autoscaler): Ray's own `request_resources` takes the
request, and the wait ends in the refusal.
"""

from __future__ import annotations

import pytest

from pipeline.errors import JobInputError
from pipeline.generate.cluster import wait_for_gpus
from pipeline.generate.config import RayConfig


class FakeCluster:
    """GPUs appear after `arrive_after` polls; the clock moves by each sleep."""

    def __init__(self, arrive_after: int | None, gpus: float = 1.0):
        self.polls, self.arrive_after, self.gpus = 0, arrive_after, gpus
        self.requests: list[list[dict]] = []
        self.now = 0.0

    def resources(self) -> dict[str, float]:
        self.polls += 1
        arrived = self.arrive_after is not None and self.polls > self.arrive_after
        return {"CPU": 4.0, **({"GPU": self.gpus} if arrived else {})}

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def wait(config: RayConfig, cluster: FakeCluster) -> bool:
    return wait_for_gpus(config, resources=cluster.resources, request=cluster.requests.append, sleep=cluster.sleep,
                         clock=lambda: cluster.now)


def test_a_joined_job_waits_for_the_first_gpu_node():
    cluster = FakeCluster(arrive_after=5)
    assert wait(RayConfig(address="auto", gpus_per_actor=1), cluster)
    assert cluster.requests == [[{"GPU": 1}]] and cluster.polls > 5 and cluster.now > 0


def test_num_actors_asks_for_a_bundle_per_actor_and_waits_for_all():
    cluster = FakeCluster(arrive_after=2, gpus=2.0)  # 2 GPUs come, 3 are needed: the wait runs out
    with pytest.raises(JobInputError, match=r"ray.gpus_per_actor=1: the cluster has 2 of the 3 GPU\(s\) .*"
                                            r"ray.actor_start_timeout_s=60 s"):
        wait(RayConfig(address="auto", gpus_per_actor=1, num_actors=3, actor_start_timeout_s=60), cluster)
    assert cluster.requests == [[{"GPU": 1}] * 3, []]  # asked, then dropped the request
    assert cluster.now == pytest.approx(60)


@pytest.mark.parametrize("config", [RayConfig(gpus_per_actor=1), RayConfig(address="auto"),
                                    RayConfig(address="auto", gpus_per_actor=0)], ids=["local", "auto-gpus", "cpu"])
def test_no_wait_for_a_local_ray_or_without_gpus_per_actor(config):
    cluster = FakeCluster(arrive_after=None)
    assert not wait(config, cluster) and cluster.requests == [] and cluster.now == 0


def test_no_wait_when_the_gpus_are_there():
    cluster = FakeCluster(arrive_after=0)
    assert not wait(RayConfig(address="auto", gpus_per_actor=1), cluster) and cluster.requests == []


def test_on_a_real_ray_without_gpus_the_wait_ends_in_the_refusal(ray_local, monkeypatch):
    import pipeline.generate.cluster as cluster

    monkeypatch.setattr(cluster, "GPU_POLL_S", 0.05)
    with pytest.raises(JobInputError, match="the cluster has 0 of the 1 GPU"):
        wait_for_gpus(RayConfig(address="auto", gpus_per_actor=1, actor_start_timeout_s=0.2))


def test_a_job_joining_a_cluster_without_gpus_is_refused_after_the_wait(ray_local, tmp_path):
    """The wait is the job's: `ray_session` joining the session's Ray by its address (another process, as a
    submitted driver joins) with ray.gpus_per_actor=1 waits ray.actor_start_timeout_s and is refused, naming it."""
    import subprocess
    import sys

    address = ray_local.get_runtime_context().gcs_address
    code = ("from pipeline.generate.cluster import ray_session\n"
            "from pipeline.generate.config import RayConfig\n"
            "from pipeline.errors import JobInputError\n"
            "import pipeline.generate.cluster as c\n"
            "c.GPU_POLL_S = 0.05\n"
            "try:\n"
            f"    with ray_session(RayConfig(address={address!r}, gpus_per_actor=1, actor_start_timeout_s=0.5),"
            " verbose=False):\n"
            "        print('STARTED')\n"
            "except JobInputError as err:\n"
            "    print('REFUSED', err)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert "REFUSED ray.gpus_per_actor=1: the cluster has 0 of the 1 GPU(s)" in done.stdout, done.stdout + done.stderr
    assert "STARTED" not in done.stdout
