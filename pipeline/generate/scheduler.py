"""Handing shards to the job's Ray actors: the actor pool, the shard queue, and the watch on each actor.

Each `ShardGenerator` actor asks for `ray.cpus_per_actor` CPUs (and a GPU when the cluster has GPUs) and
keeps `ray.shards_per_actor` shards queued. The actor is threaded (`max_concurrency =
ray.shards_per_actor`): its queued shards run at once, their rows in the actor's one continuous batch, so
the next shard's prompts take the slots the current one's rows leave before it ends.

The job starts as soon as one actor has loaded the pair (the others get as long again, at least
`ACTOR_GRACE_S`, then join when they are up); one that fails to load is replaced. A shard goes back to the
queue, as its next attempt (a new part name: `ShardTask.fence`), when:

- its task fails because of the shard (reading, writing, generating): charged to that shard, up to
  `ray.shard_attempts`; it goes to an actor it has not failed on first, and no re-queued shard goes to an
  actor with a failure not yet cleared (quarantine: sick actors fail fast and would grab them first) while
  another can take it; an actor whose failed shard then succeeds elsewhere is restarted (a sticky device
  error goes with its process). The other shards that were in that actor's batch (`FeedAborted`) go back
  uncharged;
- its actor's device fails whatever it runs (`ActorFault`: every row of a failed batch fails alone too,
  and so does a one-token probe): the shard goes back uncharged, and the actor is restarted at once (three
  sick actors cannot fail one healthy shard three times);
- a sick actor on a GPU (an `ActorFault`, or a failed shard that then succeeded elsewhere) is not restarted in
  place: it is set aside for the rest of the run, alive and idle, so that it keeps holding its GPU and Ray
  places no actor of the job on that GPU again, and a new actor takes its slot wherever the cluster has a
  free GPU (a life of `ray.max_restarts`; with none free, the job goes on with the others). Ray cannot be
  asked to avoid one GPU of a node, but it never gives a held GPU to another actor. Killed at the end;
- its actor hangs (below): the actor is restarted and the shard at the head of its queue is charged one
  attempt (a shard that hangs every actor it meets is given up after `ray.shard_attempts`), the rest go back;
- its actor died (`ActorDiedError`: the first shard is charged, unless Ray says the actor was preempted:
  a spot node reclaimed, a node drained; the rest go back), or is "temporarily
  unavailable" (`ActorUnavailableError`: Ray is restarting it, or its node stopped answering): every shard
  queued on it goes back, and it gets no more until it answers a ping again;
- its actor stops answering: a busy actor is pinged every `ray.heartbeat_s` (in a concurrency group of
  its own, so it answers mid-shard); one that has not answered for `ray.heartbeat_timeout_s` since it was
  asked is restarted (answers that came while the driver was busy are read first, and the time the driver
  did not ask never counts: a slow driver never looks like a silent actor);
- its actor makes no progress: a ping proves the process is alive, its answer's `progress` (engine
  iterations, shards read and written, blocks of a long read such as skipping ahead in a compressed stream,
  compiles ended: `pipeline.busy`) that it works; a busy actor whose progress stays put for
  `ray.stall_timeout_s` (a hung kernel, a deadlock) is restarted, as is one whose head shard runs past
  `ray.shard_timeout_s`. A compile running now (the ping's `compiling_s`: the first `torch.compile` of a
  model on a GPU can take minutes) is work, not a stall, up to `COMPILE_LIMIT_S`.

Restarting is Ray's (`ray.kill` without `no_restart`: a new process reloads the pair), up to
`ray.max_restarts` per actor in any `ray.restart_window_s` (older restarts no longer count, so a long job on
spot nodes keeps its budget); an actor dead for good is replaced by a new one while that budget lasts,
which starts when the cluster has room for it again (a returning node): while other actors work, an actor
waits for room as long as it takes. The job goes on with the actors it has; with none left (none alive,
starting or restarting) it fails, and with none working it waits at most `ray.actor_start_timeout_s` for
one. Every wait has a timeout. Ray does
not re-run tasks itself (`ray.max_task_retries=0`): the driver does, on any actor.

A sweep cell may run on an earlier cell's actors (`KeptActors`, when that cell ended clean; see
`pipeline.generate.keep`): `wait_ready` sends them the cell's engine settings (`ShardGenerator.reconfigure`)
instead of waiting for a load; everything the watch above counts starts from nothing.

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
from pipeline.generate.feed import ActorFault, FeedAborted
from pipeline.generate.lease import LeaseUnknownError
from pipeline.generate.progress import PROGRESS_POLL_S, BatchReporter, ShardProgress, rows_in_flight
from pipeline.generate.shards import ShardTask
from pipeline.generate.worker import ShardGenerator, ShardResult, WorkerJob

log = logging.getLogger("pipeline")

HEALTH_GROUP = "health"
ACTOR_GRACE_S = 10.0  # at least this long for the other actors to load once one has
COMPILE_LIMIT_S = 3600.0  # a compile (the ping's compiling_s) is progress until it has run this long: then a hang


@dataclass
class RunHooks:
    """Observation points for tests and tools; the job itself needs none of them."""

    on_actors_ready: Callable[[list[Any], list[dict[str, Any]]], None] | None = None
    on_dispatch: Callable[[Any, ShardTask], None] | None = None
    on_shard_written: Callable[[ShardResult], None] | None = None
    on_progress: Callable[[int], None] | None = None  # prompts done, shards in flight included (polled)
    on_actor_joined: Callable[[Any, dict[str, Any]], None] | None = None  # a late or restarted actor is up
    # test-only: set a sick actor aside (holding its resources) on CPU actors too, as on GPUs (None: on GPUs only)
    fence_sick: bool | None = None


@dataclass
class KeptActors:
    """A pool's actors, handed to the next sweep cell that has the same pair and actor resources
    (`pipeline.generate.keep`): they keep the pair loaded and take the cell's engine settings."""

    actors: list[Any]
    progress: Any  # the ShardProgress actor the actors report to (by name)
    progress_name: str


def _last_line(err: BaseException) -> str:
    """An error's last line (a remote error's message after its traceback), at most 300 characters."""
    lines = str(err).strip().splitlines()
    return lines[-1][:300] if lines else type(err).__name__


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
    """Shards still to hand out: re-queued shards first, then the plan's to-do indices, dealt in contiguous
    lanes (`deal`): each actor takes its lane's shards in row order, so it reads a contiguous part of the
    input (its row groups once, not every actor every row group); an actor whose lane is empty takes the
    second half of the fullest lane."""

    def __init__(self, indices: np.ndarray, make: Callable[[int], ShardTask]):
        self._indices = indices
        self._lanes: list[list[int]] = [[0, len(indices)]]  # [next, stop) positions in `indices`, per lane
        self._again: deque[ShardTask] = deque()
        self._make = make

    def __len__(self) -> int:
        return sum(stop - start for start, stop in self._lanes) + len(self._again)

    def deal(self, lanes: int) -> None:
        """Cut the shards not handed out yet into `lanes` contiguous lanes of about equal length."""
        start, stop = min(lane[0] for lane in self._lanes), max(lane[1] for lane in self._lanes)
        if sum(b - a for a, b in self._lanes) != stop - start:
            raise RuntimeError("ShardQueue.deal: call it before any lane was split")
        bounds = np.linspace(start, stop, max(1, lanes) + 1).round().astype(np.int64)
        self._lanes = [[int(a), int(b)] for a, b in zip(bounds[:-1], bounds[1:])]

    def pop(self, skip: Callable[[int], bool] | None = None, lane: int = 0) -> ShardTask | None:
        """The first re-queued shard `skip` does not refuse, else the next shard of `lane` (None: nothing for
        this caller; new shards are never refused)."""
        for position, task in enumerate(self._again):
            if skip is None or not skip(task.index):
                del self._again[position]
                return task
        mine = self._lanes[lane % len(self._lanes)]
        if mine[0] >= mine[1]:
            fullest = max(self._lanes, key=lambda other: other[1] - other[0])
            if fullest[0] >= fullest[1]:
                return None
            middle = (fullest[0] + fullest[1]) // 2  # the fullest lane's second half becomes this lane
            mine[0], mine[1], fullest[1] = middle, fullest[1], middle
        index = int(self._indices[mine[0]])
        mine[0] += 1
        return self._make(index)

    def push_front(self, task: ShardTask) -> None:
        self._again.appendleft(task)


@dataclass
class _Slot:
    """One actor as the driver watches it."""

    actor: Any
    in_flight: deque = field(default_factory=deque)  # (ref, ShardTask) in dispatch order
    # starting (loading the pair) | ok | suspect (unavailable or restarting: no new shards until it answers)
    # | dead
    state: str = "ok"
    last_answer: float = 0.0  # last result or ping reply (or when it got work while idle)
    head_since: float = 0.0  # when the shard at the head of its queue started (about)
    suspect_since: float = 0.0
    ping: Any = None
    ping_sent: float = 0.0
    asked_since: float | None = None  # when the first ping not answered since its last answer was sent
    progress: int = -1  # the actor's progress counter at its last ping answer
    progress_at: float = 0.0  # when it last moved (or a result came, or the idle actor got work)
    compiling_s: float | None = None  # a compile running in the actor at its last ping answer: for how long
    failed: set[int] = field(default_factory=set)  # shards that failed on this actor's process
    lives: int = 0  # restarts the driver asked for + replacements
    restarts: deque = field(default_factory=deque)  # when each of them was (the budget counts a window's)
    pid: int | None = None  # the process that answered last
    killed_pid: int | None = None  # the process a restart replaces: its late answers do not count
    paid: bool = False  # a restart spent a life on the process to come (Ray's restart, or a replacement)
    ready: Any = None  # starting: the ref of its ready() call
    started: float = 0.0  # starting: since when


class ShardActorPool:
    """The job's actors and the shard queue; see the module docstring."""

    _fence_sick = False  # set sick actors aside instead of restarting them in place (actors on GPUs)
    _fenced: tuple[Any, ...] = ()  # the actors set aside (alive, idle), killed at shutdown

    def __init__(
        self, config: GenerateConfig, count: int, cpus_each: float, gpus_each: float, job: WorkerJob,
        kept: KeptActors | None = None, fence_sick: bool | None = None,
    ):
        """kept: an earlier sweep cell's actors (`count` of them, built with these resources), used instead of
        new ones; `wait_ready` sends them this job's engine settings. fence_sick: set a sick actor aside
        (holding its device) instead of restarting it in place; None: when the actors take GPUs."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._ray = ray
        self.config = config
        self._fence_sick = gpus_each > 0 if fence_sick is None else fence_sick
        options: dict[str, Any] = dict(
            num_cpus=cpus_each,
            num_gpus=gpus_each,
            max_restarts=config.ray.max_restarts,
            max_task_retries=config.ray.max_task_retries,
            # a threaded actor: each queued shard runs on its own thread, its rows in the actor's one
            # continuous batch (pipeline.generate.feed), so the next shard fills the slots the last one leaves
            max_concurrency=config.ray.shards_per_actor,
        )
        if fs.forwarded_env():  # object-store endpoint, region, credentials file path: no credentials
            options["runtime_env"] = {"env_vars": fs.forwarded_env()}
        # pings run in a concurrency group of their own, so that a busy actor answers them mid-shard
        self._remote_class = ray.remote(concurrency_groups={HEALTH_GROUP: 1})(ShardGenerator).options(**options)
        threads = max(1, int(cpus_each))
        device = "cuda" if gpus_each > 0 else "cpu"  # a CPU actor stays on CPU even on a GPU node
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        name = kept.progress_name if kept else f"spectr-progress-{uuid.uuid4().hex[:12]}"
        self.progress = kept.progress if kept else ray.remote(ShardProgress).options(
            num_cpus=0, scheduling_strategy=here, name=name).remote()
        self._progress_name = name
        reporter = NamedReporter(name)  # by name: an actor handle in the constructor arguments pins them
        self._actor_args = (config.model, config.spectr, threads, device, reporter)
        # one copy in the object store for every actor; each shard task carries a reference to it (nested in
        # a list, so that Ray passes the reference), which the actor fetches once
        self._job_ref = ray.put(job)
        self._kept = kept is not None
        self.actors = list(kept.actors) if kept else [self._remote_class.remote(*self._actor_args) for _ in range(count)]
        self._slots: list[_Slot] = []
        self._failures: dict[int, int] = {}
        self._hooks: RunHooks | None = None
        self._queue: ShardQueue | None = None
        self._working_at = 0.0  # when an actor last worked (ok): how long the job has waited for one

    def wait_ready(self) -> list[dict[str, Any]]:
        """Wait (at most ray.actor_start_timeout_s) for a first actor to load the pair, then as long again for
        the others; go on with those that did (the rest join when they are up). Raises when none did."""
        from ray.exceptions import RayError

        started = time.monotonic()
        spectr = self.config.spectr  # kept actors: this job's engine settings on the pair they hold
        refs = {(actor.reconfigure.remote(spectr) if self._kept else actor.ready.remote()): actor for actor in self.actors}
        self._slots = [_Slot(actor, state="starting", ready=ref, started=started) for ref, actor in refs.items()]
        deadline = started + self.config.ray.actor_start_timeout_s
        workers: dict[Any, dict[str, Any]] = {}
        errors: list[BaseException] = []
        pending = list(refs)
        while pending and time.monotonic() < deadline:
            done, pending = self._ray.wait(pending, num_returns=1, timeout=deadline - time.monotonic())
            for ref in done:
                try:
                    workers[ref] = self._ray.get(ref)
                except RayError as err:
                    errors.append(err)
                    log.warning("an actor failed to load the model pair (%s); going on without it", err)
            grace = max(ACTOR_GRACE_S, time.monotonic() - started)  # as long again for the others
            if workers and deadline > time.monotonic() + grace:
                deadline = time.monotonic() + grace
        if not workers:
            if errors:
                raise RuntimeError(f"an actor failed to load the model pair: {errors[0]}") from errors[0]
            raise RuntimeError(
                f"no actor started within ray.actor_start_timeout_s={self.config.ray.actor_start_timeout_s:g} s "
                "(does the cluster have the resources each actor asks for?)"
            )
        for slot in self._slots:
            if slot.ready in workers:
                slot.pid = workers[slot.ready].get("pid")
                slot.state, slot.ready, slot.last_answer = "ok", None, time.monotonic()
            elif slot.ready not in pending:  # failed to load
                self._dead(slot, "it failed to load the pair")
        self.actors = [slot.actor for slot in self._slots if slot.state == "ok"]
        if pending:
            log.warning("%d actor(s) not loaded yet; the job starts without them", len(pending))
        return [workers[ref] for ref in refs if ref in workers]

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
        self._hooks, self._queue = hooks, queue
        queue.deal(len(self._slots))  # one contiguous lane per actor (a late or new one takes its slot's)
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
        """Fill every healthy actor's queue to `ray.shards_per_actor`, one shard per actor per round; a
        re-queued shard goes to an actor it has not failed on while there is one."""
        for depth in range(1, self.config.ray.shards_per_actor + 1):
            for lane, slot in enumerate(self._slots):
                if not len(queue):
                    return
                if slot.state != "ok" or len(slot.in_flight) >= depth:
                    continue
                task = queue.pop(lambda index, slot=slot: self._elsewhere(slot, index), lane)
                if task is None:
                    continue
                if not slot.in_flight:
                    slot.head_since = slot.last_answer = slot.progress_at = time.monotonic()
                slot.in_flight.append((slot.actor.generate_shard.remote(task, [self._job_ref]), task))
                if hooks and hooks.on_dispatch:
                    hooks.on_dispatch(slot.actor, task)

    def _elsewhere(self, slot: _Slot, index: int) -> bool:
        """Quarantine: re-queued shard `index` failed on this actor and another working actor has not failed
        it; or this actor has a failure not yet cleared and another working actor has none."""
        others = [other for other in self._slots if other is not slot and other.state == "ok"]
        return (index in slot.failed and any(index not in other.failed for other in others)) or (
            bool(slot.failed) and any(not other.failed for other in others)
        )

    def _waiting_refs(self) -> dict[Any, tuple[_Slot, ShardTask | None]]:
        """Every shard task, ping and start in flight -> (its actor's slot, its shard or None)."""
        waiting: dict[Any, tuple[_Slot, ShardTask | None]] = {}
        for slot in self._slots:
            for ref, task in slot.in_flight:
                waiting[ref] = (slot, task)
            for ref in (slot.ping, slot.ready):
                if ref is not None:
                    waiting[ref] = (slot, None)
        return waiting

    def _handle(self, ref: Any, owner: tuple[_Slot, ShardTask | None], queue: ShardQueue, on_result) -> None:
        from ray.exceptions import ActorDiedError, RayError, RayTaskError

        slot, task = owner
        if task is None:
            if ref == slot.ready:
                self._started(slot, ref)
            elif ref == slot.ping:
                self._ping_answered(slot, ref)
            return
        if not any(item[0] == ref for item in slot.in_flight):
            return  # its actor was restarted or replaced by an earlier answer of this round: re-queued then
        slot.in_flight = deque(item for item in slot.in_flight if item[0] != ref)
        self.progress.forget.remote(task.index)
        try:
            result = self._ray.get(ref)
        except RayTaskError as err:  # the shard's own failure (or, FeedAborted, a neighbour's)
            if isinstance(err, ActorFault):  # the device's: uncharged, and the actor is quarantined
                queue.push_front(task.again())
                self._restart(slot, queue, f"its device fails every row and a probe ({_last_line(err)})", sick=True)
                return
            if not isinstance(err, (FeedAborted, LeaseUnknownError)):  # the lease unreadable: not the shard's
                slot.failed.add(task.index)
                self._charge(task, err)
            queue.push_front(task.again())
            return
        except ActorDiedError as err:
            if not getattr(err, "preempted", False):  # a preempted node (spot, drained) is not the shard's doing
                self._charge(task, err)
            queue.push_front(task.again())
            self._dead(slot, "it was preempted" if getattr(err, "preempted", False) else "it died")
            return
        except RayError as err:  # ActorUnavailableError and the like: the actor may come back
            queue.push_front(task.again())
            self._suspect(slot, queue, type(err).__name__)
            return
        slot.last_answer = slot.head_since = slot.progress_at = time.monotonic()
        on_result(result)
        self._quarantine(result.index, slot, queue)

    def _charge(self, task: ShardTask, err: BaseException) -> None:
        """One failed attempt of `task`'s shard; the job fails after `ray.shard_attempts`."""
        failures = self._failures.get(task.index, 0) + 1
        self._failures[task.index] = failures
        if failures >= self.config.ray.shard_attempts:
            raise RuntimeError(f"shard {task.index} failed {failures} time(s); last error: {err}") from err
        log.warning("shard %d: %s; handing it to another actor", task.index, _last_line(err))

    def _quarantine(self, index: int, winner: _Slot, queue: ShardQueue) -> None:
        """Shard `index` succeeded: every other actor it failed on is sick, and restarted."""
        for slot in self._slots:
            if slot is not winner and index in slot.failed:
                slot.failed.discard(index)
                if slot.state == "ok":
                    self._restart(slot, queue, f"shard {index} failed on it and then succeeded on another actor",
                                  sick=True)
        winner.failed.discard(index)

    def _requeue_all(self, slot: _Slot, queue: ShardQueue) -> None:
        for _, task in reversed(slot.in_flight):
            self.progress.forget.remote(task.index)
            queue.push_front(task.again())
        slot.in_flight.clear()

    def _suspect(self, slot: _Slot, queue: ShardQueue, why: str) -> None:
        if slot.state == "ok":
            log.warning("an actor is unavailable (%s); its shards go to the others until it answers", why)
            slot.state, slot.suspect_since = "suspect", time.monotonic()
        self._requeue_all(slot, queue)

    def _lives_left(self, slot: _Slot) -> bool:
        """Restarts left in the budget: `ray.max_restarts` in the last `ray.restart_window_s`."""
        limit, now = self.config.ray.max_restarts, time.monotonic()
        while slot.restarts and now - slot.restarts[0] > self.config.ray.restart_window_s:
            slot.restarts.popleft()
        return limit < 0 or len(slot.restarts) < limit

    def _spend_life(self, slot: _Slot) -> None:
        slot.lives += 1
        slot.restarts.append(time.monotonic())

    def _restart(self, slot: _Slot, queue: ShardQueue, why: str, sick: bool = False) -> None:
        """A stuck, silent or sick actor: its shards go back, and Ray replaces its process (it reloads the
        pair; it gets shards again once it answers a ping). Without restarts left it is given up. A sick one
        on a GPU is set aside instead (`_fence`)."""
        if not self._lives_left(slot):
            self._dead(slot, f"{why}; no restarts left")
            return
        if sick and self._fence_sick:
            self._fence(slot, queue, why)
            return
        log.warning("restarting an actor (%s); %d shard(s) re-queued", why, len(slot.in_flight))
        self._requeue_all(slot, queue)
        self._spend_life(slot)
        slot.killed_pid, slot.paid = slot.pid, True
        slot.failed.clear()
        slot.state, slot.suspect_since, slot.ping, slot.ping_sent = "suspect", time.monotonic(), None, 0.0
        slot.asked_since = None
        try:
            self._ray.kill(slot.actor, no_restart=False)
        except Exception:  # noqa: BLE001 - it may be gone already; its pings say what became of it
            pass

    def _fence(self, slot: _Slot, queue: ShardQueue, why: str) -> None:
        """A sick actor is set aside for the run, alive and idle: it keeps its GPU, so no actor of the job is
        placed there again; its shards go back and a new actor (a life) takes its slot where there is room."""
        log.warning("setting aside a sick actor for the rest of the run (%s): it keeps holding its device, so that "
                    "no actor is placed on it again; %d shard(s) re-queued, a new actor starts where there is room",
                    why, len(slot.in_flight))
        self._requeue_all(slot, queue)
        self._fenced = (*self._fenced, slot.actor)
        if slot.actor in self.actors:
            self.actors.remove(slot.actor)
        self._spend_life(slot)
        self._replace(slot)

    def _replace(self, slot: _Slot) -> None:
        """A new actor in the slot, starting (it gets shards once its ready() answers)."""
        slot.paid, slot.killed_pid, slot.ping, slot.asked_since = False, None, None, None
        slot.actor = self._remote_class.remote(*self._actor_args)
        slot.state, slot.started, slot.failed = "starting", time.monotonic(), set()
        slot.ready = slot.actor.ready.remote()
        log.warning("starting a new actor in its place")

    def _dead(self, slot: _Slot, why: str) -> None:
        """The actor is gone for good: its shards go back, and a new actor takes its place while its
        budget (`ray.max_restarts`) lasts; the new one starts when the cluster has room for it."""
        if slot.state != "dead":
            log.warning("giving up an actor (%s); %d shard(s) re-queued", why, len(slot.in_flight))
        if self._queue is not None:
            self._requeue_all(slot, self._queue)
        slot.state, slot.ping = "dead", None
        try:
            self._ray.kill(slot.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - it may be gone already; either way we no longer use it
            pass
        if slot.paid or self._lives_left(slot):  # a restart Ray refused (its own budget spent) was paid for
            if not slot.paid:
                self._spend_life(slot)
            self._replace(slot)

    def _started(self, slot: _Slot, ref: Any) -> None:
        """A late or new actor's ready() answered: it gets shards (or, failing to load, is given up)."""
        from ray.exceptions import RayError

        slot.ready = None
        try:
            worker = self._ray.get(ref)
        except RayError as err:
            self._dead(slot, f"it failed to load the pair: {err}")
            return
        log.warning("an actor joined the job (%s)", worker.get("host"))
        slot.state, slot.last_answer, slot.progress, slot.progress_at = "ok", time.monotonic(), -1, time.monotonic()
        slot.asked_since, slot.pid = None, worker.get("pid")
        self.actors.append(slot.actor)
        if self._hooks and self._hooks.on_actor_joined:
            self._hooks.on_actor_joined(slot.actor, worker)

    def _ping_answered(self, slot: _Slot, ref: Any) -> None:
        from ray.exceptions import ActorDiedError, RayError

        slot.ping = None
        try:
            answer = self._ray.get(ref)
        except ActorDiedError:
            self._dead(slot, "it died")
            return
        except RayError:
            return  # unavailable: asked again at the next heartbeat
        if slot.killed_pid is not None and answer.get("pid") == slot.killed_pid:
            return  # the process a restart replaces, answering before it is gone (ray.kill is asynchronous)
        now = time.monotonic()
        slot.last_answer, slot.asked_since = now, None
        slot.pid, slot.killed_pid, slot.paid = answer.get("pid", slot.pid), None, False
        slot.compiling_s = answer.get("compiling_s")
        if answer["progress"] != slot.progress:
            slot.progress, slot.progress_at = answer["progress"], now
        elif slot.compiling_s is not None and slot.compiling_s < COMPILE_LIMIT_S:
            slot.progress_at = now  # compiling is working (torch.compile, CUDA graph recording)
        if slot.state == "suspect":
            log.warning("an unavailable actor answers again; it gets shards again")
            slot.state, slot.progress_at = "ok", now
            if self._hooks and self._hooks.on_actor_joined:
                self._hooks.on_actor_joined(slot.actor, answer)

    def _read_pings(self) -> None:
        """The ping answers that came while the driver was busy, read before any actor is judged silent."""
        pings = {slot.ping: slot for slot in self._slots if slot.ping is not None}
        if pings:
            ready, _ = self._ray.wait(list(pings), num_returns=len(pings), timeout=0)
            for ref in ready:
                self._ping_answered(pings[ref], ref)

    def _silent_s(self, slot: _Slot, now: float) -> float:
        """How long the actor has not answered a ping it was asked (0 when none is unanswered)."""
        return 0.0 if slot.asked_since is None else now - max(slot.asked_since, slot.last_answer)

    def _heartbeat(self, queue: ShardQueue) -> None:
        self._read_pings()
        now = time.monotonic()
        r = self.config.ray
        # an actor waiting for room (a lost node) costs nothing while others work: it joins when a node
        # returns, however late; a job with no working actor waits at most actor_start_timeout_s
        if any(slot.state == "ok" for slot in self._slots):
            self._working_at = now
        for slot in self._slots:
            if slot.state == "starting" and now - max(slot.started, self._working_at) > r.actor_start_timeout_s:
                self._give_up_start(slot)
            if slot.state in ("dead", "starting") or (slot.state == "ok" and not slot.in_flight):
                continue
            if slot.ping is None and now - slot.ping_sent >= r.heartbeat_s:
                slot.ping = slot.actor.ping.options(concurrency_group=HEALTH_GROUP).remote()
                slot.ping_sent = now
                if slot.asked_since is None:
                    slot.asked_since = now
            if slot.state == "suspect":
                if now - max(slot.suspect_since, self._working_at) > r.actor_start_timeout_s:
                    self._dead(slot, f"unavailable for {now - slot.suspect_since:.0f} s")
            elif self._silent_s(slot, now) > r.heartbeat_timeout_s:
                self._restart(slot, queue, f"no answer for {self._silent_s(slot, now):.0f} s")
            elif now - slot.progress_at > r.stall_timeout_s:
                compiling = "" if slot.compiling_s is None else f", in a compile for {slot.compiling_s:.0f} s"
                why = f"no progress for {now - slot.progress_at:.0f} s (ray.stall_timeout_s{compiling})"
                self._hung(slot, why)
                self._restart(slot, queue, why)
            elif r.shard_timeout_s is not None and slot.in_flight and now - slot.head_since > r.shard_timeout_s:
                self._hung(slot, "it ran past ray.shard_timeout_s")
                self._restart(slot, queue, f"shard {slot.in_flight[0][1].index} ran past ray.shard_timeout_s")

    def _hung(self, slot: _Slot, why: str) -> None:
        """The actor is restarted for hanging: its head shard (the one running longest) is charged one attempt,
        so a shard that hangs every actor it meets is given up after `ray.shard_attempts` (the job fails naming
        it) instead of restarting actors until none is left."""
        if slot.in_flight:
            self._charge(slot.in_flight[0][1], RuntimeError(f"it hung its actor: {why}"))

    def _give_up_start(self, slot: _Slot) -> None:
        """An actor that did not start within ray.actor_start_timeout_s (the cluster lacks room for it)."""
        log.warning("an actor did not start within ray.actor_start_timeout_s; going on without it")
        slot.state, slot.ready = "dead", None
        try:
            self._ray.kill(slot.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - either way we no longer use it
            pass

    def kept(self) -> KeptActors | None:
        """The actors, for the next sweep cell, when this run ended clean: every actor working, idle, never
        restarted or replaced, and no shard failed (else None: the next cell starts fresh actors, and
        its fault handling starts from nothing)."""
        clean = bool(self._slots) and not self._failures and all(
            slot.state == "ok" and not slot.in_flight and not slot.lives and not slot.failed for slot in self._slots
        )
        if not clean or len(self.actors) != len(self._slots):
            return None
        return KeptActors(list(self.actors), self.progress, self._progress_name)

    def shutdown(self) -> None:
        """Kill every actor of the pool and the progress actor: a job that ends (or fails) in a session that
        goes on (a notebook, a test run) leaves no actor holding the cluster's CPUs and GPUs."""
        for actor in [*self.actors, *(slot.actor for slot in self._slots), *self._fenced, self.progress]:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - gone already
                pass

    def _report_partial(self, on_partial: Callable[[int], None]) -> None:
        from ray.exceptions import GetTimeoutError, RayError

        shards = [task for slot in self._slots for _, task in slot.in_flight]
        try:
            snapshot = self._ray.get(self.progress.snapshot.remote(), timeout=PROGRESS_POLL_S)
        except (GetTimeoutError, RayError):  # progress is best effort; generation goes on
            return
        on_partial(rows_in_flight(snapshot, shards))
