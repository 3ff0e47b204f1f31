"""Ray for the generation job: join or start a cluster, and size the actor pool to its resources.

Not here: the actors themselves (`pipeline.generate.worker`), handing out shards (`pipeline.generate.scheduler`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from pipeline import fs
from pipeline.errors import JobInputError
from pipeline.generate.config import RayConfig

log = logging.getLogger("pipeline")


@contextlib.contextmanager
def ray_session(config: RayConfig, verbose: bool = True) -> Iterator[None]:
    """Join the configured cluster, or start a local Ray; shut down only what we started.

    When this process is already connected to Ray (a notebook, a test session), that connection is used.
    A local Ray started here inherits this process's environment (object-store credentials included).
    """
    import ray

    if ray.is_initialized() or config.address:
        _warn_secrets_stay()
    if ray.is_initialized():
        yield
        return
    if config.address:
        try:
            ray.init(address=config.address, log_to_driver=True,
                     logging_level=logging.INFO if verbose else logging.WARNING)
        except ConnectionError as err:
            raise JobInputError(
                f"ray.address: cannot join a Ray cluster at {config.address!r}: {err}"
            ) from None
    else:
        ray.init(
            num_cpus=config.local_num_cpus,
            include_dashboard=False,
            logging_level=logging.INFO if verbose else logging.WARNING,
            object_store_memory=config.local_object_store_mb * 1024 * 1024,
        )
    try:
        yield
    finally:
        ray.shutdown()


def _warn_secrets_stay() -> None:
    """On a cluster this process did not start, its actors do not inherit its environment, and credentials
    are never sent to them (`pipeline.fs.forwarded_env`): say so, naming the variables, never their values."""
    secrets = fs.secrets_in_env()
    if secrets:
        log.warning(
            "%s set here are not sent to the Ray actors: they read object stores with their nodes' own credentials "
            "(environment, instance role, or the file AWS_SHARED_CREDENTIALS_FILE names, which is sent)",
            ", ".join(secrets),
        )


def actor_resources(
    config: RayConfig, cluster: dict[str, float], shards_to_do: int
) -> tuple[int, float, float]:
    """(number of actors, CPUs each, GPUs each): one actor per GPU when there are GPUs, else per N CPUs."""
    gpus = float(cluster.get("GPU", 0))
    cpus = float(cluster.get("CPU", 0))
    gpus_each = config.gpus_per_actor if config.gpus_per_actor is not None else (1.0 if gpus > 0 else 0.0)
    cpus_each = float(config.cpus_per_actor)
    if config.num_actors is not None:
        count = config.num_actors
    elif gpus_each > 0:
        count = int(gpus // gpus_each)
    else:
        count = int(cpus // cpus_each)
    if gpus_each > gpus or count * gpus_each > gpus + 1e-9 or count * cpus_each > cpus + 1e-9:
        raise JobInputError(
            f"ray: {count} actor(s) x ({cpus_each:g} CPU, {gpus_each:g} GPU) do not fit the cluster "
            f"({cpus:g} CPUs, {gpus:g} GPUs); lower ray.num_actors or ray.cpus_per_actor"
        )
    count = max(1, min(count, max(1, shards_to_do)))
    return count, cpus_each, gpus_each


