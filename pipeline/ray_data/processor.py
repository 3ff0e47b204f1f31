"""`build_processor(config, preprocess, postprocess)`: the SpecTr stage as a Dataset -> Dataset callable.

    processor = build_processor(config, preprocess=lambda row: {"prompt": row["text"]},
                                postprocess=lambda row: {"id": row["id"], "answer": row["generated_text"]})
    ray.data.read_parquet(...).pipe(processor).write_parquet(...)   # or processor(ds)

What `ray.data.llm`'s processors do, with the same conventions: `preprocess` is a `Dataset.map` whose
output is merged over the row (every input column goes on to the stage and to `postprocess`); a streaming
`repartition` into blocks of at most `batch_size` rows (so that a big block does not go to one actor);
the stage is one `map_batches` of `pipeline.ray_data.stage.SpecTrStage` on an actor pool (as Ray's engine
stage: `concurrency=n` an autoscaling pool of 1..n actors that grows while blocks wait, `(m, n)` m..n,
`(n, n)` fixed), `batch_size` rows per Ray Data batch, and per actor as many batches at once as fill its
engine's slots plus one, at most `max_concurrent_batches` (`SpecTrProcessorConfig.batches_in_flight`:
`max_tasks_in_flight_per_actor`, unless set, and `max_concurrency`; all of them feed the actor's one
continuous batch), `num_gpus` GPUs per actor (default 1; more with `device_map="auto"`: the target split
over them) when `accelerator_type` is set or the cluster has GPUs (else `num_cpus`), the config's
`runtime_env`;
`postprocess` is a `Dataset.map`, and a row carrying `__inference_error__` bypasses it (with
`should_continue_on_error`; the others get `__inference_error__ = ""`).

`register_with_ray_data_llm()` adds the config to Ray's `ProcessorBuilder` registry, so that
`ray.data.llm.build_processor(SpecTrProcessorConfig(...))` returns this same processor.

Not here: the actor (`pipeline.ray_data.stage`), the settings (`pipeline.ray_data.config`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pipeline.ray_data.config import SAMPLING_PARAMS_COLUMN, SpecTrProcessorConfig, pool_size
from pipeline.ray_data.stage import ERROR_COLUMN, SpecTrStage

BUILDER_KWARGS = ("chat_template_kwargs",)  # what ray.data.llm's vLLM builder takes beyond the row functions


class MergedPreprocess:
    """`preprocess` as Ray Data LLM applies it: its output updates the row, so every input column stays."""

    def __init__(self, fn: Callable[[dict[str, Any]], dict[str, Any]]):
        self.fn = fn

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        return {**row, **self.fn(row)}


class GuardedPostprocess:
    """`postprocess` as Ray Data LLM applies it: a row that carries an error is returned as it is."""

    def __init__(self, fn: Callable[[dict[str, Any]], dict[str, Any]], error_column: bool):
        self.fn, self.error_column = fn, error_column

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        if row.get(ERROR_COLUMN):
            return row
        result = self.fn(row)
        if self.error_column:
            result[ERROR_COLUMN] = ""
        return result


class SpecTrProcessor:
    """preprocess -> the SpecTr stage -> postprocess, on a `ray.data.Dataset` (lazily, as Ray Data plans)."""

    def __init__(self, config: SpecTrProcessorConfig, preprocess: Callable | None = None,
                 postprocess: Callable | None = None, preprocess_map_kwargs: dict[str, Any] | None = None,
                 postprocess_map_kwargs: dict[str, Any] | None = None):
        self.config = config
        self.preprocess, self.postprocess = preprocess, postprocess
        self.preprocess_map_kwargs = dict(preprocess_map_kwargs or {})
        self.postprocess_map_kwargs = dict(postprocess_map_kwargs or {})

    stage_class: type = SpecTrStage  # the actor (a subclass may add instrumentation: scripts/bench_ray_data.py)

    def input_column_names(self) -> list[str]:
        """The columns the stage reads after `preprocess` (the others pass through unchanged)."""
        prompt = ["messages (rendered with the chat template)"] if self.config.chat().enabled else []
        prompt += ["prompt" + (" (when a row has no messages)" if prompt else "")]
        if not self.config.stage("tokenize_stage").enabled:
            prompt += ["tokenized_prompt (when a row has neither)"]
        return prompt + [f"{SAMPLING_PARAMS_COLUMN} (optional)", "id (optional: the seed's key)"]

    def log_input_column_names(self) -> list[str]:
        """As `ray.data.llm`'s processors: log (and return) the columns the stage expects."""
        import logging

        names = self.input_column_names()
        logging.getLogger("pipeline").info("SpecTr stage input columns: %s", ", ".join(names))
        return names

    def __call__(self, dataset: Any) -> Any:
        if self.preprocess is not None:
            dataset = dataset.map(MergedPreprocess(self.preprocess), **self.preprocess_map_kwargs)
        # blocks of at most `batch_size` rows (streaming: small blocks are combined, big ones split): Ray Data
        # gives an actor whole blocks, so one big block (a small file is one) would go to one actor alone
        dataset = dataset.repartition(target_num_rows_per_block=self.config.batch_size)
        dataset = dataset.map_batches(self.stage_class, **self.stage_map_kwargs())
        if self.postprocess is not None:
            guarded = GuardedPostprocess(self.postprocess, self.config.should_continue_on_error)
            dataset = dataset.map(guarded, **self.postprocess_map_kwargs)
        return dataset

    def stage_map_kwargs(self, gpus: bool | None = None) -> dict[str, Any]:
        """`map_batches`' arguments for the stage; gpus: whether the cluster has GPUs (None: ask Ray)."""
        import ray

        config = self.config
        if gpus is None:
            gpus = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
        in_flight = config.batches_in_flight(bool(config.accelerator_type or gpus))
        pool = pool_size(config.concurrency)
        # an autoscaling pool grows only while batches wait on its actors (Ray Data scales up at a utilization,
        # tasks in flight / (actors x max_concurrency), of 1.75): as Ray's engine stage, twice the batches an actor
        # runs may be sent to it; a fixed pool queues none beyond those (see batches_in_flight)
        queued = in_flight if pool["min_size"] == pool["max_size"] else 2 * in_flight
        kwargs: dict[str, Any] = dict(
            fn_constructor_kwargs={"config": config},
            # no batches queued on an actor beyond those it runs (Ray's default queues as many again): a
            # queued batch waits for its actor while another may have free slots, e.g. when one actor loads first
            # n: an autoscaling pool of 1..n actors, as ray.data.llm's engine stage (`pool_size`)
            compute=ray.data.ActorPoolStrategy(**pool, max_tasks_in_flight_per_actor=config.max_tasks_in_flight_per_actor
                                               or queued),
            batch_size=config.batch_size,
            batch_format="pyarrow",
            zero_copy_batch=True,
            max_concurrency=in_flight,  # Ray Core: concurrent calls per (async) actor
        )
        if config.accelerator_type or gpus:
            kwargs["num_gpus"] = config.num_gpus  # > 1 with device_map="auto": the target split over them
        else:
            kwargs["num_cpus"] = config.num_cpus or 1
        if config.accelerator_type:
            kwargs["accelerator_type"] = config.accelerator_type
        if config.runtime_env is not None:
            kwargs["runtime_env"] = config.runtime_env
        return kwargs


def build_processor(config: SpecTrProcessorConfig, preprocess: Callable | None = None,
                    postprocess: Callable | None = None, preprocess_map_kwargs: dict[str, Any] | None = None,
                    postprocess_map_kwargs: dict[str, Any] | None = None,
                    builder_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> SpecTrProcessor:
    """The SpecTr stage (with the optional row functions around it): call it on a Dataset to get one.
    builder_kwargs: as `ray.data.llm.build_processor`'s, keyword arguments of the builder: `chat_template_kwargs`
    (the template's variables, under the chat template stage's own). `ray.data.llm.build_processor` passes
    them as keywords (`**kwargs` here), this function also in `builder_kwargs`."""
    if not isinstance(config, SpecTrProcessorConfig):
        raise TypeError(f"build_processor takes a SpecTrProcessorConfig, got {type(config).__name__}")
    extra = {**(builder_kwargs or {}), **kwargs}
    reserved = sorted(set(builder_kwargs or {}) & {"preprocess", "postprocess", "preprocess_map_kwargs",
                                                     "postprocess_map_kwargs"})
    if reserved:  # Ray's rule (ProcessorBuilder.validate_builder_kwargs)
        raise ValueError(f"builder_kwargs cannot contain {', '.join(reserved)}: pass them to build_processor directly")
    unknown = sorted(set(extra) - set(BUILDER_KWARGS))
    if unknown:
        raise TypeError(f"build_processor: unknown builder_kwargs {', '.join(unknown)}; known: {', '.join(BUILDER_KWARGS)}")
    chat_template_kwargs = extra.get("chat_template_kwargs")
    if chat_template_kwargs is not None:
        if not isinstance(chat_template_kwargs, dict):
            raise TypeError(f"build_processor: chat_template_kwargs must be a dict, got {chat_template_kwargs!r}")
        if config.chat_template_kwargs is None:  # the stage's own first (Ray's precedence), then the config's
            config = dataclasses.replace(config, chat_template_kwargs=chat_template_kwargs)
    return SpecTrProcessor(config, preprocess, postprocess, preprocess_map_kwargs, postprocess_map_kwargs)


def register_with_ray_data_llm() -> bool:
    """Make `ray.data.llm.build_processor` accept a `SpecTrProcessorConfig` (Ray's builder registry is keyed
    by the config class's name). False when this Ray has no `ray.data.llm` registry to join."""
    try:
        from ray.llm._internal.batch.processor import ProcessorBuilder
    except ImportError:
        return False
    registry = getattr(ProcessorBuilder, "_registry", None)
    if registry is None or not hasattr(ProcessorBuilder, "register"):
        return False
    if SpecTrProcessorConfig.__name__ not in registry:
        ProcessorBuilder.register(SpecTrProcessorConfig, build_processor)
    return True
