"""A sick device, and restart budgets over a long job (issue #40, findings 4 and 9), on the session's local Ray
with the tiny pair.

- A sick device: one actor's target forward raises a CUDA-like error whatever it runs (installed from outside
  with Ray's `__ray_call__`). Its batch fails, every row fails alone too, and so does the probe: the shard
  is the actor's fault, not the rows'. It goes back uncharged (`ray.shard_attempts=1`: one charge would end
  the job) and the actor is restarted at once; no error row is written for a healthy shard.
- A budget per window: one actor, `ray.max_restarts=1`, its device sick again after its first restart. The
  first restart is older than `ray.restart_window_s` by then, so the actor is restarted again instead of
  given up (which, with no other actor, would end the job).

Each ends with the output read back: every id once, only committed part files, `_SUCCESS`.
"""

from __future__ import annotations

import sys

import pytest
from ray import cloudpickle
from test_generate_faults import assert_complete
from tiny_pair_support import job_config

from pipeline.generate.config import from_dict
from pipeline.generate.job import run_generate
from pipeline.generate.reader import read_output
from pipeline.generate.scheduler import RunHooks

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the hooks below run on the actors


def _sick_device(generator) -> None:
    """On the actor: its target's forward raises like a GPU with a sticky error, whatever it runs."""
    import functools

    @functools.wraps(generator.target.forward)  # the same signature, which the engine checks
    def sick(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    generator.target.forward = sick


@pytest.mark.slow  # 12 s; test_feed.py and test_scheduler.py keep the rule in the default suite
def test_a_sick_device_is_the_actors_fault_its_shard_is_requeued_uncharged(
    tiny_pair, prompts_jsonl, tmp_path, ray_local, caplog
):
    out = tmp_path / "out"
    raw = job_config(
        tiny_pair, prompts_jsonl, out, shard_size=8,
        **{"spectr.batch_size": 2, "ray.max_restarts": 1, "ray.shard_attempts": 1, "ray.heartbeat_s": 0.5},
    )  # fmt: skip
    sick: list[int] = []
    written: dict[int, int] = {}

    def on_ready(actors, workers):
        ray_local.get(actors[0].__ray_call__.remote(_sick_device))
        sick.append(workers[0]["pid"])

    hooks = RunHooks(on_actors_ready=on_ready, on_shard_written=lambda r: written.__setitem__(r.index, r.worker["pid"]))
    with caplog.at_level("WARNING", logger="pipeline"):
        report = run_generate(from_dict(raw), hooks)
    assert report.exit_code == 0, report.messages  # no error row, no charged shard
    assert "its device fails every row and a probe" in caplog.text  # the sick actor was restarted at once
    assert sick[0] not in written.values()  # nothing of the sick process was committed
    assert read_output(out).column("error").null_count == len(prompt_lines(prompts_jsonl))
    assert_complete(out, prompts_jsonl)


def prompt_lines(path) -> list[str]:
    return path.read_text().splitlines()


@pytest.mark.slow  # about 20 s; tests/pipeline/generate/test_scheduler.py has the fast check
def test_restarts_older_than_the_window_no_longer_count(tiny_pair, prompts_jsonl, tmp_path, ray_local, caplog):
    out = tmp_path / "out"
    raw = job_config(
        tiny_pair, prompts_jsonl, out, shard_size=8,
        **{"spectr.batch_size": 2, "ray.num_actors": 1, "ray.max_restarts": 1, "ray.restart_window_s": 1.0,
           "ray.heartbeat_s": 0.5},
    )  # fmt: skip
    episodes: list[int] = []

    def make_sick(actor, worker):
        episodes.append(worker["pid"])
        ray_local.get(actor.__ray_call__.remote(_sick_device))

    def on_joined(actor, answer):  # the restarted process: sick once more
        if len(episodes) < 2:
            make_sick(actor, answer)

    hooks = RunHooks(on_actors_ready=lambda actors, workers: make_sick(actors[0], workers[0]),
                     on_actor_joined=on_joined)
    with caplog.at_level("WARNING", logger="pipeline"):
        report = run_generate(from_dict(raw), hooks)
    assert report.exit_code == 0, report.messages
    assert caplog.text.count("restarting an actor (its device fails") == 2 and len(set(episodes)) == 2
    assert "no restarts left" not in caplog.text
    assert_complete(out, prompts_jsonl)
