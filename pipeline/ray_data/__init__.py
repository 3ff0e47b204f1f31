"""SpecTr as a stage of a user's own Ray Data pipeline, shaped like `ray.data.llm`.

    from pipeline.ray_data import SpecTrProcessorConfig, build_processor

    config = SpecTrProcessorConfig(model_source="assets/models/target", draft_model_source="assets/models/draft",
                                   batch_size=32, concurrency=2, engine_kwargs={"method": "auto"})
    processor = build_processor(config, preprocess=lambda row: {"sampling_params": {"max_tokens": 64}})
    processor(ray.data.read_parquet("s3://bucket/prompts/")).write_parquet("s3://bucket/completions/")

Files: `config` (`SpecTrProcessorConfig`: the settings and their checks), `processor` (`build_processor`:
the Dataset plan, the row functions, the `ray.data.llm` registration), `stage` (`SpecTrStage`: the actor,
which runs the Hydra job's actor code, `pipeline.generate.worker.ShardGenerator`, on Ray Data batches).
Importing this package also registers the config with `ray.data.llm.build_processor` (when Ray has it).

Not here: the Hydra job (`pipeline.generate`): no commit log, resume, lease or MLflow; Ray Data's own
checkpointing and retries are the pipeline's.
"""

from pipeline.ray_data.config import SpecTrProcessorConfig
from pipeline.ray_data.processor import SpecTrProcessor, build_processor, register_with_ray_data_llm
from pipeline.ray_data.stage import SpecTrStage

__all__ = ["SpecTrProcessor", "SpecTrProcessorConfig", "SpecTrStage", "build_processor",
           "register_with_ray_data_llm"]

RAY_DATA_LLM_REGISTERED = register_with_ray_data_llm()
