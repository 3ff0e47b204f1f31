"""Sweep cells that keep the pair loaded: the Ray session and the actors, from one cell to the next.

    with keeper.ray_session(config.ray, verbose):        # started once; restarted when `ray.*` changes
        kept = keeper.take(key)                          # the last cell's actors when `key` matches, else None
        pool = ShardActorPool(..., kept=kept)            # kept actors take this cell's engine settings
        ...
        keeper.hold(key, pool)                           # a clean pool's actors wait for the next cell

The cells of a Hydra multirun run one after another in one process (`jobs.generate -m`). Cells that share
`model.*`, `ray.*` and the actors' resources (count, CPUs, GPUs each) run on the same Ray instance and the
same actors: each actor gets the cell's `spectr.*` (`ShardGenerator.reconfigure`: a new continuous batch
on the models it holds) and the cell's `WorkerJob`, so a cell pays no model load. A cell that changes the
model or the actors' resources gets new actors; one that changes `ray.*` also a new Ray. Only a pool that
ended clean is kept (`ShardActorPool.kept`: no restart, replacement or failed shard), so every cell's fault
handling starts from nothing; each cell keeps its own output, MLflow run and summary (the actors' new batch
counts from zero).

`SWEEP_KEEPER` is the process's keeper: `jobs.generate` passes it to every sweep cell, `jobs.sweep` closes it
after the last cell, and it closes itself at exit. A single run passes none and shuts its actors and Ray
down at its end, as before.

Not here: the actors (`pipeline.generate.worker`), the pool (`pipeline.generate.scheduler`), Ray's start
(`pipeline.generate.cluster`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from pipeline.generate.cluster import ray_session
from pipeline.generate.config import GenerateConfig, RayConfig
from pipeline.generate.scheduler import KeptActors, ShardActorPool

log = logging.getLogger("pipeline")


def pair_key(config: GenerateConfig, resources: tuple[int, float, float]) -> tuple[Any, ...]:
    """What kept actors must share with a cell: its models, Ray settings and (actors, CPUs, GPUs each)."""
    return config.model, config.ray, resources


class PairKeeper:
    """One process's Ray session and its last clean pool of actors; see the module docstring."""

    def __init__(self) -> None:
        self._ray: contextlib.ExitStack | None = None
        self._ray_config: RayConfig | None = None
        self._kept: KeptActors | None = None
        self._key: tuple[Any, ...] | None = None
        self._at_exit = False

    @property
    def kept(self) -> KeptActors | None:
        return self._kept

    @contextlib.contextmanager
    def ray_session(self, config: RayConfig, verbose: bool = True) -> Iterator[None]:
        """Ray for a cell: the one this keeper started for an earlier cell with the same `ray.*`, else a new
        one (the old one and its actors shut down first). It stays up when the cell ends."""
        import ray

        if self._ray is not None and (config != self._ray_config or not ray.is_initialized()):
            log.info("sweep: ray.* changed (or Ray went away): a new Ray and new actors for this cell")
            self.close()
        if self._ray is None:
            stack = contextlib.ExitStack()
            stack.enter_context(ray_session(config, verbose))
            self._ray, self._ray_config = stack, config
            self._close_at_exit()
        yield

    def take(self, key: tuple[Any, ...]) -> KeptActors | None:
        """The kept actors when they were built for `key` (they are the caller's now), else None (and any
        kept for another key are shut down: the caller starts its own)."""
        kept, self._kept = self._kept, None
        if kept is not None and key != self._key:
            log.info("sweep: this cell changes the model or the actors' resources: new actors load the pair")
            _kill(kept)
            return None
        return kept

    def hold(self, key: tuple[Any, ...], pool: ShardActorPool) -> None:
        """After a cell: its pool's actors wait for the next cell when the pool ended clean; else shut down."""
        kept = pool.kept()
        if kept is None:
            pool.shutdown()
            return
        self._kept, self._key = kept, key

    def close(self) -> None:
        """Shut down the kept actors and the Ray this keeper started (a Ray it joined stays up)."""
        kept, self._kept, self._key = self._kept, None, None
        if kept is not None:
            _kill(kept)
        stack, self._ray, self._ray_config = self._ray, None, None
        if stack is not None:
            stack.close()

    def _close_at_exit(self) -> None:
        if not self._at_exit:
            self._at_exit = True
            atexit.register(self.close)


def _kill(kept: KeptActors) -> None:
    import ray

    for actor in [*kept.actors, kept.progress]:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - gone already (or Ray is down): nothing holds the cluster either way
            pass


SWEEP_KEEPER = PairKeeper()  # the sweep cells' (jobs.generate -m); one process runs one sweep
