"""The driver's watch on its actors (`pipeline.generate.scheduler.ShardActorPool`), without Ray: a fake Ray
whose refs the test answers, and a clock the test moves. Decisions only (which actor is restarted, which shard
goes where, what is charged); the jobs that inject the same faults on a real Ray are in tests/jobs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from pipeline.generate import scheduler
from pipeline.generate.config import RayConfig
from pipeline.generate.scheduler import ShardActorPool, ShardQueue, _Slot
from pipeline.generate.shards import ShardTask


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Ref:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Ref({self.name})"


class Method:
    """`actor.<name>.options(...).remote(...)`: a new ref, recorded on the actor."""

    def __init__(self, actor: FakeActor, name: str) -> None:
        self.actor, self.name = actor, name

    def options(self, **_: object) -> Method:
        return self

    def remote(self, *args: object) -> Ref:
        ref = Ref(f"{self.actor.name}.{self.name}")
        self.actor.calls.append((self.name, ref, args))
        return ref


class FakeActor:
    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[tuple[str, Ref, tuple]] = []
        for method in ("ping", "generate_shard", "ready", "forget"):
            setattr(self, method, Method(self, method))

    def sent(self, method: str) -> list[tuple[Ref, tuple]]:
        return [(ref, args) for name, ref, args in self.calls if name == method]


class FakeRay:
    """What the pool calls on Ray; `answers[ref]` is what a ready ref returns (or raises)."""

    def __init__(self) -> None:
        self.answers: dict[Ref, object] = {}
        self.killed: list[tuple[str, bool]] = []

    def wait(self, refs, num_returns=1, timeout=None):
        ready = [ref for ref in refs if ref in self.answers][:num_returns]
        return ready, [ref for ref in refs if ref not in ready]

    def get(self, ref, timeout=None):
        answer = self.answers[ref]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def kill(self, actor, no_restart=True):
        self.killed.append((actor.name, no_restart))


def make_pool(monkeypatch, names: list[str], **ray_keys) -> tuple[ShardActorPool, FakeRay, Clock, ShardQueue]:
    """A pool of `names` actors, every one up and idle, with a queue of 8 shards (0..7)."""
    clock = Clock()
    monkeypatch.setattr(scheduler, "time", clock)
    pool = ShardActorPool.__new__(ShardActorPool)
    ray = FakeRay()
    pool._ray, pool.config = ray, SimpleNamespace(ray=RayConfig(**ray_keys))
    pool.actors = [FakeActor(name) for name in names]
    pool._slots = [_Slot(actor, last_answer=clock.now, progress_at=clock.now) for actor in pool.actors]
    pool._failures, pool._hooks, pool._working_at, pool._fenced = {}, None, clock.now, ()
    pool.progress = FakeActor("progress")
    pool._remote_class, pool._actor_args = SimpleNamespace(remote=lambda *a: FakeActor("new")), ()
    pool._job_ref = None
    queue = ShardQueue(np.arange(8), lambda i: ShardTask(i, i * 4, i * 4 + 4))
    queue.deal(len(names))
    pool._queue = queue
    return pool, ray, clock, queue


def test_a_busy_driver_never_takes_a_healthy_actor_for_a_silent_one(monkeypatch):
    """The driver is busy for 10 s, far past `ray.heartbeat_timeout_s` (2 s), e.g. on a commit to a slow store;
    the actor answered its ping meanwhile: it is not restarted. An actor that really stops answering is."""
    pool, ray, clock, queue = make_pool(monkeypatch, ["a"], heartbeat_s=0.5, heartbeat_timeout_s=2.0)
    slot = pool._slots[0]
    pool._dispatch(queue, None)
    pool._heartbeat(queue)  # pings the busy actor
    (ping, _), = slot.actor.sent("ping")
    ray.answers[ping] = {"progress": 1, "pid": 1}  # answered at once
    clock.sleep(10.0)  # the driver was away (one slow commit)
    pool._heartbeat(queue)
    assert ray.killed == [] and slot.state == "ok"
    clock.sleep(0.1)
    pool._heartbeat(queue)  # asks again, and this ping is never answered
    clock.sleep(2.5)
    pool._heartbeat(queue)
    assert ray.killed == [("a", False)] and slot.state == "suspect"  # the control: silence is still seen


def test_a_busy_driver_that_did_not_ask_never_counts_as_silence(monkeypatch):
    """No ping was out while the driver was away: the time it did not ask is not the actor's silence."""
    pool, ray, clock, queue = make_pool(monkeypatch, ["a"], heartbeat_s=5.0, heartbeat_timeout_s=5.0)
    slot = pool._slots[0]
    pool._dispatch(queue, None)
    pool._heartbeat(queue)
    (ping, _), = slot.actor.sent("ping")
    ray.answers[ping] = {"progress": 1, "pid": 1}
    pool._heartbeat(queue)  # read: no ping out now
    clock.sleep(30.0)
    pool._heartbeat(queue)
    assert ray.killed == [] and slot.state == "ok"


def actor_fault(message: str) -> BaseException:
    """What `ray.get` raises for a task that raised `ActorFault` on the actor (Ray's dual exception class)."""
    from ray.exceptions import RayTaskError

    from pipeline.generate.feed import ActorFault

    return RayTaskError("generate_shard", "Traceback ...", ActorFault(message)).as_instanceof_cause()


def in_flight(slot) -> list[int]:
    return [task.index for _, task in slot.in_flight]


def test_a_sick_device_charges_no_shard_and_its_actor_is_restarted_at_once(monkeypatch):
    """Actor a's device fails every row and the probe (`ActorFault`): with `ray.shard_attempts=1` any charge
    would end the job; instead its shards go back uncharged, a is restarted (no shard for it until its new
    process answers), and b takes them."""
    pool, ray, clock, queue = make_pool(monkeypatch, ["a", "b"], shard_attempts=1)
    a, b = pool._slots
    pool._dispatch(queue, None)
    assert in_flight(a) == [0, 1] and in_flight(b) == [4, 5]
    ref, task = a.in_flight[0]
    ray.answers[ref] = actor_fault("every row of a failed batch (2) fails alone, and so does a one-token probe")
    pool._handle(ref, (a, task), queue, on_result=lambda result: None)
    assert pool._failures == {} and ray.killed == [("a", False)] and a.state == "suspect" and not a.in_flight
    done_ref, done_task = b.in_flight[0]
    ray.answers[done_ref] = SimpleNamespace(index=4)
    pool._handle(done_ref, (b, done_task), queue, on_result=lambda result: None)
    pool._dispatch(queue, None)
    assert in_flight(a) == [] and in_flight(b) == [5, 1]  # the re-queued shards go to b, not to the sick a


def test_a_requeued_shard_goes_to_no_actor_that_failed_it_or_is_quarantined(monkeypatch):
    """Shard 0 failed on a and shard 4 on b (charged): while c has failed nothing, neither a nor b gets a
    re-queued shard (sick actors fail fast and would grab them first); a shard never goes back to the actor
    that failed it while another can take it."""
    pool, ray, clock, queue = make_pool(monkeypatch, ["a", "b", "c"])
    a, b, c = pool._slots
    a.failed, b.failed = {0}, {4}
    for index in (0, 4):
        queue.push_front(ShardTask(index, index * 4, index * 4 + 4, attempt=1))
    assert pool._elsewhere(a, 0) and pool._elsewhere(a, 4) and pool._elsewhere(b, 0) and pool._elsewhere(b, 4)
    assert not pool._elsewhere(c, 0) and not pool._elsewhere(c, 4)
    pool._dispatch(queue, None)
    retried = [(task.index, task.attempt) for _, task in c.in_flight if task.attempt]
    assert sorted(retried) == [(0, 1), (4, 1)]  # both re-queued shards on c
    assert all(task.attempt == 0 for slot in (a, b) for _, task in slot.in_flight)  # a and b: fresh shards only
    c.state = "suspect"  # with no clean actor left, a quarantined one that has not failed it may take it
    assert pool._elsewhere(a, 0) and not pool._elsewhere(b, 0)


def answer_ping(pool, slot, pid: int) -> None:
    slot.ping = Ref("ping")
    pool._ray.answers[slot.ping] = {"progress": 0, "pid": pid}
    pool._ping_answered(slot, slot.ping)


def test_the_restart_budget_is_per_window_of_time(monkeypatch):
    """`ray.max_restarts=1` per `ray.restart_window_s=60`: a second restart within the minute gives the actor
    up; one after it restarts it again (a long job on spot nodes keeps its budget)."""
    pool, ray, clock, queue = make_pool(monkeypatch, ["a", "b"], max_restarts=1, restart_window_s=60.0)
    a, b = pool._slots
    a.pid, b.pid = 100, 200
    pool._restart(a, queue, "sick")
    answer_ping(pool, a, pid=100)  # the old process, before the kill reached it: not the restarted actor
    assert a.state == "suspect"
    answer_ping(pool, a, pid=101)  # its new process
    assert a.state == "ok"
    clock.sleep(61.0)
    pool._restart(a, queue, "sick again, after the window")
    assert ray.killed == [("a", False), ("a", False)] and a.state == "suspect"
    pool._restart(b, queue, "sick")
    answer_ping(pool, b, pid=201)
    clock.sleep(10.0)
    pool._restart(b, queue, "sick again, within the window")
    assert ray.killed[-1] == ("b", True) and b.state == "dead"  # given up: no restarts left in this window


def test_a_restart_ray_refuses_is_delivered_by_a_replacement_without_a_second_life(monkeypatch):
    """Ray restarts an actor at most its own `max_restarts` times per actor, for good: a restart the driver paid
    for in this window that Ray refuses (the actor dies instead) brings a new actor, not the end of the slot."""
    from ray.exceptions import ActorDiedError

    pool, ray, clock, queue = make_pool(monkeypatch, ["a"], max_restarts=1, restart_window_s=60.0)
    a = pool._slots[0]
    pool._restart(a, queue, "sick")
    a.ping = Ref("ping")
    ray.answers[a.ping] = ActorDiedError()
    pool._ping_answered(a, a.ping)
    assert a.state == "starting" and a.actor.name == "new" and a.lives == 1  # replaced, one life spent


def test_a_compiling_actor_is_not_stalled_until_the_compile_limit(monkeypatch):
    """The actor's progress stays put for 60 s (`ray.stall_timeout_s` 5 s) while its pings say a compile runs
    (`compiling_s`, #40 finding 8): not restarted. The same silence of its progress without a compile is, and
    so is a compile past `COMPILE_LIMIT_S` (the control: a hung compile is still a hang)."""
    for compiling, restarted in ((lambda t: t, False), (lambda t: None, True),
                                 (lambda t: scheduler.COMPILE_LIMIT_S + t, True)):
        pool, ray, clock, queue = make_pool(monkeypatch, ["a"], heartbeat_s=1.0, heartbeat_timeout_s=30.0,
                                            stall_timeout_s=5.0)
        slot = pool._slots[0]
        pool._dispatch(queue, None)
        for second in range(60):
            pool._heartbeat(queue)
            if slot.ping is not None and slot.state == "ok":
                ray.answers[slot.ping] = {"progress": 7, "pid": 1, "compiling_s": compiling(float(second))}
            clock.sleep(1.0)
        pool._heartbeat(queue)
        assert bool(ray.killed) is restarted, (compiling(1.0), ray.killed)
