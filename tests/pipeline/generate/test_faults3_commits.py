"""The commit log is fenced (issue #52, item 2): a job that lost its directory cannot add to its results, and
learns that it lost. Faults injected from outside, in the output directory: another job's lease written over
ours (a takeover), the log rewritten by another job's compaction, a late append after another run's fence.
Before: the lease was judged from the heartbeat's last reading only (up to lease_timeout_s / 6 old), an append
after a compaction went to the replaced file and was lost without a word, and every record counted."""

from __future__ import annotations

import json

import pytest

from pipeline import fs
from pipeline.generate.commit_log import (
    AppendLog,
    CommitLogReplaced,
    CommitWriter,
    compact_commit_log,
    fenced,
    read_commit_records,
)
from pipeline.generate.lease import Lease, LeaseLostError


def location(path):
    return fs.resolve(str(path), "output_dir")


def record(shard, run):
    return {"shard": shard, "file": f"part-{shard}-{run}.parquet", "rows": 1, "bytes": 10, "run": run}


def test_an_append_after_another_jobs_compaction_raises_instead_of_being_lost(tmp_path):
    out = location(tmp_path)
    old = AppendLog(out)
    old.append(record(0, "a"))
    old.append(record(0, "a"))  # a retried shard: the compaction drops one record and rewrites the file
    assert compact_commit_log(out) == 1  # the job that took the directory over
    with pytest.raises(CommitLogReplaced, match="rewritten or removed by another job"):
        old.append(record(1, "a"))
    old.close()
    assert [r["shard"] for r in read_commit_records(out)] == [0]


def test_records_of_another_run_after_its_fence_are_ignored_and_compaction_keeps_the_rest(tmp_path):
    out = location(tmp_path)
    old = AppendLog(out)
    old.append(fenced(record(0, "a")))
    old.append(record(1, "a"))
    new = AppendLog(out)  # the run that took the directory over (nothing to compact)
    new.append(fenced(record(2, "b")))
    old.append(record(3, "a"))  # the old holder's late append
    new.append(record(1, "b"))
    old.close()
    new.close()
    assert [(r["shard"], r["run"]) for r in read_commit_records(out)] == [(0, "a"), (1, "a"), (2, "b"), (1, "b")]
    assert len((tmp_path / "_commits.jsonl").read_text().splitlines()) == 5  # the late line is there, ignored
    assert compact_commit_log(out) == 1  # a later run: shard 1's first record dropped; no fence mark kept
    kept = [(r["shard"], r["run"], "fence" in r) for r in read_commit_records(out)]
    assert kept == [(0, "a", False), (2, "b", False), (1, "b", False)]


def test_the_lease_is_read_right_before_each_append(tmp_path):
    out = location(tmp_path)
    lease = Lease.acquire(out, timeout_s=600)  # a heartbeat every 100 s: its last reading says nothing new
    try:
        raw = json.loads((tmp_path / "_lease.json").read_text())
        (tmp_path / "_lease.json").write_text(json.dumps({**raw, "token": "another-job", "host": "elsewhere"}))
        writer = CommitWriter(AppendLog(out), check=lease.confirm, backoff_s=0.0)
        writer.submit(record(0, lease.holder.token), "shard 0")
        with pytest.raises(LeaseLostError, match="no longer held by the job"):
            writer.flush()
        writer.close()
    finally:
        lease.release()
    assert list(read_commit_records(out)) == []


def test_an_append_that_never_returns_fails_the_job_after_its_limit():
    """The log's file system hangs (an NFS hard mount whose server went away; injected: an append that blocks
    until the test ends). Before, the job's end waited on it for ever; now `flush` raises once the append ran
    past the writer's limit."""
    import threading

    from pipeline.generate.commit_log import CommitTimeout

    release = threading.Event()

    class HungLog:
        def append(self, record):
            release.wait(60)

        def close(self):
            pass

    writer = CommitWriter(HungLog(), timeout_s=0.3)
    try:
        writer.submit(record(0, "a"), "shard 0")
        with pytest.raises(CommitTimeout, match="has not returned for 0.3 s"):
            writer.flush()
    finally:
        release.set()
        writer.close()
