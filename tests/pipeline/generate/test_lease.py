"""One writer per output directory: a live lease refuses, a stale one is taken over, a lost one stops the job.

Local disks, moto's S3 server and gcp-storage-emulator (as shipped: refused; with the test-only generation
check of `tests/gcs_support.py`: a stand-in for GCS), all on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pipeline import fs
from pipeline.errors import JobInputError
from pipeline.generate import lease as leases
from pipeline.generate.lease import Lease, LeaseLostError, check_free, read_holder

ROOT = Path(__file__).resolve().parents[3]


def location(path):
    return fs.resolve(str(path), "output_dir")


def write_holder(path, **fields):
    holder = leases.this_holder("someone-else", time.time())
    raw = {**holder.__dict__, **fields}
    (path / "_lease.json").write_text(json.dumps(raw))


def test_a_live_lease_refuses_a_second_job_and_names_the_holder(tmp_path):
    out = location(tmp_path / "out")
    with Lease.acquire(out, timeout_s=0.6) as lease:  # heartbeat every 0.1 s
        holder = read_holder(out)
        assert holder.token == lease.holder.token and holder.pid and holder.host == socket.gethostname()
        with pytest.raises(JobInputError, match=rf"being written by another job \(host {socket.gethostname()}, pid \d+"):
            check_free(out, 60)
        with pytest.raises(JobInputError, match="being written by another job"):
            Lease.acquire(out, timeout_s=60)
        assert read_holder(out).beat > holder.beat  # the counter the readers watched
    assert not (tmp_path / "out").exists()  # released; the directory it created was empty again


# A holder in another process (#40 finding 7): a real `Lease` whose process reports a pid and a wall clock of
# its choosing (patched there, as a holder in another container or on a skewed host would look from here).
HOLDER = """
import dataclasses, sys, time, types
from pipeline import fs
from pipeline.generate import lease as leases
out, pid, skew_s, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
real = time.time
leases.time = types.SimpleNamespace(time=lambda: real() + skew_s, monotonic=time.monotonic, sleep=time.sleep)
own = leases.this_holder
if pid:
    leases.this_holder = lambda *args: dataclasses.replace(own(*args), pid=pid, pid_start="")
lease = leases.Lease.acquire(fs.resolve(out, "output_dir"), timeout_s=timeout_s)
print(lease.holder.token, flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def holder_process(out, pid=0, skew_s=0.0, timeout_s=0.6):
    """A process holding the lease of `out` (heartbeat every timeout_s / 6), reporting `pid` (0: its own) and
    a wall clock `skew_s` off; yields (process, its lease token)."""
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), str(pid), str(skew_s), str(timeout_s)],
                               stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        token = process.stdout.readline().strip()
        assert token, "the holder process did not take the lease"
        yield process, token
    finally:
        process.kill()
        process.wait()


def dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def test_a_live_holder_whose_pid_is_not_visible_here_is_not_taken_over(tmp_path):
    """A live holder in another container (same host name and boot id, its pid not ours to see): it reports a
    pid that no process here has. Its counter moves, so it is live; a PID probe took it for dead."""
    with holder_process(tmp_path, pid=dead_pid()) as (_, token):
        assert read_holder(location(tmp_path)).host == socket.gethostname()
        with pytest.raises(JobInputError, match="being written by another job"):
            check_free(location(tmp_path), 2)
        with pytest.raises(JobInputError, match="being written by another job"):
            Lease.acquire(location(tmp_path), timeout_s=2)
        assert read_holder(location(tmp_path)).token == token


def test_a_holder_whose_counter_stops_is_taken_over_and_learns_it_lost(tmp_path):
    """The holder freezes (SIGSTOP: its process still exists, its counter stops): taken over once the counter
    stood still for lease_timeout_s on the taker's clock, not before; thawed, the holder stops writing."""
    with holder_process(tmp_path) as (process, token):
        with pytest.raises(JobInputError, match="being written by another job"):
            check_free(location(tmp_path), 1)
        freeze_between_heartbeats(tmp_path, process)
        frozen = read_holder(location(tmp_path))
        watched = time.monotonic()
        with Lease.acquire(location(tmp_path), timeout_s=1) as lease:
            assert time.monotonic() - watched >= 0.5  # it watched the counter (>= the holder's 3 intervals)
            assert lease.holder.token != token and frozen.token == token
            os.kill(process.pid, signal.SIGCONT)
            time.sleep(0.5)  # the thawed holder's heartbeats find another token and stop
            assert read_holder(location(tmp_path)).token == lease.holder.token


@pytest.mark.parametrize("skew_h", [-5, 5])
def test_a_holder_whose_wall_clock_is_hours_off_is_judged_by_its_counter(tmp_path, skew_h):
    """A holder whose clock is 5 h behind (its heartbeat time looks hours old) is live while its counter
    moves; one 5 h ahead (its heartbeat time in the future) is stale once its counter stops."""
    with holder_process(tmp_path, skew_s=skew_h * 3600.0) as (process, token):
        assert abs(read_holder(location(tmp_path)).heartbeat - time.time() - skew_h * 3600) < 60
        with pytest.raises(JobInputError, match="being written by another job"):
            Lease.acquire(location(tmp_path), timeout_s=1)
        freeze_between_heartbeats(tmp_path, process)
        try:
            with Lease.acquire(location(tmp_path), timeout_s=1) as lease:
                assert lease.holder.token != token
        finally:
            os.kill(process.pid, signal.SIGCONT)


def freeze_between_heartbeats(out, process) -> None:
    """SIGSTOP the holder outside its heartbeat's locked read-check-write: the test holds the lease lock while
    it stops the process. (A holder frozen inside it keeps the lock, and takers wait: a known limit, #52.)"""
    import fcntl

    from pipeline.generate.lease import LOCK_NAME

    fd = os.open(os.path.join(str(out), LOCK_NAME), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)  # waits for the holder's heartbeat to leave its locked section
        os.kill(process.pid, signal.SIGSTOP)
        fcntl.lockf(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def test_a_lease_left_by_a_killed_job_is_taken_over_after_lease_timeout_s(tmp_path):
    """A lease whose counter never moves (its job was killed), with a fresh wall-clock time of another host:
    taken over after lease_timeout_s of watching, by check_free and acquire together (what the plan watched
    counts for the job)."""
    write_holder(tmp_path, host="elsewhere", heartbeat=time.time() + 3600, pid=dead_pid())
    check_free(location(tmp_path), 0.5)  # watched 0.5 s: stale
    started = time.monotonic()
    with Lease.acquire(location(tmp_path), timeout_s=0.5):
        assert time.monotonic() - started < 0.5  # already watched by check_free
        assert read_holder(location(tmp_path)).host == socket.gethostname()


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


def test_an_object_store_without_conditional_writes_is_refused():
    out = fs.resolve("memory://bucket/lease-test", "output_dir")
    assert not out.is_local
    with pytest.raises(JobInputError, match="offers no conditional write"):
        Lease.acquire(out, timeout_s=60)
    assert read_holder(out) is None


def test_two_takers_of_one_stale_local_lease_exactly_one_wins(tmp_path):
    """Both read the same stale lease; the first takes it over; the second's rename moves the first's fresh
    lease, finds it is not the stale one, puts it back and fails (the old code took it: negative control)."""
    write_holder(tmp_path, host="elsewhere", heartbeat=time.time() - 120, token="stale")
    out = location(tmp_path)
    stale = read_holder(out)
    first, second = leases.this_holder("first", time.time()), leases.this_holder("second", time.time())
    assert leases._take(out, first, stale) is True
    assert leases._take(out, second, stale) is False
    assert read_holder(out).token == "first" and sorted(p.name for p in tmp_path.iterdir()) == [
        ".lease.lock", "_lease.json"]  # the lease lock stays while a lease is held (#52: the heartbeat's CAS)


@pytest.fixture(scope="module")
def moto_s3(tmp_path_factory):
    """moto's S3 server on 127.0.0.1 with a bucket 'leases'; yields its URL (the AWS variables are set
    while a test uses `s3_env`)."""
    import boto3
    from s3_support import start_moto, stop

    server, url = start_moto(tmp_path_factory.mktemp("moto_lease"), "moto")
    boto3.client(
        "s3", endpoint_url=url, aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    ).create_bucket(Bucket="leases")
    try:
        yield url
    finally:
        stop(server)


@pytest.fixture(scope="module")
def gcs_preconditions(tmp_path_factory):
    """gcp-storage-emulator with the test-only generation check (a GCS stand-in) and a bucket 'leases'."""
    from gcs_support import start_emulator, stop

    server, url = start_emulator(tmp_path_factory.mktemp("gcs_lease"), "leases", preconditions=True)
    try:
        yield url
    finally:
        stop(server)


# Each object-store test runs on both stores; the default suite runs one of each test's stores.
@pytest.fixture(params=["s3", pytest.param("gs", marks=pytest.mark.slow)])
def object_store(request, monkeypatch):
    """The scheme of a store with conditional writes, its variables set: moto's S3, or the GCS stand-in."""
    return store_env(request, monkeypatch)


@pytest.fixture(params=[pytest.param("s3", marks=pytest.mark.slow), "gs"])
def gcs_first(request, monkeypatch):
    """`object_store`, with GCS in the default suite and S3 in the slow one."""
    return store_env(request, monkeypatch)


def store_env(request, monkeypatch):
    if request.param == "s3":
        for name, value in {"AWS_ENDPOINT_URL": request.getfixturevalue("moto_s3"), "AWS_ACCESS_KEY_ID": "testing",
                            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}.items():  # fmt: skip
            monkeypatch.setenv(name, value)
    else:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", request.getfixturevalue("gcs_preconditions"))
    return request.param


def test_object_store_lease_is_exclusive_through_conditional_writes(object_store):
    """On moto's S3 server and the GCS stand-in: a second job is refused; a writer that overwrites the lease
    (unconditionally) makes the holder's next heartbeat fail its condition (If-Match / ifGenerationMatch),
    so the holder learns it lost; of two takers of one stale lease exactly one wins; release deletes only
    our own lease."""
    out = fs.resolve(f"{object_store}://leases/job-a", "output_dir")
    lease = Lease.acquire(out, timeout_s=0.6)  # heartbeat every 0.1 s
    assert read_holder(out).token == lease.holder.token
    with pytest.raises(JobInputError, match="being written by another job"):
        Lease.acquire(out, timeout_s=60)
    intruder = leases.this_holder("intruder", time.time())
    fs.write_bytes(out.child("_lease.json"), intruder.encode())  # an old-style, unconditional write
    deadline = time.monotonic() + 10
    while lease.lost_to is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(LeaseLostError):
        lease.check()
    lease.release()
    assert read_holder(out).token == "intruder"  # not ours to delete, not overwritten by our heartbeat

    stale_out = fs.resolve(f"{object_store}://leases/job-b", "output_dir")
    old = leases.this_holder("old", time.time() - 600)
    fs.write_bytes(stale_out.child("_lease.json"), old.encode())
    stale = read_holder(stale_out)
    first, second = leases.ObjectLease.open(stale_out), leases.ObjectLease.open(stale_out)
    assert first.take(leases.this_holder("first", time.time()), stale) is True
    assert second.take(leases.this_holder("second", time.time()), stale) is False
    assert read_holder(stale_out).token == "first"
    with Lease.acquire(fs.resolve(f"{object_store}://leases/job-c", "output_dir"), timeout_s=60) as fresh:
        assert read_holder(fresh.output).token == fresh.holder.token
    assert read_holder(fs.resolve(f"{object_store}://leases/job-c", "output_dir")) is None


def take_together(out, names, stale=None):
    """Each name takes the lease of `out` from its own ObjectLease, all at once (threads): who won."""
    stores = [leases.ObjectLease.open(out) for _ in names]
    start = threading.Barrier(len(names))

    def take(store, name):
        start.wait()
        return store.take(leases.this_holder(name, time.time()), stale)

    with ThreadPoolExecutor(len(names)) as pool:
        won = list(pool.map(take, stores, names))
    return [name for name, ok in zip(names, won) if ok]


def test_two_takers_one_winner_and_a_takeover_stops_the_old_holder(gcs_first):
    """On the GCS stand-in (ifGenerationMatch) and S3 (If-Match): two takers of a fresh directory, then two of a
    stale lease: exactly one wins each time (and a taker whose retried write failed its condition because the
    first attempt had landed still wins). A holder whose lease was taken over: its conditional heartbeat
    write fails (412) and its check raises LeaseLostError; the new holder's lease is untouched."""
    out = fs.resolve(f"{gcs_first}://leases/job-d", "output_dir")
    winners = take_together(out, ["a", "b"])
    assert len(winners) == 1 and read_holder(out).token == winners[0]

    fs.write_bytes(out.child("_lease.json"), leases.this_holder("old", time.time() - 600).encode())
    winners = take_together(out, ["c", "d"], stale=read_holder(out))
    assert len(winners) == 1 and read_holder(out).token == winners[0]
    mine = leases.this_holder("mine", time.time())  # a create retried after its first answer was lost
    first_try, retried = leases.ObjectLease.open(out.child("retry")), leases.ObjectLease.open(out.child("retry"))
    assert first_try.take(mine, None) is True and retried.take(mine, None) is True  # its own write: won
    assert retried.take(leases.this_holder("other", time.time()), None) is False

    other = fs.resolve(f"{gcs_first}://leases/job-e", "output_dir")
    old = Lease.acquire(other, timeout_s=0.3)
    old._stop.set()  # frozen: no heartbeat for lease_timeout_s
    old._thread.join()
    time.sleep(0.35)
    new = Lease.acquire(other, timeout_s=0.3)  # takes the stale lease over
    assert old.store.replace(old.holder) is False  # the frozen holder's next conditional write loses
    old._stop.clear()
    old._start_heartbeat()
    deadline = time.monotonic() + 10
    while old.lost_to is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(LeaseLostError, match="taken over by another job"):
        old.check()
    old.release()
    assert read_holder(other).token == new.holder.token  # the old holder's release left it alone
    new.release()
    assert read_holder(other) is None  # deleted under its version's condition


def test_a_gcs_store_that_ignores_generation_preconditions_is_refused(tmp_path):
    """gcp-storage-emulator as shipped ignores ifGenerationMatch: the probe refuses the lease, naming the
    output and why, and leaves nothing behind. Negative control: past the probe, two takers of one fresh
    directory would both 'win' on it."""
    from gcs_support import gcs_emulator

    with gcs_emulator(tmp_path, "leases", preconditions=False):
        out = fs.resolve("gs://leases/job", "output_dir")
        with pytest.raises(JobInputError, match=r"gs://leases/job: this GCS store does not honour conditional "
                                                r"writes \(it ignores ifGenerationMatch=0\)"):  # fmt: skip
            Lease.acquire(out, timeout_s=60)
        assert fs.list_files(out, "output_dir") == []
        location = out.child("_lease.json")
        unprobed = [leases.ObjectLease(leases.GcsObjects.open(out.uri, "leases"), location.path.split("/", 1)[1],
                                       out.uri) for _ in range(2)]  # fmt: skip
        assert [store.take(leases.this_holder(name, time.time()), None) for store, name in zip(unprobed, "ab")] == [
            True, True]  # fmt: skip


def test_gcs_without_credentials_is_refused_in_one_line(monkeypatch, tmp_path):
    """No emulator and no usable Application Default Credentials: exit 2 material, not a traceback."""
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(JobInputError, match=r"^output_dir: gs://bucket/out: cannot open a GCS client: .*missing\.json"
                       ) as caught:  # fmt: skip
        leases.GcsObjects.open("gs://bucket/out", "bucket")
    assert "\n" not in str(caught.value)
