"""The lease's faults of issue #52 (item 2), on a local disk, injected from outside in the output directory.

- An empty `_lease.json` (a crash or a full disk between its creation and its write): taken over once it
  stayed so for lease_timeout_s. Before, every taker put it back and the directory stayed blocked.
- A lease that cannot be read for a while (here `_lease.json` replaced by a directory: every read fails with
  an OSError, as with EIO or ESTALE): unknown, not lost. The holder's heartbeat retries and goes on once
  it reads again; a worker's check raises `LeaseUnknownError` (its shard goes back uncharged), not
  `LeaseLostError`. Before, one failed read ended the job.
"""

from __future__ import annotations

import os
import time

import pytest

from pipeline import fs
from pipeline.generate.lease import Lease, LeaseLostError, LeaseUnknownError, check_holder, read_holder


def location(path):
    return fs.resolve(str(path), "output_dir")


@pytest.mark.parametrize("content", [b"", b'{"host": "a", "pi'])  # empty; torn
def test_a_lease_file_that_holds_no_lease_is_taken_over_after_lease_timeout_s(tmp_path, content):
    (tmp_path / "_lease.json").write_bytes(content)
    started = time.monotonic()
    with Lease.acquire(location(tmp_path), timeout_s=0.5) as lease:
        assert time.monotonic() - started >= 0.5  # watched for lease_timeout_s first
        assert read_holder(location(tmp_path)).token == lease.holder.token
    assert not (tmp_path / "_lease.json").exists()


def test_a_lease_that_cannot_be_read_for_a_while_is_unknown_not_lost(tmp_path, caplog):
    out = location(tmp_path)
    lease = Lease.acquire(out, timeout_s=6)  # a heartbeat every second; lost only after 6 s unread
    try:
        path = tmp_path / "_lease.json"
        os.rename(path, tmp_path / "aside")
        os.mkdir(path)  # every read of the lease now fails (IsADirectoryError)
        with pytest.raises(LeaseUnknownError):
            check_holder(out, lease.holder.token)
        beat = lease.holder.beat
        deadline = time.monotonic() + 10
        while "lease heartbeat" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)  # until a heartbeat failed to read it
        assert "cannot read the lease" in caplog.text and lease.lost_to is None
        os.rmdir(path)
        os.rename(tmp_path / "aside", path)
        while lease.holder.beat == beat and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lease.holder.beat > beat and lease.lost_to is None
        lease.check()
        check_holder(out, lease.holder.token)
    finally:
        lease.release()


def test_a_lease_unreadable_for_lease_timeout_s_stops_its_holder(tmp_path):
    """Unknown for longer than lease_timeout_s: another job may have judged it stale, so the holder stops."""
    out = location(tmp_path)
    lease = Lease.acquire(out, timeout_s=0.6)
    try:
        os.unlink(tmp_path / "_lease.json")
        os.mkdir(tmp_path / "_lease.json")
        deadline = time.monotonic() + 10
        while lease.lost_to is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(LeaseLostError, match="unknown: no heartbeat for lease_timeout_s"):
            lease.check()
    finally:
        lease.release()
        os.rmdir(tmp_path / "_lease.json")


# A holder in another process (file locks are per process) whose heartbeat stalls between reading the lease
# and writing the next beat once `<markers>/armed` exists: its write blocks until `<markers>/go` exists, as a
# process paused by the kernel or a hung NFS write would.
STALLING_HOLDER = """
import os, sys, time
from pipeline import fs
from pipeline.generate import lease as leases
out, markers = sys.argv[1], sys.argv[2]
real_write = fs.write_bytes
def write_bytes(target, data):
    if target.name == "_lease.json" and os.path.exists(f"{markers}/armed") and not os.path.exists(f"{markers}/go"):
        open(f"{markers}/stalled", "w").close()
        while not os.path.exists(f"{markers}/go"):
            time.sleep(0.01)
    real_write(target, data)
fs.write_bytes = write_bytes
lease = leases.Lease.acquire(fs.resolve(out, "output_dir"), timeout_s=0.6)
print(lease.holder.token, flush=True)
time.sleep(600)
"""


def test_a_holder_stalled_mid_heartbeat_cannot_overwrite_a_taker(tmp_path):
    """A second job judges the stalled holder's lease stale meanwhile. Whatever the timing, the end has one
    holder: the lease names the taker and it holds on, or the taker was refused and the lease names the holder.
    Before the fix (a read, then a blind write) the taker took the lease, the stalled write put the old
    holder's back, and the taker learnt it lost while the old holder ran on."""
    import subprocess
    import sys
    import threading
    from pathlib import Path

    from pipeline.errors import JobInputError

    root = Path(__file__).resolve().parents[3]
    out, markers = tmp_path / "out", tmp_path / "markers"
    out.mkdir()
    markers.mkdir()
    process = subprocess.Popen([sys.executable, "-c", STALLING_HOLDER, str(out), str(markers)],
                               stdout=subprocess.PIPE, text=True, cwd=root)
    outcome: list = []
    try:
        token = process.stdout.readline().strip()
        assert token, "the holder process did not take the lease"
        (markers / "armed").touch()
        deadline = time.monotonic() + 30
        while not (markers / "stalled").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (markers / "stalled").exists()

        def take() -> None:
            try:
                outcome.append(Lease.acquire(location(out), timeout_s=0.6))
            except JobInputError as err:
                outcome.append(err)

        taker = threading.Thread(target=take)
        taker.start()
        time.sleep(1.5)  # the taker has judged the lease stale by now (0.6 s of watching)
        (markers / "go").touch()
        taker.join(60)
        time.sleep(0.6)  # a few heartbeats of whoever holds it
        second = outcome[0]
        holder = read_holder(location(out)).token
        if isinstance(second, Lease):
            assert holder == second.holder.token and second.lost_to is None, (holder, second.lost_to)
            second.release()
        else:
            assert holder == token and "being written by another job" in str(second)
    finally:
        process.kill()
        process.wait()
