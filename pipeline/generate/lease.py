"""One writer per output directory: the lease `_lease.json` (holder host, pid, start time, heartbeat).

    check_free(output, timeout_s)            # in the plan: refuse (JobInputError) a directory a live job holds
    lease = Lease.acquire(output, timeout_s) # the job's first write; a heartbeat thread keeps it fresh
    lease.check()                            # raises LeaseLostError if another job took the directory over
    lease.release()                          # at the end, success or not

A lease is live while its heartbeat is younger than `lease_timeout_s` and, when the holder ran on this
machine (same host name and boot), its process still exists: a job killed here is taken over at once, one
killed on another machine once its heartbeat is stale. Taking a lease is atomic on local disks and NFS
(create-exclusive; a stale lease is first renamed away, which only one taker can do). Object stores have no
create-exclusive: there a taker uploads its lease, waits `OBJECT_STORE_SETTLE_S`, and reads it back; of two
jobs that started together the one whose upload landed last keeps it, the other is refused.

Not here: what the job writes under the lease (`pipeline.generate.output`, `pipeline.generate.commit_log`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

from pipeline import fs
from pipeline.errors import JobFailedError, JobInputError

LEASE_NAME = "_lease.json"
OBJECT_STORE_SETTLE_S = 2.0
HEARTBEATS_PER_TIMEOUT = 6

log = logging.getLogger("pipeline")


class LeaseLostError(JobFailedError):
    """Another job took over this job's output directory (this one looked dead to it)."""


@dataclass(frozen=True)
class Holder:
    host: str
    boot_id: str
    pid: int
    pid_start: str
    started: float
    heartbeat: float
    token: str

    def describe(self, now: float) -> str:
        started = datetime.fromtimestamp(self.started, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"host {self.host}, pid {self.pid}, started {started}, last heartbeat {now - self.heartbeat:.0f} s ago"

    def encode(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode()


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot ('' where /proc is not there)."""
    stat = _read_text(f"/proc/{pid}/stat")
    return stat.rsplit(")", 1)[-1].split()[19] if stat else ""


def this_holder(token: str, started: float) -> Holder:
    pid = os.getpid()
    boot = _read_text("/proc/sys/kernel/random/boot_id")
    return Holder(socket.gethostname(), boot, pid, process_start(pid), started, time.time(), token)


def is_live(holder: Holder, timeout_s: float, now: float | None = None) -> bool:
    now = time.time() if now is None else now
    if now - holder.heartbeat > timeout_s:
        return False
    me = this_holder("", now)
    if holder.host == me.host and holder.boot_id == me.boot_id:
        return _process_exists(holder.pid) and process_start(holder.pid) == holder.pid_start
    return True


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_holder(output: fs.Location) -> Holder | None:
    location = output.child(LEASE_NAME)
    try:
        raw = json.loads(fs.read_bytes(location))
        return Holder(**raw)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, OSError) as err:
        if not fs.exists(location):
            return None
        log.warning("unreadable lease %s (%s); treating it as stale", location.uri, err)
        return Holder("?", "?", -1, "", 0.0, 0.0, "?")


def _refusal(output: fs.Location, holder: Holder, timeout_s: float) -> JobInputError:
    return JobInputError(
        f"output_dir: {output.uri} is being written by another job ({holder.describe(time.time())}); wait for it "
        f"to end or choose another output_dir (a lease without a heartbeat for lease_timeout_s={timeout_s:g} s "
        "is taken over)"
    )


def check_free(output: fs.Location, timeout_s: float) -> None:
    """Raise JobInputError when a live job holds `output`. Reads only."""
    holder = read_holder(output)
    if holder is not None and is_live(holder, timeout_s):
        raise _refusal(output, holder, timeout_s)


class Lease:
    """This job's hold on its output directory; see the module docstring."""

    def __init__(self, output: fs.Location, timeout_s: float, holder: Holder, created_dir: bool):
        self.output, self.timeout_s, self.holder, self.created_dir = output, timeout_s, holder, created_dir
        self.lost_to: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, output: fs.Location, timeout_s: float) -> Lease:
        """Take the lease (JobInputError naming the holder when a live job has it) and start the heartbeat."""
        try:
            created = fs.make_dirs(output)
        except OSError as err:
            raise JobInputError(f"output_dir: cannot create {output.uri}: {err}") from None
        holder = this_holder(uuid.uuid4().hex, time.time())
        for _ in range(5):
            current = read_holder(output)
            if current is not None and is_live(current, timeout_s):
                raise _refusal(output, current, timeout_s)
            if current is not None:
                log.warning("taking over the stale lease of %s", current.describe(time.time()))
            if _take(output, holder, current):
                lease = cls(output, timeout_s, holder, created)
                lease._start_heartbeat()
                return lease
        raise JobInputError(f"output_dir: could not take the lease on {output.uri}: other jobs keep taking it")

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="lease-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.timeout_s / HEARTBEATS_PER_TIMEOUT):
            try:
                current = read_holder(self.output)
                if current is None or current.token != self.holder.token:
                    self.lost_to = current.describe(time.time()) if current else "nobody (the lease was deleted)"
                    return
                self.holder = Holder(**{**asdict(self.holder), "heartbeat": time.time()})
                fs.write_bytes(self.output.child(LEASE_NAME), self.holder.encode())
            except Exception as err:  # noqa: BLE001 - a missed heartbeat is retried; staleness takes minutes
                log.warning("lease heartbeat on %s failed: %s", self.output.uri, err)

    def check(self) -> None:
        if self.lost_to is not None:
            raise LeaseLostError(
                f"output_dir: {self.output.uri} was taken over by another job ({self.lost_to}); this job stops "
                "without writing _SUCCESS"
            )

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still ours; remove a directory we created that
        is empty again (a job that could not start leaves nothing behind)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        try:
            current = read_holder(self.output)
            if current is not None and current.token == self.holder.token:
                fs.delete(self.output.child(LEASE_NAME))
            if self.created_dir and self.output.is_local and not os.listdir(self.output.path):
                os.rmdir(self.output.path)
        except OSError as err:
            log.warning("could not release the lease on %s: %s", self.output.uri, err)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _take(output: fs.Location, holder: Holder, stale: Holder | None) -> bool:
    """One attempt to write our lease in place of `stale` (None: no lease). False: try again."""
    location = output.child(LEASE_NAME)
    if output.is_local:
        if stale is not None:
            tombstone = f"{location.path}.stale-{holder.token}"
            try:
                os.rename(location.path, tombstone)  # only one taker can move the stale lease away
            except FileNotFoundError:
                return False
            os.unlink(tombstone)
        try:
            fd = os.open(location.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(holder.encode())
            f.flush()
            os.fsync(f.fileno())
        fs.fsync_dir(os.path.dirname(location.path))
        return True
    fs.write_bytes(location, holder.encode())
    time.sleep(OBJECT_STORE_SETTLE_S)
    current = read_holder(output)
    if current is None or current.token != holder.token:
        raise JobInputError(
            f"output_dir: {output.uri} was taken by another job that started at the same time "
            f"({current.describe(time.time()) if current else 'it has since ended'}); choose another output_dir"
        )
    return True
