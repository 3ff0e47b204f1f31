"""Handing shards to the job's Ray actors: the actor pool, the shard queue, and the watch on each actor.

Each `ShardGenerator` actor asks for `ray.cpus_per_actor` CPUs (and a GPU when the cluster has GPUs) and
keeps `ray.shards_per_actor` shards queued. The actor is threaded (`max_concurrency =
ray.shards_per_actor`): its queued shards run at once, their rows in the actor's one continuous batch, so
the next shard's prompts take the slots the current one's rows leave before it ends.
The driver re-queues a shard, on whichever live actor is free first, when:

- its task fails because of the shard (the worker could not read or write): up to `ray.shard_attempts`;
- its actor died (`ActorDiedError`), or is "temporarily unavailable" (`ActorUnavailableError`, e.g. its
  node stopped answering): every shard queued on that actor goes back, and the actor gets no more until it
  answers a ping again (a restarted actor does, once it has reloaded the pair);
- its actor stops answering: a busy actor is pinged every `ray.heartbeat_s` (in a concurrency group of
  its own, so it answers mid-shard); one that has not answered for `ray.heartbeat_timeout_s` is given up
  (killed, its shards re-queued), as is a shard that runs past `ray.shard_timeout_s`.

The job goes on with the actors it has; with none left it fails. Every wait has a timeout, so a job never
hangs. Ray restarts an actor that dies (`ray.max_restarts`); it does not re-run tasks itself
(`ray.max_task_retries=0`): the driver does, on any actor.

Not here: committing results (`pipeline.generate.job`), sizing the pool (`pipeline.generate.cluster`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline import fs
from pipeline.generate.config import GenerateConfig
from pipeline.generate.progress import PROGRESS_POLL_S, BatchReporter, ShardProgress, rows_in_flight
from pipeline.generate.shards import ShardTask
from pipeline.generate.worker import ShardGenerator, ShardResult, WorkerJob

log = logging.getLogger("pipeline")

HEALTH_GROUP = "health"


@dataclass
class RunHooks:
    """Observation points for tests and tools; the job itself needs none of them."""

    on_actors_ready: Callable[[list[Any], list[dict[str, Any]]], None] | None = None
    on_dispatch: Callable[[Any, ShardTask], None] | None = None
    on_shard_written: Callable[[ShardResult], None] | None = None
    on_progress: Callable[[int], None] | None = None  # prompts done, shards in flight included (polled)


class NamedReporter:
    """The actors' on_batch callback: `BatchReporter` on the progress actor, found by name when first used."""

    def __init__(self, name: str):
        self.name = name
        self._reporter: BatchReporter | None = None

    def __call__(self, shard_index: int, rows: int) -> None:
        if self._reporter is None:
            import ray

            self._reporter = BatchReporter(ray.get_actor(self.name))
        self._reporter(shard_index, rows)


class ShardQueue:
    """Shards still to hand out: the plan's to-do indices in order, re-queued shards first."""

    def __init__(self, indices: np.ndarray, make: Callable[[int], ShardTask]):
        self._indices = indices
        self._next = 0
        self._again: deque[ShardTask] = deque()
        self._make = make

    def __len__(self) -> int:
        return len(self._indices) - self._next + len(self._again)

    def pop(self) -> ShardTask:
        if self._again:
            return self._again.popleft()
        index = int(self._indices[self._next])
        self._next += 1
        return self._make(index)

    def push_front(self, task: ShardTask) -> None:
        self._again.appendleft(task)


@dataclass
class _Slot:
    """One actor as the driver watches it."""

    actor: Any
    in_flight: deque = field(default_factory=deque)  # (ref, ShardTask) in dispatch order
    state: str = "ok"  # ok | suspect (unavailable: no new shards until it answers) | dead
    last_answer: float = 0.0  # last result or ping reply (or when it got work while idle)
    head_since: float = 0.0  # when the shard at the head of its queue started (about)
    suspect_since: float = 0.0
    ping: Any = None
    ping_sent: float = 0.0


class ShardActorPool:
    """The job's actors and the shard queue; see the module docstring."""

    def __init__(
        self, config: GenerateConfig, count: int, cpus_each: float, gpus_each: float, job: WorkerJob
    ):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._ray = ray
        self.config = config
        options: dict[str, Any] = dict(
            num_cpus=cpus_each,
            num_gpus=gpus_each,
            max_restarts=config.ray.max_restarts,
            max_task_retries=config.ray.max_task_retries,
            # a threaded actor: each queued shard runs on its own thread, its rows in the actor's one
            # continuous batch (pipeline.generate.feed), so the next shard fills the slots the last one leaves
            max_concurrency=config.ray.shards_per_actor,
        )
        if fs.forwarded_env():  # object-store credentials and endpoint, for actors on any node
            options["runtime_env"] = {"env_vars": fs.forwarded_env()}
        # pings run in a concurrency group of their own, so that a busy actor answers them mid-shard
        remote_class = ray.remote(concurrency_groups={HEALTH_GROUP: 1})(ShardGenerator).options(**options)
        threads = max(1, int(cpus_each))
        device = "cuda" if gpus_each > 0 else "cpu"  # a CPU actor stays on CPU even on a GPU node
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        name = f"spectr-progress-{uuid.uuid4().hex[:12]}"
        self.progress = ray.remote(ShardProgress).options(num_cpus=0, scheduling_strategy=here, name=name).remote()
        reporter = NamedReporter(name)  # by name: an actor handle in the constructor arguments pins them
        # one copy in the object store for every actor; each shard task carries a reference to it (nested in
        # a list, so that Ray passes the reference), which the actor fetches once
        self._job_ref = ray.put(job)
        self.actors = [
            remote_class.remote(config.model, config.spectr, threads, device, reporter) for _ in range(count)
        ]
        self._slots: list[_Slot] = []
        self._failures: dict[int, int] = {}

    def wait_ready(self) -> list[dict[str, Any]]:
        """Wait (at most ray.actor_start_timeout_s) for the actors to load the pair; go on with those that
        did. Raises when none did, or when one failed to load."""
        from ray.exceptions import RayActorError, RayTaskError

        refs = [actor.ready.remote() for actor in self.actors]
        timeout = self.config.ray.actor_start_timeout_s
        ready, pending = self._ray.wait(refs, num_returns=len(refs), timeout=timeout)
        try:
            workers = {ref: self._ray.get(ref) for ref in ready}
        except (RayActorError, RayTaskError) as err:
            raise RuntimeError(f"an actor failed to load the model pair: {err}") from err
        if not workers:
            raise RuntimeError(
                f"no actor started within ray.actor_start_timeout_s={timeout:g} s (does the cluster have the "
                "resources each actor asks for?)"
            )
        started = [(actor, workers[ref]) for actor, ref in zip(self.actors, refs) if ref in workers]
        for actor, ref in zip(self.actors, refs):
            if ref not in workers:
                log.warning("an actor did not start within %g s; going on without it", timeout)
                self._ray.kill(actor, no_restart=True)
        self.actors = [actor for actor, _ in started]
        self._slots = [_Slot(actor, last_answer=time.monotonic()) for actor in self.actors]
        return [worker for _, worker in started]

    def run(
        self,
        queue: ShardQueue,
        on_result: Callable[[ShardResult], None],
        hooks: RunHooks | None = None,
        on_partial: Callable[[int], None] | None = None,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Generate every queued shard once (as far as the output is concerned), calling `on_result` per
        shard, `on_partial(rows generated so far in the shards in flight)` every PROGRESS_POLL_S, and
        `check()` (which may raise to stop the job) between waits."""
        last_poll = time.monotonic()
        while len(queue) or any(slot.in_flight for slot in self._slots):
            if check is not None:
                check()
            self._dispatch(queue, hooks)
            self._heartbeat(queue)
            if all(slot.state == "dead" for slot in self._slots):
                raise RuntimeError(f"no live actors left; {len(queue)} shard(s) not generated")
            waiting = self._waiting_refs()
            if not waiting:  # only unavailable actors, between two pings
                time.sleep(self._poll_s())
                continue
            ready, _ = self._ray.wait(list(waiting), num_returns=1, timeout=self._poll_s())
            for ref in ready:
                self._handle(ref, waiting[ref], queue, on_result)
            if on_partial is not None and time.monotonic() - last_poll >= PROGRESS_POLL_S:
                last_poll = time.monotonic()
                self._report_partial(on_partial)

    def _poll_s(self) -> float:
        return min(PROGRESS_POLL_S, self.config.ray.heartbeat_s)

    def _dispatch(self, queue: ShardQueue, hooks: RunHooks | None) -> None:
        """Fill every healthy actor's queue to `ray.shards_per_actor`, one shard per actor per round."""
        for depth in range(1, self.config.ray.shards_per_actor + 1):
            for slot in self._slots:
                if not len(queue):
                    return
                if slot.state != "ok" or len(slot.in_flight) >= depth:
                    continue
                task = queue.pop()
                if not slot.in_flight:
                    slot.head_since = slot.last_answer = time.monotonic()
                slot.in_flight.append((slot.actor.generate_shard.remote(task, [self._job_ref]), task))
                if hooks and hooks.on_dispatch:
                    hooks.on_dispatch(slot.actor, task)

    def _waiting_refs(self) -> dict[Any, tuple[_Slot, ShardTask | None]]:
        """Every shard task and ping in flight -> (its actor's slot, its shard or None for a ping)."""
        waiting: dict[Any, tuple[_Slot, ShardTask | None]] = {}
        for slot in self._slots:
            for ref, task in slot.in_flight:
                waiting[ref] = (slot, task)
            if slot.ping is not None:
                waiting[slot.ping] = (slot, None)
        return waiting

    def _handle(self, ref: Any, owner: tuple[_Slot, ShardTask | None], queue: ShardQueue, on_result) -> None:
        from ray.exceptions import ActorDiedError, RayError, RayTaskError

        slot, task = owner
        if task is None:
            self._ping_answered(slot, ref)
            return
        slot.in_flight = deque(item for item in slot.in_flight if item[0] != ref)
        self.progress.forget.remote(task.index)
        try:
            result = self._ray.get(ref)
        except RayTaskError as err:  # the shard's own failure (reading, writing): the actor is fine
            self._retry(queue, task, err)
            return
        except ActorDiedError as err:
            self._retry(queue, task, err)
            self._give_up(slot, queue, "it died")
            return
        except RayError as err:  # ActorUnavailableError and the like: the actor may come back
            self._retry(queue, task, err)
            self._suspect(slot, queue, type(err).__name__)
            return
        slot.last_answer = slot.head_since = time.monotonic()
        on_result(result)

    def _retry(self, queue: ShardQueue, task: ShardTask, err: BaseException) -> None:
        failures = self._failures.get(task.index, 0) + 1
        self._failures[task.index] = failures
        if failures >= self.config.ray.shard_attempts:
            raise RuntimeError(f"shard {task.index} failed {failures} time(s); last error: {err}") from err
        log.warning("shard %d: %s; handing it to another actor", task.index, type(err).__name__)
        queue.push_front(task)

    def _requeue_all(self, slot: _Slot, queue: ShardQueue) -> None:
        for _, task in reversed(slot.in_flight):
            self.progress.forget.remote(task.index)
            queue.push_front(task)
        slot.in_flight.clear()

    def _suspect(self, slot: _Slot, queue: ShardQueue, why: str) -> None:
        if slot.state == "ok":
            log.warning("an actor is unavailable (%s); its shards go to the others until it answers", why)
            slot.state, slot.suspect_since = "suspect", time.monotonic()
        self._requeue_all(slot, queue)

    def _give_up(self, slot: _Slot, queue: ShardQueue, why: str) -> None:
        if slot.state != "dead":
            log.warning("giving up an actor (%s); %d shard(s) re-queued", why, len(slot.in_flight))
        self._requeue_all(slot, queue)
        slot.state, slot.ping = "dead", None
        try:
            self._ray.kill(slot.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - it may be gone already; either way we no longer use it
            pass

    def _ping_answered(self, slot: _Slot, ref: Any) -> None:
        from ray.exceptions import ActorDiedError, RayError

        slot.ping = None
        try:
            self._ray.get(ref)
        except ActorDiedError:
            slot.state = "dead"
            return
        except RayError:
            return  # unavailable: asked again at the next heartbeat
        slot.last_answer = time.monotonic()
        if slot.state == "suspect":
            log.warning("an unavailable actor answers again; it gets shards again")
            slot.state = "ok"

    def _heartbeat(self, queue: ShardQueue) -> None:
        now = time.monotonic()
        r = self.config.ray
        for slot in self._slots:
            if slot.state == "dead" or (slot.state == "ok" and not slot.in_flight):
                continue
            if slot.ping is None and now - slot.ping_sent >= r.heartbeat_s:
                slot.ping = slot.actor.ping.options(concurrency_group=HEALTH_GROUP).remote()
                slot.ping_sent = now
            if slot.state == "ok" and now - slot.last_answer > r.heartbeat_timeout_s:
                self._give_up(slot, queue, f"no answer for {now - slot.last_answer:.0f} s")
            elif slot.state == "suspect" and now - slot.suspect_since > r.actor_start_timeout_s:
                self._give_up(slot, queue, f"unavailable for {now - slot.suspect_since:.0f} s")
            elif (
                r.shard_timeout_s is not None and slot.in_flight and now - slot.head_since > r.shard_timeout_s
            ):
                self._give_up(slot, queue, f"shard {slot.in_flight[0][1].index} ran past ray.shard_timeout_s")

    def _report_partial(self, on_partial: Callable[[int], None]) -> None:
        from ray.exceptions import GetTimeoutError, RayError

        shards = [task for slot in self._slots for _, task in slot.in_flight]
        try:
            snapshot = self._ray.get(self.progress.snapshot.remote(), timeout=PROGRESS_POLL_S)
        except (GetTimeoutError, RayError):  # progress is best effort; generation goes on
            return
        on_partial(rows_in_flight(snapshot, shards))
