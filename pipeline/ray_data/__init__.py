"""SpecTr as a stage of a user's own Ray Data pipeline, shaped like `ray.data.llm`.

    from pipeline.ray_data import SpecTrProcessorConfig, build_processor

    config = SpecTrProcessorConfig(model_source="assets/models/target", draft_model_source="assets/models/draft",
                                   batch_size=32, concurrency=2, engine_kwargs={"method": "auto"})
    processor = build_processor(config, preprocess=lambda row: {"sampling_params": {"max_tokens": 64}})
    processor(ray.data.read_parquet("s3://bucket/prompts/")).write_parquet("s3://bucket/completions/")

Files: `config` (`SpecTrProcessorConfig`: the settings and their checks), `processor` (`build_processor`:
the Dataset plan, the row functions, the `ray.data.llm` registration), `stage` (`SpecTrStage`: the actor,
which runs the Hydra job's actor code, `pipeline.generate.worker.ShardGenerator`, on Ray Data batches).
Importing this package also registers the config with `ray.data.llm.build_processor` (when Ray has it),
except inside Ray's worker processes (the stage's actors unpickle it): the registry is the driver's, and
its import (`ray.llm`'s batch stages, aiohttp) would add to every actor's start.

Not here: the Hydra job (`pipeline.generate`): no commit log, resume, lease or MLflow; Ray Data's own
checkpointing and retries are the pipeline's.
"""

from pipeline.ray_data.config import SpecTrProcessorConfig
from pipeline.ray_data.processor import SpecTrProcessor, build_processor, register_with_ray_data_llm
from pipeline.ray_data.stage import SpecTrStage

__all__ = ["SpecTrProcessor", "SpecTrProcessorConfig", "SpecTrStage", "build_processor",
           "register_with_ray_data_llm"]



def _in_ray_worker() -> bool:
    """Whether this process is one of Ray's workers (an actor or a task), not a driver."""
    import ray

    return ray.is_initialized() and ray._private.worker.global_worker.mode == ray.WORKER_MODE


RAY_DATA_LLM_REGISTERED = False if _in_ray_worker() else register_with_ray_data_llm()
