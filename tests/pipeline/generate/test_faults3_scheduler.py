"""Restart accounting (issue #52, item 3), on the scheduler's fake Ray (`test_scheduler.py`): the faults are
the answers Ray gives (an `ActorDiedError` whose node was preempted) and an actor whose progress stands still.

- A preempted actor's death charges no shard (before: its first shard was charged, so a spot reclaim cost
  attempts of healthy shards); an ordinary death still charges (the control).
- A shard that hangs its actor is charged one attempt per hang, and given up after `ray.shard_attempts`
  (before: every hang restarted an actor uncharged, until the restart budget of every actor was spent).
- A sick actor on a GPU (its device fails every row, or a shard it failed succeeds elsewhere) is set aside,
  alive and holding its GPU, and a new actor takes its slot (before: Ray restarted it in place, on the same
  GPU); the control restarts it in place. On the real local Ray: `test_sick_gpu_ray.py`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_scheduler import actor_fault, in_flight, make_pool


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


@pytest.mark.parametrize("fence", [True, False])  # False: the control (CPU actors), restarted in place
@pytest.mark.parametrize("why", ["fault", "quarantine"])
def test_a_sick_actor_on_a_gpu_is_set_aside_holding_its_device(monkeypatch, fence, why):
    pool, ray, clock, queue = make_pool(monkeypatch, ["a", "b"], shard_attempts=2, max_restarts=2)
    pool._fence_sick = fence
    a, b = pool._slots
    sick = a.actor
    pool._dispatch(queue, None)
    ref, task = a.in_flight[0]
    if why == "fault":
        ray.answers[ref] = actor_fault("every row of a failed batch (2) fails alone, and so does a one-token probe")
        pool._handle(ref, (a, task), queue, on_result=lambda result: None)
    else:  # shard 0 fails on a (charged), then succeeds on b: a is sick
        from ray.exceptions import RayTaskError

        ray.answers[ref] = RayTaskError("generate_shard", "Traceback ...", RuntimeError("boom")).as_instanceof_cause()
        pool._handle(ref, (a, task), queue, on_result=lambda result: None)
        assert pool._failures == {0: 1} and ray.killed == [] and a.failed == {0}
        done, done_task = b.in_flight[0]  # b finishes a shard of its own, then takes shard 0 and commits it
        ray.answers[done] = SimpleNamespace(index=done_task.index)
        pool._handle(done, (b, done_task), queue, on_result=lambda result: None)
        pool._dispatch(queue, None)
        again = next((r, t) for r, t in b.in_flight if t.index == 0)
        ray.answers[again[0]] = SimpleNamespace(index=0)
        pool._handle(again[0], (b, again[1]), queue, on_result=lambda result: None)
    if fence:  # kept alive (never killed: it holds its GPU), a new actor starting in its slot, a life spent
        assert ray.killed == [] and pool._fenced == (sick,) and sick not in pool.actors
        assert a.actor is not sick and a.state == "starting" and a.lives == 1 and not a.in_flight
        pool.shutdown()
        assert ("a", True) in ray.killed  # set aside for the run only
    else:
        assert ray.killed == [("a", False)] and a.actor is sick and a.state == "suspect" and pool._fenced == ()
