"""Restart accounting (issue #52, item 3), on the scheduler's fake Ray (`test_scheduler.py`): the faults are
the answers Ray gives (an `ActorDiedError` whose node was preempted) and an actor whose progress stands still.

- A preempted actor's death charges no shard (before: its first shard was charged, so a spot reclaim cost
  attempts of healthy shards); an ordinary death still charges (the control).
- A shard that hangs its actor is charged one attempt per hang, and given up after `ray.shard_attempts`
  (before: every hang restarted an actor uncharged, until the restart budget of every actor was spent).
"""

from __future__ import annotations

import pytest
from test_scheduler import in_flight, make_pool


def died(preempted: bool) -> BaseException:
    from ray.exceptions import ActorDiedError

    err = ActorDiedError()
    err._preempted = preempted
    return err


@pytest.mark.parametrize("preempted", [True, False])
def test_a_preempted_actor_charges_no_shard(monkeypatch, preempted):
    pool, ray, clock, queue = make_pool(monkeypatch, ["a", "b"], shard_attempts=1)
    a, _ = pool._slots
    pool._dispatch(queue, None)
    ref, task = a.in_flight[0]
    ray.answers[ref] = died(preempted)
    if preempted:
        pool._handle(ref, (a, task), queue, on_result=lambda result: None)
        assert pool._failures == {} and a.state == "starting"  # uncharged; a new actor takes its place
    else:
        with pytest.raises(RuntimeError, match="shard 0 failed 1 time"):
            pool._handle(ref, (a, task), queue, on_result=lambda result: None)


def test_a_shard_that_hangs_its_actor_is_charged_and_given_up_after_shard_attempts(monkeypatch):
    pool, ray, clock, queue = make_pool(monkeypatch, ["a"], shard_attempts=2, stall_timeout_s=5.0,
                                        heartbeat_s=0.5, heartbeat_timeout_s=600.0, max_restarts=10)
    slot = pool._slots[0]
    pool._dispatch(queue, None)
    assert in_flight(slot)[0] == 0
    for hang in range(2):
        pool._heartbeat(queue)
        (ping, _), *_ = slot.actor.sent("ping")[-1:]
        ray.answers[ping] = {"progress": 7, "pid": 100 + hang}  # answers, and its progress never moves
        pool._heartbeat(queue)
        clock.sleep(6.0)
        if hang == 0:
            pool._heartbeat(queue)  # restarted; shard 0 charged once and back at the queue's front
            assert pool._failures == {0: 1} and slot.state == "suspect" and not slot.in_flight
            slot.state, slot.killed_pid, slot.progress, slot.progress_at = "ok", None, -1, clock.now
            pool._dispatch(queue, None)
            assert in_flight(slot)[0] == 0
        else:
            with pytest.raises(RuntimeError, match="shard 0 failed 2 time.*it hung its actor: no progress"):
                pool._heartbeat(queue)
