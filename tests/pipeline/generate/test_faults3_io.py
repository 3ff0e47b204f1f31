"""A worker's slow I/O ticks the stall watchdog's progress while it runs, up to a limit (issue #52, item 3),
without Ray: the light sibling of tests/jobs/test_faults3_slow_io.py (a whole job, slow). Structural counts:
the ticks move while the block runs, and not at all when the limit is 0 (the control: a call hung past it)."""

from __future__ import annotations

import time

from pipeline import busy
from pipeline.generate import worker


def test_a_slow_block_ticks_the_watchdogs_progress_until_its_limit(monkeypatch):
    monkeypatch.setattr(worker, "IO_TICK_S", 0.01)
    before = busy.report()["busy_ticks"]
    with worker.io_progress():
        deadline = time.monotonic() + 10
        while busy.report()["busy_ticks"] < before + 3 and time.monotonic() < deadline:
            time.sleep(0.01)  # the slow read or write
    assert busy.report()["busy_ticks"] >= before + 3

    monkeypatch.setattr(worker, "IO_LIMIT_S", 0.0)
    before = busy.report()["busy_ticks"]
    with worker.io_progress():
        time.sleep(0.2)
    assert busy.report()["busy_ticks"] == before
