"""Handing shards to the job's Ray actors: the actor pool and the shard queue.

Ray does the placing: each `ShardGenerator` actor asks for `ray.cpus_per_actor` CPUs (and a GPU when the
cluster has GPUs), Ray restarts one that dies (`ray.max_restarts`) and re-runs its unfinished shard on
the restarted actor (`ray.max_task_retries`). The pool keeps the queue, gives the next shard to whichever
actor returns one, and hands each result to the caller as it arrives; a shard whose task still fails
(e.g. the actor is gone for good) goes back into the queue for another actor, up to `ray.shard_attempts`.

Not here: writing results (`pipeline.generate.output`), sizing the pool (`pipeline.generate.cluster`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.generate.config import GenerateConfig
from pipeline.generate.progress import PROGRESS_POLL_S, BatchReporter, ShardProgress, rows_in_flight
from pipeline.generate.shards import Shard
from pipeline.generate.worker import ShardGenerator, ShardResult

log = logging.getLogger("pipeline")


@dataclass
class RunHooks:
    """Observation points for tests and tools; the job itself needs none of them."""

    on_actors_ready: Callable[[list[Any], list[dict[str, Any]]], None] | None = None
    on_dispatch: Callable[[Any, Shard], None] | None = None
    on_shard_written: Callable[[ShardResult], None] | None = None
    on_progress: Callable[[int], None] | None = None  # prompts done, shards in flight included (polled)


class ShardActorPool:
    """The job's actors and the shard queue. Ray places, restarts and retries; we only hand out shards."""

    def __init__(self, config: GenerateConfig, count: int, cpus_each: float, gpus_each: float):
        import ray

        self._ray = ray
        self.config = config
        remote_class = ray.remote(ShardGenerator).options(
            num_cpus=cpus_each,
            num_gpus=gpus_each,
            max_restarts=config.ray.max_restarts,
            max_task_retries=config.ray.max_task_retries,
        )
        threads = max(1, int(cpus_each))
        device = "cuda" if gpus_each > 0 else "cpu"  # a CPU actor stays on CPU even on a GPU node
        self.progress = ray.remote(ShardProgress).options(num_cpus=0).remote()
        reporter = BatchReporter(self.progress)
        self.actors = [
            remote_class.remote(config.model, config.spectr, threads, device, reporter) for _ in range(count)
        ]

    def wait_ready(self) -> list[dict[str, Any]]:
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return self._ray.get([actor.ready.remote() for actor in self.actors])
        except (RayActorError, RayTaskError) as err:
            raise RuntimeError(f"an actor failed to load the model pair: {err}") from err

    def run(
        self,
        shards: list[Shard],
        on_result: Callable[[ShardResult], None],
        hooks: RunHooks | None = None,
        on_partial: Callable[[int], None] | None = None,
    ) -> None:
        """Generate every shard exactly once (as far as the output is concerned), calling `on_result` per
        shard, and `on_partial(rows generated so far in the shards in flight)` every PROGRESS_POLL_S
        while it waits."""
        from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

        ray = self._ray
        pending = deque(shards)
        attempts = dict.fromkeys((s.index for s in shards), 0)
        idle = list(self.actors)
        in_flight: dict[Any, tuple[Any, Shard]] = {}
        while pending or in_flight:
            while idle and pending:
                actor, shard = idle.pop(0), pending.popleft()
                attempts[shard.index] += 1
                in_flight[actor.generate_shard.remote(shard)] = (actor, shard)
                if hooks and hooks.on_dispatch:
                    hooks.on_dispatch(actor, shard)
            if not in_flight:
                raise RuntimeError(f"no live actors left; {len(pending)} shard(s) not generated")
            ready, _ = ray.wait(
                list(in_flight), num_returns=1, timeout=PROGRESS_POLL_S if on_partial is not None else None
            )
            if not ready:
                self._report_partial(on_partial, [shard for _, shard in in_flight.values()])
                continue
            actor, shard = in_flight.pop(ready[0])
            self.progress.forget.remote(shard.index)
            try:
                result = ray.get(ready[0])
            except (RayActorError, RayTaskError) as err:
                if attempts[shard.index] >= self.config.ray.shard_attempts:
                    raise RuntimeError(
                        f"shard {shard.index} failed {attempts[shard.index]} time(s); last error: {err}"
                    ) from err
                log.warning("shard %d: %s; handing it to another actor", shard.index, type(err).__name__)
                pending.appendleft(shard)
                if not isinstance(err, ActorDiedError):
                    idle.append(actor)  # the actor is alive (or restarting): keep using it
                continue
            on_result(result)
            idle.append(actor)

    def _report_partial(self, on_partial: Callable[[int], None], shards: list[Shard]) -> None:
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            snapshot = self._ray.get(self.progress.snapshot.remote(), timeout=PROGRESS_POLL_S)
        except (GetTimeoutError, RayActorError):  # progress is best effort; generation goes on
            return
        on_partial(rows_in_flight(snapshot, shards))


