"""Real work is not a hang: the stall watchdog (`ray.stall_timeout_s`) leaves a compiling or a loading actor
alone, and still restarts a hung one (issue #40 finding 8).

One actor, one shard at a time (so no other shard's iterations move its progress meanwhile), a stall limit
of 1.5 s, pings every 0.3 s, on the session's real local Ray with the tiny pair. The slow work is installed
on the actor with Ray's `__ray_call__` (the test-only hook of `test_generate_faults.py`):

- a compile: the first forward of the target runs 5 s inside torch's compile callbacks
  (`torch._dynamo.callback_handler.install_callbacks`, what dynamo wraps every compile in), as a first
  `torch.compile` on a GPU would; control: the same 5 s without them (a hung forward) is restarted;
- a load: the input is gzip JSON lines, the actor keeps no open stream (each shard skips from the file's
  start, as a worker does whose shards are far apart) and every read of the stream takes 0.1 s, in reads
  of 64 bytes, so the last shard's skip runs ~3 s; control: one read of the stream that hangs 5 s.

Each ends with the output read back: every id once, `_SUCCESS`.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
from ray import cloudpickle
from tiny_pair_support import job_config

from pipeline.generate.config import from_dict
from pipeline.generate.job import run_generate
from pipeline.generate.reader import read_output
from pipeline.generate.scheduler import RunHooks

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the hooks below run on the actor

SLOW_S = 5.0  # longer than the stall limit below, many times over


def _slow_first_forward(generator, reported: bool) -> None:
    """On the actor: the target's first forward takes SLOW_S, inside torch's compile callbacks when `reported`
    (a compile), else not (a hang)."""
    import contextlib
    import functools
    import time

    from torch._dynamo.callback import CallbackTrigger, callback_handler

    original, calls = generator.target.forward, []

    @functools.wraps(original)  # the same signature, which the engine checks
    def forward(*args, **kwargs):
        if not calls:
            calls.append(1)
            during = callback_handler.install_callbacks(CallbackTrigger.DYNAMO, "0/0") if reported \
                else contextlib.nullcontext()
            with during:
                time.sleep(SLOW_S)
        return original(*args, **kwargs)

    generator.target.forward = forward


def _slow_stream(generator, hang: bool) -> None:
    """On the actor: no open stream is kept (each shard skips from the start), the skip reads 64 bytes at a
    time, each read of the stream takes 0.1 s; with `hang`, the first read of the second shard's stream takes
    SLOW_S instead (a read that hangs)."""
    import time

    from pipeline import prompts

    original, opened = prompts.open_text_stream, []

    class Slow:
        def __init__(self, stream, first_wait):
            self.stream, self.first_wait = stream, first_wait

        def read(self, n=-1):
            time.sleep(self.first_wait or 0.1)
            self.first_wait = 0.0
            return self.stream.read(n)

        def close(self):
            self.stream.close()

    def open_slow(location):
        opened.append(1)
        return Slow(original(location), SLOW_S if hang and len(opened) == 2 else 0.0)

    prompts.open_text_stream, prompts.MAX_STREAMS, prompts.SKIP_BYTES = open_slow, 0, 64


def run_with(tiny_pair, data, out, hook, *args):
    """The job with `hook(*args)` installed on its one actor; (report, pids that wrote shards, pids that
    joined later: restarts)."""
    raw = job_config(
        tiny_pair, data, out, shard_size=10,
        **{"spectr.max_new_tokens": 4, "spectr.batch_size": 2, "ray.num_actors": 1, "ray.shards_per_actor": 1,
           "ray.max_restarts": 1, "ray.heartbeat_s": 0.3, "ray.heartbeat_timeout_s": 60,
           "ray.stall_timeout_s": 1.5},
    )  # fmt: skip
    import ray

    first: list[int] = []
    joined: list[int] = []
    written: set[int] = set()

    def on_ready(actors, workers):
        ray.get(actors[0].__ray_call__.remote(hook, *args))
        first.append(workers[0]["pid"])

    hooks = RunHooks(on_actors_ready=on_ready, on_shard_written=lambda r: written.add(r.worker["pid"]),
                     on_actor_joined=lambda actor, worker: joined.append(worker["pid"]))
    report = run_generate(from_dict(raw), hooks)
    ids = [json.loads(line)["id"] for line in (gzip.open(data, "rt") if data.suffix == ".gz" else open(data))]
    assert report.exit_code == 0 and read_output(out).column("id").to_pylist() == ids  # every id once
    assert (out / "_SUCCESS").exists()
    return first[0], written, joined


@pytest.fixture(scope="module")
def prompts_gz(prompts_jsonl, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gz") / "prompts.jsonl.gz"
    path.write_bytes(gzip.compress(prompts_jsonl.read_bytes()))
    return path


def test_a_slow_compile_is_not_taken_for_a_hang(tiny_pair, prompts_jsonl, tmp_path, ray_local):
    """The first forward compiles for 5 s (stall limit 1.5 s): the actor is never restarted."""
    first, written, joined = run_with(tiny_pair, prompts_jsonl, tmp_path / "out", _slow_first_forward, True)
    assert written == {first} and not joined


# slow: a whole job with ~6 s of skipping; the default suite counts the skip's blocks in
# tests/pipeline/test_busy.py::test_skipping_ahead_in_a_compressed_stream_advances_at_each_block
@pytest.mark.slow
def test_a_long_skip_in_a_compressed_stream_is_not_taken_for_a_hang(tiny_pair, prompts_gz, tmp_path, ray_local):
    """Each shard's skip reads the stream from its start at 0.1 s per 64 bytes (the last ~3 s, stall limit
    1.5 s): each block read is progress, the actor is never restarted."""
    first, written, joined = run_with(tiny_pair, prompts_gz, tmp_path / "out", _slow_stream, False)
    assert written == {first} and not joined


# the controls: the watchdog still restarts an actor that hangs in the same places (slow: two whole jobs with a
# restart; the default suite's control is tests/pipeline/generate/test_scheduler.py::
# test_a_compiling_actor_is_not_stalled_until_the_compile_limit)
@pytest.mark.slow
@pytest.mark.parametrize("case", ["forward", "stream read"])
def test_a_hang_in_the_same_place_is_still_restarted(case, tiny_pair, prompts_jsonl, prompts_gz, tmp_path, ray_local):
    hook, data = (_slow_first_forward, prompts_jsonl) if case == "forward" else (_slow_stream, prompts_gz)
    first, written, joined = run_with(tiny_pair, data, tmp_path / "out", hook, case != "forward")
    assert joined and written - {first}  # restarted: its new process wrote the shards from then on
