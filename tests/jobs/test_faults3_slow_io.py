"""A worker's slow write is work, not a hang (issue #52, item 3): the stall watchdog leaves it alone.

One actor, one shard at a time, a stall limit of 1.5 s, pings every 0.3 s (as `test_generate_long_work.py`).
The fault is installed on the actor with Ray's `__ray_call__` (the test-only hook of the fault tests): its
first part write takes 5 s inside one call (a slow upload to a far store, a slow NFS). Before the fix its
progress stood still for the whole call and the watchdog restarted a healthy actor; now the write ticks the
watchdog's progress while it runs. The control (slow): the same write with the ticks' limit at 0 (a call
hung past `IO_LIMIT_S`) is restarted.
"""

from __future__ import annotations

import sys

import pytest
from ray import cloudpickle
from test_generate_long_work import run_with

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the hook below runs on the actor

SLOW_S = 5.0


def _slow_first_write(generator, limit_s: float | None) -> None:
    """On the actor: the first `pipeline.fs.write_bytes` (the first part) takes SLOW_S; `limit_s`: the I/O
    ticks' limit (None: as shipped)."""
    import time

    from pipeline import fs
    from pipeline.generate import worker

    original, calls = fs.write_bytes, []

    def write_bytes(location, data):
        if not calls:
            calls.append(1)
            time.sleep(SLOW_S)
        return original(location, data)

    fs.write_bytes = write_bytes
    if limit_s is not None:
        worker.IO_LIMIT_S = limit_s


@pytest.mark.slow  # a whole job; the default suite's sibling: tests/pipeline/generate/test_faults3_io.py
def test_a_slow_part_write_is_not_taken_for_a_hang(tiny_pair, prompts_jsonl, tmp_path, ray_local):
    first, written, joined = run_with(tiny_pair, prompts_jsonl, tmp_path / "out", _slow_first_write, None)
    assert written == {first} and not joined


@pytest.mark.slow  # a whole job with a restart: the control of the test above
def test_a_write_hung_past_the_limit_is_still_restarted(tiny_pair, prompts_jsonl, tmp_path, ray_local):
    first, written, joined = run_with(tiny_pair, prompts_jsonl, tmp_path / "out", _slow_first_write, 0.0)
    assert joined and written - {first}
