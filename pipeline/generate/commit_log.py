"""The commit log: one record per finished shard, appended and never rewritten.

    log = open_commit_log(output)          # under the job's lease
    log.append({"shard": 3, "file": "part-000003-<run>-0.parquet", "rows": 16, "bytes": 5012, ...})
    for record in read_commit_records(output): ...

On a local disk or NFS the log is `_commits.jsonl`: each record is one line, written, flushed and fsynced
before the driver counts the shard as done (a line torn by a crash is cut off when the next run opens the
log, and skipped by readers). Object stores cannot append, so there the log is a folder `_commits/` of
segment objects `seg-<run>-<n>.jsonl`; each commit uploads the current segment whole (the earlier records of
the segment plus the new one, at most `SEGMENT_RECORDS`), so a commit costs one small upload and resume
reads one object per `SEGMENT_RECORDS` shards. A run's segments sort after every earlier run's, and a later
record for a shard (a retried one) wins.

Fencing: a run's first record is its fence (`fenced`: `"fence": true`, its `run` the lease token); after it,
records of any other run (a late append of a job that lost the lease) are ignored by every reader; a
compaction keeps only records that count, unmarked. The driver reads the lease right
before each append (`Lease.confirm`), and a local log checks that its path still names the file it appends to:
after another job's compaction the old holder's append raises (`CommitLogReplaced`) instead of going to the
replaced file. (On object stores each run writes its own segments: there the lease read before each append is
the fence.)

`compact_commit_log` (a resumed job, under its lease, before it appends) keeps only each shard's last
record, so the log a resume reads is bounded by the number of shards however often they were redone: the
file is rewritten whole (temporary name + rename), the segments are replaced by compacted ones of a newer run
(then the old ones deleted; a crash in between leaves duplicates of the same last records).

The driver appends through a `CommitWriter`: the records go out in order on a thread of their own, so a slow
store (an upload that blocks for minutes) slows the commits, never the scheduling thread, whose pings would
then look missed and whose healthy actors would be restarted. A failed append is retried like the other
bookkeeping (`fs.BEST_EFFORT_ATTEMPTS` tries, then the job fails): a retried line replaces what the failed one
may have left, and a retried segment is uploaded whole again.

Not here: what a record means for resume (`pipeline.generate.manifest`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from pipeline import fs
from pipeline.errors import JobFailedError

COMMITS_FILE = "_commits.jsonl"
COMMITS_DIR = "_commits"
SEGMENT_RECORDS = 256
_SEGMENT = re.compile(r"^seg-(\d{6,})-(\d{6,})\.jsonl$")
COMMIT_BACKOFF_S = 1.0  # before the n-th retry of an append: n times this
APPEND_TIMEOUT_S = 600.0  # an append (a local write and fsync, an upload) that has not returned by then: the job fails

log = logging.getLogger("pipeline")


class CommitLogReplaced(JobFailedError):
    """The local log this job appends to was rewritten or removed by another job (its compaction, after it took
    the directory over): this job no longer holds the directory, and appends nothing more."""


class CommitTimeout(JobFailedError):
    """An append to the commit log did not return within its limit (`CommitWriter.timeout_s`)."""


def _open_append(path: str) -> Any:
    """The local log for appending, created `fs.FILE_MODE` (no world read)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, fs.FILE_MODE), "ab")


def encode(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, separators=(",", ":"), sort_keys=True) + "\n").encode()


class AppendLog:
    """`_commits.jsonl` on a local filesystem: one fsynced line per record."""

    def __init__(self, output: fs.Location):
        self.path = os.path.join(output.path, COMMITS_FILE)
        _cut_torn_tail(self.path)
        self._end = os.path.getsize(self.path) if os.path.exists(self.path) else 0  # the last whole line's end
        self._torn = False  # an append failed: part of its line may be in the file (or the buffer)
        self._file = _open_append(self.path)

    def append(self, record: dict[str, Any]) -> None:
        if self._torn:  # a retry: what the failed append left is cut off first
            try:
                self._file.close()
            except OSError:
                pass
            os.truncate(self.path, self._end)
            self._file = _open_append(self.path)
        self._check_same_file()
        line = encode(record)
        self._torn = True
        self._file.write(line)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._torn, self._end = False, self._end + len(line)

    def _check_same_file(self) -> None:
        """The path still names the file this log appends to: another job's compaction (a takeover) replaces
        it, and an append to the replaced file would be lost without a word."""
        try:
            same = os.stat(self.path).st_ino == os.fstat(self._file.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            raise CommitLogReplaced(f"commit log: {self.path} was rewritten or removed by another job (it took the "
                                    "directory over); this job stops without writing _SUCCESS")

    def close(self) -> None:
        self._file.close()


class SegmentLog:
    """`_commits/seg-<run>-<n>.jsonl` on object stores (and HDFS): one upload per record."""

    def __init__(self, output: fs.Location, run: int):
        self.folder = output.child(COMMITS_DIR)
        self.run = run
        self.segment = 0
        self._lines: list[bytes] = []

    def append(self, record: dict[str, Any]) -> None:
        lines = [*self._lines, encode(record)]  # kept only once uploaded: a retry uploads the same segment
        fs.write_bytes(self.folder.child(f"seg-{self.run:06d}-{self.segment:06d}.jsonl"), b"".join(lines))
        self._lines = lines
        if len(self._lines) >= SEGMENT_RECORDS:
            self.segment += 1
            self._lines = []

    def close(self) -> None:
        pass


class CommitWriter:
    """The commit log on a thread of its own; see the module docstring.

        writer = CommitWriter(open_commit_log(output), check=lease.check)
        writer.submit(record, result)      # returns at once
        for result in writer.committed(): ...   # on the caller's thread: their records are durable
        writer.flush()                     # waits until every record is (the job's end), then committed()

    `check()` runs before each try (a lost lease: no retry). An append that fails `attempts` times, or a failed
    check, is raised by the next `submit`, `committed` or `flush`; nothing after it is appended."""

    def __init__(self, commits: AppendLog | SegmentLog, check: Callable[[], None] | None = None,
                 attempts: int = fs.BEST_EFFORT_ATTEMPTS, backoff_s: float | None = None,
                 timeout_s: float = APPEND_TIMEOUT_S):
        self.commits, self.check, self.attempts = commits, check, attempts
        self.backoff_s = COMMIT_BACKOFF_S if backoff_s is None else backoff_s
        self.timeout_s = timeout_s  # one append's limit: a hung filesystem (an NFS hard mount) fails the job
        self._busy_since = 0.0
        self._pending: deque[tuple[dict[str, Any], Any]] = deque()
        self._done: list[Any] = []
        self._error: BaseException | None = None
        self._busy = False
        self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="commit-log", daemon=True)
        self._thread.start()

    def submit(self, record: dict[str, Any], item: Any) -> None:
        with self._changed:
            self._raise()
            self._pending.append((record, item))
            self._changed.notify_all()

    def committed(self) -> list[Any]:
        """The items whose records were appended since the last call, in order."""
        with self._changed:
            self._raise()
            done, self._done = self._done, []
            return done

    def flush(self) -> list[Any]:
        """Wait until every submitted record is appended (or one failed for good, or one append ran past
        `timeout_s`); then `committed()`."""
        with self._changed:
            while not self._changed.wait_for(lambda: self._error is not None or not (self._pending or self._busy),
                                             timeout=1.0):
                self._raise()
        return self.committed()

    def close(self, timeout_s: float = 10.0) -> None:
        """Drop what is not appended yet; wait at most `timeout_s` for an append in progress; close the log."""
        with self._changed:
            self._closed = True
            self._pending.clear()
            self._changed.notify_all()
        self._thread.join(timeout_s)
        self.commits.close()

    def _raise(self) -> None:
        """Under the lock: the append's failure, or one that has not returned for `timeout_s`."""
        if self._error is None and self._busy and time.monotonic() - self._busy_since > self.timeout_s:
            self._error = CommitTimeout(f"commit log: an append has not returned for {self.timeout_s:g} s (a hung "
                                        "filesystem or store?); the job stops without _SUCCESS (re-run to resume)")
            self._pending.clear()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._pending or self._closed)
                if self._closed:
                    return
                record, item = self._pending.popleft()
                self._busy, self._busy_since = True, time.monotonic()
            try:
                self._append(record)
            except BaseException as err:  # noqa: BLE001 - raised on the job's thread
                with self._changed:
                    self._error, self._busy = err, False
                    self._pending.clear()
                    self._changed.notify_all()
                return
            with self._changed:
                self._done.append(item)
                self._busy = False
                self._changed.notify_all()

    def _append(self, record: dict[str, Any]) -> None:
        for attempt in range(self.attempts):
            try:
                if self.check is not None:
                    self.check()  # never commit into a directory another job has taken over
                self.commits.append(record)
                return
            except JobFailedError:  # the lease lost, the log replaced: not retried
                raise
            except Exception as err:  # noqa: BLE001 - retried (a lease that cannot be read: unknown), then raised
                if attempt + 1 == self.attempts:
                    raise
                log.warning("commit log: appending shard %s's record failed (%s: %s); retrying",
                            record.get("shard"), type(err).__name__, err)
                time.sleep(self.backoff_s * (attempt + 1))


def open_commit_log(output: fs.Location) -> AppendLog | SegmentLog:
    if output.is_local:
        return AppendLog(output)
    runs = [int(m.group(1)) for m in (_SEGMENT.match(name) for name in _segment_names(output)) if m]
    return SegmentLog(output, max(runs, default=0) + 1)


def compact_commit_log(output: fs.Location) -> int:
    """Keep each shard's last record only; returns how many records were dropped (0: nothing rewritten)."""
    last: dict[int, dict[str, Any]] = {}
    total = 0
    for record in read_commit_records(output):
        last.pop(record["shard"], None)  # re-inserted: the dict keeps the order of last records
        last[record["shard"]] = record
        total += 1
    dropped = total - len(last)
    if not dropped:
        return 0
    # every kept record counts: its fence mark goes (a superseded fence must not hide a later run's records)
    lines = [encode({k: v for k, v in record.items() if k != "fence"}) for record in last.values()]
    if output.is_local:
        fs.write_bytes(output.child(COMMITS_FILE), b"".join(lines))
        return dropped
    old = [name for name in _segment_names(output) if _SEGMENT.match(name)]
    run = max((int(_SEGMENT.match(name).group(1)) for name in old), default=0) + 1
    folder = output.child(COMMITS_DIR)
    for n, start in enumerate(range(0, len(lines), SEGMENT_RECORDS)):
        fs.write_bytes(folder.child(f"seg-{run:06d}-{n:06d}.jsonl"), b"".join(lines[start : start + SEGMENT_RECORDS]))
    if fs.exists(output.child(COMMITS_FILE)):
        fs.delete(output.child(COMMITS_FILE))
    for name in old:
        fs.delete(folder.child(name))
    return dropped


def _segment_names(output: fs.Location) -> list[str]:
    return sorted(info.base_name for info in fs.list_files(output.child(COMMITS_DIR), "output_dir"))


def _cut_torn_tail(path: str) -> None:
    """Drop a last line without its newline (a crash mid-append); we hold the lease, nobody else writes."""
    if not os.path.exists(path):
        return
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        position = end
        while position > 0:
            step = min(position, 1 << 16)
            f.seek(position - step)
            chunk = f.read(step)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                keep = position - step + newline + 1
                break
            position -= step
        else:
            keep = 0
        if keep < end:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())


def fenced(record: dict[str, Any]) -> dict[str, Any]:
    """A run's first record (its `run` the run's lease token) marked as its fence: after it, records of any
    other run (a late append of a job that lost the lease) are ignored."""
    return {**record, "fence": True}


def read_commit_records(output: fs.Location) -> Iterator[dict[str, Any]]:
    """Every readable record, oldest first: `_commits.jsonl`, then the segments in name order. After a run's
    fence (`fenced`), a record of another run is ignored; records before any fence (older logs) count."""
    fence: Any = None
    for record in _all_records(output):
        if record.get("fence"):
            fence = record.get("run")
        if fence is None or record.get("run", fence) == fence:
            yield record


def _all_records(output: fs.Location) -> Iterator[dict[str, Any]]:
    log = output.child(COMMITS_FILE)
    if fs.exists(log):
        yield from _records(fs.read_bytes(log))
    for name in _segment_names(output):
        if _SEGMENT.match(name):
            yield from _records(fs.read_bytes(output.child(COMMITS_DIR).child(name)))


def _records(data: bytes) -> Iterator[dict[str, Any]]:
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line torn by a crash (only ever the last one)
        if isinstance(record, dict) and isinstance(record.get("shard"), int):
            yield record
