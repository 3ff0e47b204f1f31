"""One writer per output directory: a live lease refuses, a stale one is taken over, a lost one stops the job."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from pipeline import fs
from pipeline.errors import JobInputError
from pipeline.generate import lease as leases
from pipeline.generate.lease import Lease, LeaseLostError, check_free, read_holder


def location(path):
    return fs.resolve(str(path), "output_dir")


def write_holder(path, **fields):
    holder = leases.this_holder("someone-else", time.time())
    raw = {**holder.__dict__, **fields}
    (path / "_lease.json").write_text(json.dumps(raw))


def test_a_live_lease_refuses_a_second_job_and_names_the_holder(tmp_path):
    out = location(tmp_path / "out")
    with Lease.acquire(out, timeout_s=60) as lease:
        holder = read_holder(out)
        assert holder.token == lease.holder.token and holder.pid and holder.host == socket.gethostname()
        with pytest.raises(JobInputError, match=rf"being written by another job \(host {socket.gethostname()}, pid \d+"):
            check_free(out, 60)
        with pytest.raises(JobInputError, match="being written by another job"):
            Lease.acquire(out, timeout_s=60)
    assert not (tmp_path / "out").exists()  # released; the directory it created was empty again


def test_a_dead_local_holder_is_taken_over_at_once(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_holder(tmp_path, pid=int(dead.stdout))
    check_free(location(tmp_path), 60)  # the process is gone: not live
    with Lease.acquire(location(tmp_path), timeout_s=60) as lease:
        assert read_holder(location(tmp_path)).token == lease.holder.token


def test_another_hosts_lease_lives_until_its_heartbeat_is_stale(tmp_path):
    write_holder(tmp_path, host="elsewhere", heartbeat=time.time() - 5)
    with pytest.raises(JobInputError, match="host elsewhere"):
        check_free(location(tmp_path), 60)
    write_holder(tmp_path, host="elsewhere", heartbeat=time.time() - 120)
    with Lease.acquire(location(tmp_path), timeout_s=60):
        pass


def test_a_job_whose_lease_was_taken_over_stops(tmp_path):
    out = location(tmp_path)
    lease = Lease.acquire(out, timeout_s=0.6)  # heartbeat every 0.1 s
    write_holder(tmp_path, host="elsewhere")
    deadline = time.monotonic() + 10
    while lease.lost_to is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(LeaseLostError, match="taken over by another job \\(host elsewhere"):
        lease.check()
    lease.release()
    assert read_holder(out).host == "elsewhere"  # not ours to delete


def test_object_store_lease_is_verified_after_it_settles(monkeypatch):
    monkeypatch.setattr(leases, "OBJECT_STORE_SETTLE_S", 0.05)
    out = fs.resolve("memory://bucket/lease-test", "output_dir")
    assert not out.is_local
    with Lease.acquire(out, timeout_s=60) as lease:
        assert read_holder(out).token == lease.holder.token
        with pytest.raises(JobInputError, match="being written by another job"):
            Lease.acquire(out, timeout_s=60)
    assert read_holder(out) is None
