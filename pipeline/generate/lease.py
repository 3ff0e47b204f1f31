"""One writer per output directory: the lease `_lease.json` (holder host, pid, start time, heartbeat counter).

    check_free(output, timeout_s)            # in the plan: refuse (JobInputError) a directory a live job holds
    lease = Lease.acquire(output, timeout_s) # the job's first write; a heartbeat thread keeps it fresh
    lease.check()                            # raises LeaseLostError if another job took the directory over
    lease.release()                          # at the end, success or not

A lease is live while its heartbeat counter moves. The holder advances `beat` every `lease_timeout_s / 6`
(its `interval_s`, written in the lease); a reader watches the counter on its own monotonic clock and judges
the lease stale only once it has stood still for `lease_timeout_s` (and for at least `STALE_BEATS` of the
holder's intervals) since this process first saw that value. Neither the holder's pid nor its wall clock is
trusted: containers with host networking share the host name and boot id, so a live holder in another
container would look dead to a PID probe, and a holder whose clock is hours off would look fresh or stale
for ever by its wall-clock timestamp (`heartbeat`, kept for people reading the file). What a process has
seen is remembered per directory, so the plan's `check_free` and the job's `acquire` watch one lease once:
a killed job's lease is taken over `lease_timeout_s` after the next job first looks at it, a live one is
refused as soon as its counter moves (within one of its intervals).

Taking a lease is exclusive:
- local disks and NFS: create-exclusive (`O_EXCL`); a stale lease is first renamed away, which only one
  taker can do, and a taker that finds it moved a fresh lease (another taker's) puts it back and retries;
- object stores with conditional writes (`ObjectLease`: the logic, one per-store `objects` side that
  creates if absent, reads (bytes, version) and replaces or deletes if the version is unchanged):
  - S3 (and S3-compatible stores) through boto3 (`S3Objects`): created with `If-None-Match: *`, a stale
    lease replaced and the heartbeat written with `If-Match: <its ETag>`;
  - GCS through google-cloud-storage (`GcsObjects`, the JSON API; credentials the usual way,
    `STORAGE_EMULATOR_HOST` honoured): created with `ifGenerationMatch=0`, replaced and the heartbeat
    written with `ifGenerationMatch=<the generation read or written>`;
  of two writers exactly one succeeds and the other gets a 412 and learns it lost. A store that ignores
  the conditions (probed once: a second conditional create must fail) is refused (JobInputError), as
  gcp-storage-emulator is (it ignores `ifGenerationMatch`; the tests add the check in a test-only subclass);
- other object stores are refused (JobInputError), rather than a lease that two jobs could both hold:
  abfs:// (Azure has `If-None-Match` / `If-Match` too, but there is no Azure emulator here to test it
  against) and fsspec schemes.

A lease file that holds no lease (empty or torn: a crash or a full disk between its creation and its write)
is watched like a lease and taken over once it stayed so for `lease_timeout_s`. A read that fails (EIO,
ESTALE) is retried and then "unknown" (`LeaseUnknownError`), never "lost": the heartbeat retries at its next
beat (its holder stops only when it could not confirm its lease for `lease_timeout_s`, after which another
job may have judged it stale), and a worker's shard that meets it goes back uncharged.

On local disks and NFS the heartbeat's read-check-write and a taker's move-and-create run under an fcntl lock
(`.lease.lock`): a compare-and-swap, so a holder that stalled mid-heartbeat cannot overwrite the lease of a job
that took over (the taker waits for the lock, then sees the counter moved); where the filesystem has no locks
the rename checks alone remain, and only a holder frozen for `lease_timeout_s` mid-write could race a taker.

Workers check the lease too (`check_holder`, right before each part is written): a worker of a job that lost
the directory writes no part.

Not here: what the job writes under the lease (`pipeline.generate.output`, `pipeline.generate.commit_log`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from typing import Any

from pipeline import fs
from pipeline.errors import JobFailedError, JobInputError

LEASE_NAME = "_lease.json"
HEARTBEATS_PER_TIMEOUT = 6
STALE_BEATS = 3  # a reader never judges a lease stale before the holder missed this many of its own heartbeats
WATCH_POLL_S = 1.0  # at most this long between two reads of a watched lease

log = logging.getLogger("pipeline")


class LeaseLostError(JobFailedError):
    """Another job took over this job's output directory (this one looked dead to it)."""


class LeaseUnknownError(OSError):
    """The lease could not be read (EIO, ESTALE, a timeout) after `READ_ATTEMPTS` tries: not known to be lost.
    A worker's shard that meets it goes back uncharged; the holder's heartbeat retries at its next beat."""


UNREADABLE = "?"  # the token of `read_holder`'s stand-in for a lease file that holds no lease (empty, torn)
READ_ATTEMPTS = 3
READ_BACKOFF_S = 0.2  # before the n-th retry of a read that failed: n times this


@dataclass(frozen=True)
class Holder:
    host: str
    boot_id: str
    pid: int
    pid_start: str
    started: float
    heartbeat: float  # the holder's wall clock at its last heartbeat: for people, never for liveness
    token: str
    beat: int = 0  # advanced by every heartbeat: what readers watch
    interval_s: float = 0.0  # the holder's heartbeat interval (0: not written, an older lease)

    def describe(self, now: float | None = None) -> str:
        """Who holds the lease, in the holder's own words (its start time is its wall clock's)."""
        started = datetime.fromtimestamp(self.started, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"host {self.host}, pid {self.pid}, started {started} by its clock, heartbeat {self.beat}"

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


def this_holder(token: str, started: float, interval_s: float = 0.0) -> Holder:
    pid = os.getpid()
    boot = _read_text("/proc/sys/kernel/random/boot_id")
    return Holder(socket.gethostname(), boot, pid, process_start(pid), started, time.time(), token, 0, interval_s)


def stale_after_s(holder: Holder, timeout_s: float) -> float:
    """How long, by the reader's clock, the lease's counter must stand still before it is stale:
    `lease_timeout_s`, and never less than `STALE_BEATS` of the holder's own heartbeat intervals."""
    return max(timeout_s, STALE_BEATS * holder.interval_s)


@dataclass
class _Sighting:
    """One value of a lease's counter as this process saw it: since when (monotonic), last read when."""

    token: str
    beat: int
    since: float
    read: float


_sightings: dict[str, _Sighting] = {}  # output directory URI -> what this process last saw of its lease
_sightings_lock = threading.Lock()


def judge(output: fs.Location, holder: Holder, timeout_s: float, now: float | None = None) -> bool | None:
    """One reading of the lease: True (live: its counter moved since this process last read it), False (stale:
    it stood still for `stale_after_s` by this process's monotonic clock), None (not known yet: keep watching).
    A reading older than `stale_after_s` is no evidence either way: the watch starts again from this one."""
    now = time.monotonic() if now is None else now
    limit = stale_after_s(holder, timeout_s)
    with _sightings_lock:
        seen = _sightings.get(output.uri)
        if seen is None or now - seen.read > limit:
            _sightings[output.uri] = _Sighting(holder.token, holder.beat, now, now)
            return None
        seen.read = now
        if (seen.token, seen.beat) != (holder.token, holder.beat):
            _sightings[output.uri] = _Sighting(holder.token, holder.beat, now, now)
            return True
        return False if now - seen.since >= limit else None


def watch(output: fs.Location, timeout_s: float, poll_s: float | None = None) -> tuple[Holder | None, bool]:
    """Read the lease until its liveness is known: (None, False) when there is none, (holder, True) when its
    counter moves (at once if this process saw it move before), (holder, False) once it has stood still for
    `stale_after_s` (what this process watched of it before counts). Blocks at most that long."""
    announced = False
    while True:
        try:
            holder = read_holder(output)
        except LeaseUnknownError as err:
            raise JobInputError(f"output_dir: {err}; try again once the storage answers") from None
        if holder is None:
            with _sightings_lock:
                _sightings.pop(output.uri, None)
            return None, False
        verdict = judge(output, holder, timeout_s)
        if verdict is not None:
            return holder, verdict
        limit = stale_after_s(holder, timeout_s)
        if not announced:
            log.info("output_dir %s has a lease (%s); watching its heartbeat for up to %.0f s", output.uri,
                     holder.describe(), limit)
            announced = True
        time.sleep(min(WATCH_POLL_S if poll_s is None else poll_s, max(0.01, holder.interval_s / 2 or limit / 20)))


def read_holder(output: fs.Location) -> Holder | None:
    """The lease's holder; None when there is no lease; a stand-in (token `UNREADABLE`) for a file that holds
    no lease (empty or torn: a crash or a full disk between its creation and its write), which is watched like
    any lease and taken over once it stayed so for `lease_timeout_s`. A read that fails (EIO, ESTALE) is tried
    again, then raises `LeaseUnknownError`: never taken for a lost or a stale lease."""
    location = output.child(LEASE_NAME)
    for attempt in range(READ_ATTEMPTS):
        try:
            raw = fs.read_bytes(location)
            break
        except FileNotFoundError:
            return None
        except OSError as err:
            try:
                if not fs.exists(location):
                    return None
            except OSError:
                pass
            if attempt + 1 == READ_ATTEMPTS:
                raise LeaseUnknownError(f"cannot read the lease {location.uri}: {type(err).__name__}: {err}") from err
            time.sleep(READ_BACKOFF_S * (attempt + 1))
    holder = _decode(raw)
    if holder is None:
        log.warning("the lease %s holds no lease (%d bytes: empty or torn); it is taken over once it stays so for "
                    "lease_timeout_s", location.uri, len(raw))
        return Holder(UNREADABLE, UNREADABLE, -1, "", 0.0, 0.0, UNREADABLE, beat=len(raw))
    return holder


def _refusal(output: fs.Location, holder: Holder, timeout_s: float) -> JobInputError:
    return JobInputError(
        f"output_dir: {output.uri} is being written by another job ({holder.describe()}; its heartbeat moves); "
        f"wait for it to end or choose another output_dir (a lease whose heartbeat stands still for "
        f"lease_timeout_s={timeout_s:g} s is taken over)"
    )


def check_free(output: fs.Location, timeout_s: float) -> None:
    """Raise JobInputError when a live job holds `output` (watching its lease: up to `stale_after_s`). Reads only."""
    holder, live = watch(output, timeout_s)
    if live:
        raise _refusal(output, holder, timeout_s)


def check_holder(output: fs.Location, token: str) -> None:
    """Raise LeaseLostError unless the lease of `output` is still `token`'s. A worker checks it right before it
    writes a part: a late writer of a job that no longer holds the directory (killed, or taken over) writes
    nothing; what it had started writing before is removed by the cleanup of the job that holds it."""
    current = read_holder(output)  # LeaseUnknownError: not known to be lost (the shard goes back uncharged)
    if current is not None and current.token == UNREADABLE:
        raise LeaseUnknownError(f"the lease of {output.uri} holds no lease right now (empty or torn)")
    if current is None or current.token != token:
        raise LeaseLostError(
            f"output_dir: {output.uri} is no longer held by the job that sent this shard (now: "
            f"{current.describe() if current else 'no lease'}); its part is not written"
        )


class Lease:
    """This job's hold on its output directory; see the module docstring."""

    def __init__(
        self, output: fs.Location, timeout_s: float, holder: Holder, created_dir: bool, store: ObjectLease | None
    ):
        self.output, self.timeout_s, self.holder, self.created_dir = output, timeout_s, holder, created_dir
        self.store = store  # object stores: the conditional writes (None on local disks and NFS)
        self.lost_to: str | None = None
        self._confirmed = time.monotonic()  # when a heartbeat last read our lease back (an unreadable one: unknown)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, output: fs.Location, timeout_s: float) -> Lease:
        """Take the lease (JobInputError naming the holder when a live job has it) and start the heartbeat."""
        try:
            created = fs.make_dirs(output)
        except OSError as err:
            raise JobInputError(f"output_dir: cannot create {output.uri}: {err}") from None
        store = None if output.is_local else ObjectLease.open(output)
        holder = this_holder(uuid.uuid4().hex, time.time(), timeout_s / HEARTBEATS_PER_TIMEOUT)
        for _ in range(5):
            current, live = watch(output, timeout_s)
            if live:
                raise _refusal(output, current, timeout_s)
            if current is not None:
                log.warning("taking over the stale lease of %s (its heartbeat stood still for %.0f s)",
                            current.describe(), stale_after_s(current, timeout_s))
            taken = store.take(holder, current) if store is not None else _take(output, holder, current, timeout_s)
            if taken:
                with _sightings_lock:
                    _sightings.pop(output.uri, None)
                lease = cls(output, timeout_s, holder, created, store)
                lease._start_heartbeat()
                return lease
        raise JobInputError(f"output_dir: could not take the lease on {output.uri}: other jobs keep taking it")

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="lease-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.timeout_s / HEARTBEATS_PER_TIMEOUT):
            try:
                if self.store is None:  # local / NFS: read, check and write under the lease lock (a CAS)
                    with _locked(self.output, self.timeout_s / HEARTBEATS_PER_TIMEOUT) as locked:
                        if not locked:
                            raise LeaseUnknownError("the lease lock stayed busy (a taker holds it)")
                        if not self._beat_once():
                            return
                elif not self._beat_once():
                    return
            except Exception as err:  # noqa: BLE001 - a missed heartbeat is retried; staleness takes minutes
                log.warning("lease heartbeat on %s failed: %s", self.output.uri, err)
                if time.monotonic() - self._confirmed > self.timeout_s:  # others may have judged it stale
                    self.lost_to = f"unknown: no heartbeat for lease_timeout_s={self.timeout_s:g} s ({err})"
                    return

    def _beat_once(self) -> bool:
        """One heartbeat: False when the lease is no longer ours (`lost_to` says whose it is)."""
        current = read_holder(self.output)
        if current is not None and current.token == UNREADABLE:
            raise LeaseUnknownError("it holds no lease (empty or torn)")
        if current is None or current.token != self.holder.token:
            self.lost_to = current.describe() if current else "nobody (the lease was deleted)"
            return False
        fresh = replace(self.holder, heartbeat=time.time(), beat=self.holder.beat + 1)
        if self.store is not None and not self.store.replace(fresh):
            current = read_holder(self.output)  # someone wrote the lease since our last write
            self.lost_to = current.describe() if current else "nobody (the lease was deleted)"
            return False
        if self.store is None:
            fs.write_bytes(self.output.child(LEASE_NAME), fresh.encode())
        self.holder, self._confirmed = fresh, time.monotonic()
        return True

    def check(self) -> None:
        if self.lost_to is not None:
            raise LeaseLostError(
                f"output_dir: {self.output.uri} was taken over by another job ({self.lost_to}); this job stops "
                "without writing _SUCCESS"
            )

    def confirm(self) -> None:
        """`check`, then read the lease itself (right before a commit): LeaseLostError when another job holds it
        now, LeaseUnknownError when it cannot be read (the caller retries)."""
        self.check()
        check_holder(self.output, self.holder.token)

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still ours; remove a directory we created that
        is empty again (a job that could not start leaves nothing behind)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        try:
            if self.store is not None:
                current = read_holder(self.output)
                if current is not None and current.token == self.holder.token:
                    self.store.delete()
            else:
                with _locked(self.output, self.timeout_s) as locked:
                    current = read_holder(self.output)
                    if locked and current is not None and current.token == self.holder.token:
                        fs.delete(self.output.child(LEASE_NAME))
                        fs.delete(self.output.child(LOCK_NAME))  # no takers wait on a directory with no lease
            if self.created_dir and self.output.is_local and not os.listdir(self.output.path):
                os.rmdir(self.output.path)
        except OSError as err:
            log.warning("could not release the lease on %s: %s", self.output.uri, err)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


LOCK_NAME = ".lease.lock"  # local disks and NFS: held around every read-then-write of the lease


@contextlib.contextmanager
def _locked(output: fs.Location, wait_s: float) -> Iterator[bool]:
    """Hold the output directory's lease lock (an fcntl lock on `LOCK_NAME`: NFS v4 and local disks) while the
    block reads and writes the lease, so that a heartbeat's read-check-write is a compare-and-swap against
    takers (and takers against each other). Yields False when the lock stayed busy for `wait_s` (the caller
    acts as if it lost the race: it tries again later). Where the filesystem has no locks (ENOLCK), a warning
    and the block runs unlocked (the rename checks remain)."""
    import errno
    import fcntl

    fd = os.open(os.path.join(output.path, LOCK_NAME), os.O_RDWR | os.O_CREAT, fs.FILE_MODE)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES):
                    log.warning("output_dir %s: no file locks here (%s); the lease is written without one",
                                output.uri, err)
                    locked = None
                    break
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.02)
        try:
            yield True
        finally:
            if locked:
                fcntl.lockf(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _take(output: fs.Location, holder: Holder, stale: Holder | None, wait_s: float = 10.0) -> bool:
    """One attempt to create our lease on a local disk or NFS in place of `stale` (None: no lease), under the
    lease lock. False: try again."""
    with _locked(output, wait_s) as locked:
        return locked and _take_unlocked(output, holder, stale)


def _take_unlocked(output: fs.Location, holder: Holder, stale: Holder | None) -> bool:
    location = output.child(LEASE_NAME)
    if stale is not None:
        tombstone = f"{location.path}.stale-{holder.token}"
        try:
            os.rename(location.path, tombstone)  # only one taker can move the stale lease away
        except FileNotFoundError:
            return False
        moved = _holder_in(tombstone)
        same = moved == stale or (moved == UNREADABLE and stale.token == UNREADABLE)  # still no lease in it
        if not same:  # another taker's fresh lease, or a heartbeat since we judged it: put it back
            try:
                os.link(tombstone, location.path)
            except FileExistsError:
                pass
            os.unlink(tombstone)
            return False
        os.unlink(tombstone)
    try:
        fd = os.open(location.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, fs.FILE_MODE)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(holder.encode())
        f.flush()
        os.fsync(f.fileno())
    fs.fsync_dir(os.path.dirname(location.path))
    return True


def _holder_in(path: str) -> Holder | str | None:
    """The holder in a lease file; `UNREADABLE` for a file that holds none; None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return _decode(raw) or UNREADABLE


class ObjectLease:
    """The lease object on an object store, written only with conditions: created if absent, replaced and
    deleted only if it is still the version we read or wrote. The store's side is `objects` (`S3Objects`,
    `GcsObjects`); the logic, the same on every store, is here."""

    def __init__(self, objects: Any, key: str, uri: str):
        self.objects, self.key, self.uri = objects, key, uri  # uri: the output directory (messages)
        self.version: str | None = None  # of our last write (S3 ETag, GCS generation)

    @classmethod
    def open(cls, output: fs.Location) -> ObjectLease:
        """For an s3:// or gs:// output; JobInputError for any other object store, or a store that ignores
        the conditions."""
        location = output.child(LEASE_NAME)
        kind = _OBJECT_STORES.get(fs.scheme_of(location.uri))
        if kind is None:
            raise JobInputError(
                f"output_dir: {output.uri}: this store offers no conditional write here, so two jobs could both "
                "take its lease; write to a local or NFS path, to s3:// (If-None-Match / If-Match) or to gs:// "
                "(generation preconditions)"
            )
        bucket, key = location.path.split("/", 1)
        lease = cls(kind.open(output.uri, bucket), key, output.uri)
        lease.probe()
        return lease

    def probe(self) -> None:
        """Refuse a store that ignores the create condition (a second conditional create must fail)."""
        key = f"{self.key}.probe-{uuid.uuid4().hex[:12]}"
        try:
            honoured = self.objects.create(key, b"") is not None and self.objects.create(key, b"") is None
            why = f"it ignores {self.objects.create_condition}"
        except Exception as err:  # noqa: BLE001 - NotImplemented and the like: the store cannot do it
            honoured, why = False, f"{type(err).__name__}: {_first_line(err)}"
        finally:
            try:
                self.objects.delete(key, None)
            except Exception:  # noqa: BLE001 - a leftover probe object is harmless
                pass
        if not honoured:
            raise JobInputError(
                f"output_dir: {self.uri}: this {self.objects.name} store does not honour conditional writes "
                f"({why}), so two jobs could both take the lease; use a store that does "
                f"({self.objects.honouring}) or a local/NFS path"
            )

    def take(self, holder: Holder, stale: Holder | None) -> bool:
        """Create our lease, or replace `stale` if the object is still the one we read. False: try again."""
        body = holder.encode()
        if stale is None:
            version = self.objects.create(self.key, body)
        else:
            found = self.objects.read(self.key)
            now = _decode(found[0]) if found is not None else None
            unreadable = now is None and stale.token == "?"  # read_holder's stand-in for a corrupt lease
            if found is None or (now != stale and not unreadable):
                return False
            version = self.objects.replace(self.key, body, found[1])
        version = version or self._ours(holder)
        if version is None:
            return False
        self.version = version
        return True

    def replace(self, holder: Holder) -> bool:
        """Our heartbeat: False when the object is no longer our last write."""
        version = self.objects.replace(self.key, holder.encode(), self.version) or self._ours(holder)
        if version is None:
            return False
        self.version = version
        return True

    def _ours(self, holder: Holder) -> str | None:
        """After a failed condition: the object's version if it is `holder` after all (a write the client
        retried after losing the first answer fails its own condition), else None."""
        found = self.objects.read(self.key)
        return found[1] if found is not None and _decode(found[0]) == holder else None

    def delete(self) -> None:
        """Delete our lease (only if it is still our last write, where the store has conditional deletes)."""
        self.objects.delete(self.key, self.version)


class S3Objects:
    """Conditional writes on S3 through boto3 (with the AWS variables `pipeline.fs` uses): `If-None-Match: *`
    creates, `If-Match: <ETag>` replaces and deletes. A version is an ETag."""

    name, create_condition, honouring = "S3", "If-None-Match", "AWS S3, recent MinIO"

    def __init__(self, client: Any, bucket: str):
        self.client, self.bucket = client, bucket

    @classmethod
    def open(cls, uri: str, bucket: str) -> S3Objects:
        try:
            import boto3
        except ImportError:
            raise JobInputError(
                f"output_dir: {uri}: the lease on S3 needs boto3 (conditional writes): pip install boto3"
            ) from None
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
        return cls(boto3.client("s3", endpoint_url=endpoint, region_name=region), bucket)

    def _conditional(self, call: Any) -> Any:
        """The call's answer, or None when its condition failed (412, or 409 for a concurrent write)."""
        from botocore.exceptions import ClientError

        try:
            return call()
        except ClientError as err:
            status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = err.response.get("Error", {}).get("Code")
            if status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return None
            raise

    def create(self, key: str, body: bytes) -> str | None:
        """The new object's version, or None when the object exists."""
        put = self._conditional(
            lambda: self.client.put_object(Bucket=self.bucket, Key=key, Body=body, IfNoneMatch="*"))
        return None if put is None else put["ETag"]

    def read(self, key: str) -> tuple[bytes, str] | None:
        """The object's bytes and version, or None when it is absent."""
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=key)
        except self.client.exceptions.NoSuchKey:
            return None
        return got["Body"].read(), got["ETag"]

    def replace(self, key: str, body: bytes, version: str | None) -> str | None:
        """The new version, or None when the object is no longer `version`."""
        put = self._conditional(
            lambda: self.client.put_object(Bucket=self.bucket, Key=key, Body=body, IfMatch=version))
        return None if put is None else put["ETag"]

    def delete(self, key: str, version: str | None) -> None:
        from botocore.exceptions import ClientError

        if version is None:
            self.client.delete_object(Bucket=self.bucket, Key=key)
            return
        try:
            self._conditional(lambda: self.client.delete_object(Bucket=self.bucket, Key=key, IfMatch=version))
        except ClientError:  # no conditional delete here: the caller has just read that the lease is ours
            self.client.delete_object(Bucket=self.bucket, Key=key)


class GcsObjects:
    """Conditional writes on Google Cloud Storage through `google-cloud-storage` (the JSON API; credentials
    the usual way, `STORAGE_EMULATOR_HOST` honoured): `ifGenerationMatch=0` creates, `ifGenerationMatch=<the
    generation read>` replaces and deletes; a 412 means the condition failed. A version is a generation."""

    name, create_condition, honouring = "GCS", "ifGenerationMatch=0", "Google Cloud Storage"

    def __init__(self, bucket: Any):
        self.bucket = bucket

    @classmethod
    def open(cls, uri: str, bucket: str) -> GcsObjects:
        try:
            from google.cloud import storage
        except ImportError:
            raise JobInputError(
                f"output_dir: {uri}: the lease on GCS needs google-cloud-storage (generation preconditions): "
                "pip install google-cloud-storage"
            ) from None
        try:
            client = storage.Client(project=None)  # objects need no project; credentials: ADC
        except Exception as err:  # noqa: BLE001 - DefaultCredentialsError and the like
            raise JobInputError(f"output_dir: {uri}: cannot open a GCS client: {_first_line(err)}") from None
        return cls(client.bucket(bucket))

    def create(self, key: str, body: bytes) -> str | None:
        return self._upload(key, body, 0)

    def read(self, key: str) -> tuple[bytes, str] | None:
        from google.api_core.exceptions import NotFound, PreconditionFailed

        for _ in range(3):  # the generation of the metadata, then those bytes (a rewrite in between: again)
            blob = self.bucket.get_blob(key)
            if blob is None:
                return None
            generation = blob.generation  # before the download, which sets it from the answer's headers
            try:
                return blob.download_as_bytes(if_generation_match=generation), str(generation)
            except NotFound:
                return None
            except PreconditionFailed:
                continue
        return None

    def replace(self, key: str, body: bytes, version: str | None) -> str | None:
        return None if version is None else self._upload(key, body, int(version))

    def _upload(self, key: str, body: bytes, generation: int) -> str | None:
        from google.api_core.exceptions import PreconditionFailed

        blob = self.bucket.blob(key)
        try:
            blob.upload_from_string(body, if_generation_match=generation)
        except PreconditionFailed:
            return None
        return str(blob.generation)

    def delete(self, key: str, version: str | None) -> None:
        from google.api_core.exceptions import NotFound, PreconditionFailed

        try:
            self.bucket.blob(key).delete(if_generation_match=None if version is None else int(version))
        except (NotFound, PreconditionFailed):
            pass


_OBJECT_STORES: dict[str, Any] = {"s3": S3Objects, "s3a": S3Objects, "gs": GcsObjects, "gcs": GcsObjects}


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]


def _decode(raw: bytes) -> Holder | None:
    try:
        return Holder(**json.loads(raw))
    except (ValueError, TypeError):
        return None
