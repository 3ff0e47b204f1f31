"""The commit log: one record per finished shard, appended and never rewritten.

    log = open_commit_log(output)          # under the job's lease
    log.append({"shard": 3, "file": "part-000003.parquet", "rows": 16, "bytes": 5012, ...})
    for record in read_commit_records(output): ...

On a local disk or NFS the log is `_commits.jsonl`: each record is one line, written, flushed and fsynced
before the driver counts the shard as done (a line torn by a crash is cut off when the next run opens the
log, and skipped by readers). Object stores cannot append, so there the log is a folder `_commits/` of
segment objects `seg-<run>-<n>.jsonl`; each commit uploads the current segment whole (the earlier records of
the segment plus the new one, at most `SEGMENT_RECORDS`), so a commit costs one small upload and resume
reads one object per `SEGMENT_RECORDS` shards. A run's segments sort after every earlier run's, and a later
record for a shard (a retried one) wins.

`compact_commit_log` (a resumed job, under its lease, before it appends) keeps only each shard's last
record, so the log a resume reads is bounded by the number of shards however often they were redone: the
file is rewritten whole (temporary name + rename), the segments are replaced by compacted ones of a newer run
(then the old ones deleted; a crash in between leaves duplicates of the same last records).

Not here: what a record means for resume (`pipeline.generate.manifest`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

from pipeline import fs

COMMITS_FILE = "_commits.jsonl"
COMMITS_DIR = "_commits"
SEGMENT_RECORDS = 256
_SEGMENT = re.compile(r"^seg-(\d{6,})-(\d{6,})\.jsonl$")


def encode(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, separators=(",", ":"), sort_keys=True) + "\n").encode()


class AppendLog:
    """`_commits.jsonl` on a local filesystem: one fsynced line per record."""

    def __init__(self, output: fs.Location):
        self.path = os.path.join(output.path, COMMITS_FILE)
        _cut_torn_tail(self.path)
        self._file = open(self.path, "ab")

    def append(self, record: dict[str, Any]) -> None:
        self._file.write(encode(record))
        self._file.flush()
        os.fsync(self._file.fileno())

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
        self._lines.append(encode(record))
        fs.write_bytes(self.folder.child(f"seg-{self.run:06d}-{self.segment:06d}.jsonl"), b"".join(self._lines))
        if len(self._lines) >= SEGMENT_RECORDS:
            self.segment += 1
            self._lines = []

    def close(self) -> None:
        pass


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
    lines = [encode(record) for record in last.values()]
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


def read_commit_records(output: fs.Location) -> Iterator[dict[str, Any]]:
    """Every readable record, oldest first: `_commits.jsonl`, then the segments in name order."""
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
