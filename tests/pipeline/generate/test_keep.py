"""Sweep cells that keep the pair loaded (`pipeline.generate.keep`), on the session's real local Ray.

- Two cells with the same pair, run as a multirun runs them (`run_generate` twice in one process with the
  keeper): the second runs on the first's actor (same process, no load: `actor_load` 0), with its own
  method, output and counts; a third cell whose `model.target` is another directory (a copy of the same
  weights) loads the pair in a new actor, and its rows equal the second cell's: the kept actor generated
  exactly what a fresh one does.
- Only a pool that ended clean is kept: a restart, a replacement or a failed shard leaves nothing for the
  next cell, whose fault handling then starts from nothing.
"""

from __future__ import annotations

import shutil

import pytest
from tiny_pair_support import job_config

from pipeline.generate.config import from_dict
from pipeline.generate.job import run_generate
from pipeline.generate.keep import PairKeeper
from pipeline.generate.reader import read_output
from pipeline.generate.scheduler import KeptActors, RunHooks, ShardActorPool, _Slot


def cell(tiny_pair, prompts_jsonl, out, **overrides):
    settings = {"data.limit": 8, "shard_size": 4, "ray.num_actors": 1, "spectr.max_new_tokens": 6, **overrides}
    return from_dict(job_config(tiny_pair, prompts_jsonl, out, **settings))


@pytest.mark.slow  # 17 s: three job cells; the keeper and pool rules stay in the default suite
def test_cells_with_the_same_pair_share_the_actor_and_another_target_reloads(
    tiny_pair, prompts_jsonl, tmp_path, ray_local
):
    keeper = PairKeeper()
    pids: list[list[int]] = []
    hooks = RunHooks(on_actors_ready=lambda actors, workers: pids.append([w["pid"] for w in workers]))
    other = {**tiny_pair, "target": tmp_path / "target-copy"}
    shutil.copytree(tiny_pair["target"], other["target"])
    try:
        first = run_generate(cell(tiny_pair, prompts_jsonl, tmp_path / "ar", **{"spectr.method": "autoregressive"}),
                             hooks, keep=keeper)  # fmt: skip
        second = run_generate(cell(tiny_pair, prompts_jsonl, tmp_path / "sp", **{"spectr.method": "speculative"}),
                              hooks, keep=keeper)  # fmt: skip
        third = run_generate(cell(other, prompts_jsonl, tmp_path / "other", **{"spectr.method": "speculative"}),
                             hooks, keep=keeper)  # fmt: skip
        assert keeper.kept is not None  # the last clean pool waits for a next cell
    finally:
        keeper.close()
    assert keeper.kept is None
    assert [r.exit_code for r in (first, second, third)] == [0, 0, 0]
    assert pids[0] == pids[1] and pids[2] != pids[0]  # kept, then reloaded in a new actor
    phases = [r.summary.startup_phases for r in (first, second, third)]
    assert phases[0]["actor_load"] > 0 and phases[1]["actor_load"] == 0 and phases[2]["actor_load"] > 0

    ar, sp, again = (read_output(tmp_path / name).to_pylist() for name in ("ar", "sp", "other"))
    assert all(row["target_calls"] == row["completion_tokens"] for row in ar)  # autoregressive: one call a token
    assert any(row["target_calls"] < row["completion_tokens"] for row in sp)  # the second cell's own method
    assert [row["completion_token_ids"] for row in sp] == [row["completion_token_ids"] for row in again]
    assert [row["target_calls"] for row in sp] == [row["target_calls"] for row in again]
    for report, rows in ((first, ar), (second, sp)):  # each summary counts its own cell's work only
        assert report.summary.num_prompts == 8 == len(rows)
        assert report.summary.generated_tokens == sum(row["completion_tokens"] for row in rows)
        assert report.summary.target_calls == sum(row["target_calls"] for row in rows)


class _Pool:
    """What the keeper asks of a pool: its clean actors, or to be shut down."""

    def __init__(self, kept):
        self._kept, self.shut = kept, False

    def kept(self):
        return self._kept

    def shutdown(self):
        self.shut = True


def pool_with(slots: list[_Slot], failures: dict[int, int] | None = None) -> ShardActorPool:
    pool = ShardActorPool.__new__(ShardActorPool)  # the driver's bookkeeping only: no Ray
    pool._slots, pool.actors, pool._failures = slots, [slot.actor for slot in slots], failures or {}
    pool.progress, pool._progress_name = "progress", "spectr-progress-x"
    return pool


@pytest.mark.parametrize("fault", ["none", "restarted", "dead", "suspect", "failed shard", "busy"])
def test_only_a_pool_that_ended_clean_is_kept(fault):
    slots = [_Slot("a"), _Slot("b")]
    failures = {}
    if fault == "restarted":
        slots[1].lives = 1
    elif fault == "dead":
        slots[1].state = "dead"
    elif fault == "suspect":
        slots[0].state = "suspect"
    elif fault == "failed shard":
        slots[0].failed, failures = {3}, {3: 1}
    elif fault == "busy":
        slots[0].in_flight.append(("ref", "task"))
    kept = pool_with(slots, failures).kept()
    assert (kept == KeptActors(["a", "b"], "progress", "spectr-progress-x")) if fault == "none" else kept is None


def test_the_keeper_shuts_down_what_it_cannot_keep_and_gives_only_a_matching_key():
    keeper = PairKeeper()
    sick = _Pool(None)
    keeper.hold(("pair", "ray", (1, 1.0, 0.0)), sick)
    assert sick.shut and keeper.kept is None
    clean = _Pool(KeptActors([], "progress", "name"))
    keeper.hold(("pair", "ray", (1, 1.0, 0.0)), clean)
    assert not clean.shut and keeper.take(("pair", "ray", (1, 1.0, 0.0))) is clean.kept()
    assert keeper.take(("pair", "ray", (1, 1.0, 0.0))) is None  # taken: the caller's now
    keeper.hold(("pair", "ray", (1, 1.0, 0.0)), clean)
    assert keeper.take(("other pair", "ray", (1, 1.0, 0.0))) is None and keeper.kept is None  # shut down
