"""The driver's commit log writer (`pipeline.generate.commit_log.CommitWriter`): a slow store never holds the
caller, a failing one is retried, and a retried append leaves whole lines only."""

from __future__ import annotations

import threading
import time

import pytest

from pipeline import fs
from pipeline.generate import commit_log
from pipeline.generate.commit_log import AppendLog, CommitWriter, read_commit_records


class BlockingLog:
    """A log whose appends wait for `release` (an upload that hangs)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.records: list[dict] = []

    def append(self, record: dict) -> None:
        self.release.wait(30)
        self.records.append(record)

    def close(self) -> None:
        pass


class FlakyLog:
    """A log whose first `failures` appends raise."""

    def __init__(self, failures: int) -> None:
        self.failures, self.tries, self.records = failures, 0, []

    def append(self, record: dict) -> None:
        self.tries += 1
        if self.tries <= self.failures:
            raise OSError("connection reset by peer")
        self.records.append(record)

    def close(self) -> None:
        pass


def test_a_hanging_store_never_holds_the_caller():
    """`submit` returns at once while the append hangs; the result is handed back once its record is in."""
    log = BlockingLog()
    writer = CommitWriter(log)
    started = time.monotonic()
    for shard in range(3):
        writer.submit({"shard": shard}, f"result {shard}")
    assert time.monotonic() - started < 1.0 and writer.committed() == []
    log.release.set()
    assert writer.flush() == ["result 0", "result 1", "result 2"]  # in order
    assert [r["shard"] for r in log.records] == [0, 1, 2]
    writer.close()


def test_a_failed_append_is_retried_before_the_job_gives_up():
    writer = CommitWriter(FlakyLog(2), attempts=3, backoff_s=0.0)
    writer.submit({"shard": 0}, "result 0")
    assert writer.flush() == ["result 0"]
    writer.close()
    failing = CommitWriter(FlakyLog(3), attempts=3, backoff_s=0.0)
    failing.submit({"shard": 0}, "result 0")
    with pytest.raises(OSError, match="connection reset"):
        failing.flush()
    with pytest.raises(OSError):  # and every later call: nothing after it is appended
        failing.submit({"shard": 1}, "result 1")
    failing.close()


def test_a_lost_lease_is_raised_without_a_retry():
    class Lost(Exception):
        pass

    def check():
        raise Lost("taken over")

    log = FlakyLog(0)
    writer = CommitWriter(log, check=check, attempts=3, backoff_s=0.0)
    writer.submit({"shard": 0}, "result 0")
    with pytest.raises(Lost):
        writer.flush()
    assert log.tries == 0
    writer.close()


def test_a_retried_local_append_cuts_what_the_failed_one_left(tmp_path, monkeypatch):
    """The first append writes half its line, then fails: the retry cuts it off, so the log has whole lines."""
    output = fs.resolve(str(tmp_path), "output_dir")
    log = AppendLog(output)
    log.append({"shard": 0})
    original, calls = AppendLog.append, []

    def half_then_fail(self, record):
        calls.append(record["shard"])
        if len(calls) == 1:
            self._torn = True
            self._file.write(commit_log.encode(record)[:7])
            self._file.flush()
            raise OSError("disk went away")
        return original(self, record)

    monkeypatch.setattr(AppendLog, "append", half_then_fail)
    writer = CommitWriter(log, attempts=3, backoff_s=0.0)
    writer.submit({"shard": 1}, 1)
    writer.submit({"shard": 2}, 2)
    assert writer.flush() == [1, 2] and calls == [1, 1, 2]
    writer.close()
    text = (tmp_path / commit_log.COMMITS_FILE).read_text()
    assert [r["shard"] for r in read_commit_records(output)] == [0, 1, 2]
    assert text.count("\n") == 3 and all(line.startswith("{") for line in text.splitlines())


def test_a_retried_segment_upload_holds_each_record_once(tmp_path, monkeypatch):
    """Object stores: the retry uploads the same segment again, not the record twice."""
    output = fs.resolve(str(tmp_path), "output_dir")
    (tmp_path / commit_log.COMMITS_DIR).mkdir()  # an object store needs none; the local stand-in does
    log = commit_log.SegmentLog(output, run=1)
    original, calls = fs.write_bytes, []

    def fail_once(location, data):
        calls.append(location)
        if len(calls) == 2:
            raise OSError("503 slow down")
        return original(location, data)

    monkeypatch.setattr(commit_log.fs, "write_bytes", fail_once)
    writer = CommitWriter(log, attempts=3, backoff_s=0.0)
    for shard in range(3):
        writer.submit({"shard": shard}, shard)
    assert writer.flush() == [0, 1, 2]
    writer.close()
    assert [r["shard"] for r in read_commit_records(output)] == [0, 1, 2]
