"""Ray for the generation job: join or start a cluster, and size the actor pool to its resources.

On a joined cluster whose GPU workers scale from zero (a KubeRay or cluster-launcher GPU group with
`minReplicas: 0`), `ray.gpus_per_actor` set asks the autoscaler for the GPUs the pool needs and waits for them
(`wait_for_gpus`, up to `ray.actor_start_timeout_s`) instead of sizing the pool to the GPUs there are at the
start (none: CPU actors, or a refusal).

Not here: the actors themselves (`pipeline.generate.worker`), handing out shards (`pipeline.generate.scheduler`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

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
    asked = False
    try:
        asked = wait_for_gpus(config)  # a joined cluster whose GPU nodes scale from zero
        yield
    finally:
        if asked:
            _release_gpu_request()
        ray.shutdown()


GPU_POLL_S = 5.0  # how often the wait for GPU nodes looks at the cluster


def wait_for_gpus(config: RayConfig, resources: Callable[[], dict[str, float]] | None = None,
                  request: Callable[[list[dict[str, float]]], None] | None = None,
                  sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> bool:
    """On a joined cluster with `ray.gpus_per_actor` > 0: until the cluster has the GPUs of the pool
    (`gpus_per_actor` x `num_actors`, or x 1 without `num_actors`), ask the autoscaler for them (one bundle per
    actor: Ray's `request_resources`) and wait, up to `ray.actor_start_timeout_s`; JobInputError when none come.
    Returns whether it asked (the request is dropped when the session ends). resources / request / sleep /
    clock: Ray's and the time's, replaced by the tests."""
    gpus_each = config.gpus_per_actor or 0.0
    if not config.address or gpus_each <= 0:
        return False
    import ray

    resources = resources or ray.cluster_resources
    actors = config.num_actors or 1
    needed = gpus_each * actors
    if float(resources().get("GPU", 0)) >= needed - 1e-9:
        return False
    if request is None:
        from ray.autoscaler.sdk import request_resources

        def request(bundles: list[dict[str, float]]) -> None:
            request_resources(bundles=bundles)

    request([{"GPU": gpus_each}] * actors)
    log.warning("ray: waiting for %g GPU(s) (ray.gpus_per_actor=%g x %d actor(s)); the cluster has %g: asked its "
                "autoscaler for them, waiting up to ray.actor_start_timeout_s=%g s",
                needed, gpus_each, actors, float(resources().get("GPU", 0)), config.actor_start_timeout_s)
    deadline = clock() + config.actor_start_timeout_s
    while float(resources().get("GPU", 0)) < needed - 1e-9:
        if clock() >= deadline:
            request([])
            raise JobInputError(
                f"ray.gpus_per_actor={gpus_each:g}: the cluster has {float(resources().get('GPU', 0)):g} of the "
                f"{needed:g} GPU(s) the actors need after ray.actor_start_timeout_s={config.actor_start_timeout_s:g} "
                "s (no GPU node joined: check the GPU worker group's maxReplicas, quota and node selectors, or "
                "lower ray.num_actors)")
        sleep(min(GPU_POLL_S, max(0.0, deadline - clock())))
    log.info("ray: %g GPU(s) in the cluster", float(resources().get("GPU", 0)))
    return True


def _release_gpu_request() -> None:
    """Drop the standing request of `wait_for_gpus`, so that the autoscaler may scale the GPU group down again."""
    try:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[])
    except Exception as err:  # noqa: BLE001 - the session ends either way
        log.warning("ray: could not drop the GPU request (%s: %s)", type(err).__name__, err)


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


