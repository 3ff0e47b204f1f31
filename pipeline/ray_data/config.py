"""`SpecTrProcessorConfig`: what the Ray Data stage runs, shaped like `ray.data.llm`'s processor configs.

    config = SpecTrProcessorConfig(model_source="assets/models/target", draft_model_source="assets/models/draft",
                                   batch_size=32, concurrency=2, engine_kwargs={"method": "spectr", "num_drafts": 2})

The fields `ray.data.llm` users know (`model_source`, `batch_size` rows per Ray Data batch, `concurrency`
actors, `accelerator_type`, `apply_chat_template`, `chat_template_kwargs`, `max_concurrent_batches`,
`should_continue_on_error`), the draft's directory, and `engine_kwargs`: the engine's settings, by the
Hydra job's names (`spectr.*`: `method`, `num_drafts`, `draft_length`, `batch_size` rows in flight per actor,
`max_num_drafts`, `max_draft_length`, `seed`, the row defaults `max_new_tokens`, `temperature`, `top_k`,
`top_p`, and `compile` where the engine has it; `model.*`: `dtype`, `trust_remote_code`, `allow_pickle`,
`device_map`: "auto" splits the target over the actor's `num_gpus` GPUs, as the job's
`ray.gpus_per_actor`). They are checked here, on the driver, by the job's own checks (`ValueError`, before any
actor starts), and turned into the job's `ModelConfig`, `SpectrConfig` and `DataConfig`, which the actor's
`ShardGenerator` takes as the job's actor does.

Not here: running anything (`pipeline.ray_data.processor`, `pipeline.ray_data.stage`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pipeline.config import DataConfig, ModelConfig, check_model
from pipeline.generate.config import SpectrConfig, check_spectr

# engine_kwargs that are not `spectr.*` settings: the models' (`model.*`)
MODEL_KEYS = ("dtype", "trust_remote_code", "allow_pickle", "device_map")
# `spectr.*` settings a row sets for itself instead (sampling_params) or that the stage fixes
NOT_ENGINE_KEYS = ("num_samples", "stop", "logprobs", "plan_cache")
SAMPLING_PARAMS_COLUMN = "sampling_params"
# rows in flight per actor (the engine's batch) when engine_kwargs has no batch_size: a GPU is filled by more rows
# (a guess until a GPU run measures it); a CPU forward costs about in proportion to its rows
ENGINE_BATCH_SIZE = {"gpu": 64, "cpu": 8}


def engine_keys() -> tuple[str, ...]:
    """Every key `engine_kwargs` takes (the engine's `SpectrConfig` fields as this checkout has them)."""
    spectr = tuple(f.name for f in dataclasses.fields(SpectrConfig) if f.name not in NOT_ENGINE_KEYS)
    return spectr + MODEL_KEYS


@dataclass(frozen=True)
class SpecTrProcessorConfig:
    """The SpecTr stage of a Ray Data pipeline: one draft/target pair and one continuous batch per actor."""

    model_source: str  # the target's directory (as the job's model.target)
    draft_model_source: str  # the draft's directory (model.draft): same tokenizer and vocabulary
    batch_size: int = 32  # rows per Ray Data batch (the engine's rows in flight are engine_kwargs' batch_size)
    concurrency: int | tuple[int, int] = 1  # actors: n (a fixed pool), or (min, max) (an autoscaling pool)
    accelerator_type: str | None = None  # e.g. "H100": each actor takes GPUs of that type
    num_gpus: int = 1  # GPUs per actor where there are GPUs; > 1 with engine_kwargs device_map="auto" splits the target
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    apply_chat_template: bool = False  # rows hold `messages`, rendered with the target tokenizer's template
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": False}
    max_concurrent_batches: int = 4  # at most this many Ray Data batches per actor at once (`batches_in_flight`)
    should_continue_on_error: bool = False  # True: a failed row carries `__inference_error__`, the rest go on
    num_cpus: float | None = None  # CPUs per actor without a GPU (its torch threads); None: 1

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"SpecTrProcessorConfig: batch_size must be an int >= 1, got {self.batch_size!r}")
        pool_size(self.concurrency)
        if not isinstance(self.max_concurrent_batches, int) or self.max_concurrent_batches < 1:
            raise ValueError("SpecTrProcessorConfig: max_concurrent_batches must be an int >= 1, "
                             f"got {self.max_concurrent_batches!r}")
        if not isinstance(self.num_gpus, int) or self.num_gpus < 1:
            raise ValueError(f"SpecTrProcessorConfig: num_gpus must be an int >= 1, got {self.num_gpus!r}")
        if self.num_cpus is not None and not self.num_cpus > 0:
            raise ValueError(f"SpecTrProcessorConfig: num_cpus must be > 0 or None, got {self.num_cpus!r}")
        unknown = sorted(set(self.engine_kwargs) - set(engine_keys()))
        if unknown:
            raise ValueError(f"SpecTrProcessorConfig: unknown engine_kwargs {', '.join(unknown)}; known: "
                             f"{', '.join(engine_keys())} (per-row settings go in the rows' sampling_params)")
        for key in ("model_source", "draft_model_source"):
            missing_local_path(key, getattr(self, key))
        check_model(self.model_config())
        check_spectr(self.spectr_config())
        self.data_config()

    def model_config(self) -> ModelConfig:
        """The job's `model.*` section for this pair."""
        own = {k: v for k, v in self.engine_kwargs.items() if k in MODEL_KEYS}
        return ModelConfig(target=str(self.model_source), draft=str(self.draft_model_source), **own)

    def spectr_config(self, gpu: bool = False) -> SpectrConfig:
        """The job's `spectr.*` section: the engine_kwargs, with each token's log-probability kept (a row's
        `sampling_params.logprobs` decides whether its `logprobs` is filled). Without an engine_kwargs
        `batch_size` (rows in flight per actor), `ENGINE_BATCH_SIZE` for the device (`gpu`)."""
        own = {k: v for k, v in self.engine_kwargs.items() if k not in MODEL_KEYS}
        own.setdefault("batch_size", ENGINE_BATCH_SIZE["gpu" if gpu else "cpu"])
        spectr = SpectrConfig(**{**own, "logprobs": True})
        if spectr.method in ("speculative", "block"):
            spectr = dataclasses.replace(spectr, num_drafts=1)  # K = 1 methods, as the job's config says
        return spectr

    def batches_in_flight(self, gpu: bool = False) -> int:
        """Ray Data batches an actor holds at once: enough rows to fill its engine's slots (rows in flight,
        engine_kwargs `batch_size`) plus one batch to refill them as rows finish, at most
        `max_concurrent_batches`. More would only sit in the actor: the first actor to load would hold the
        batches that another, ready a moment later, could run (4 batches of 32 rows on 2 actors of 8 slots
        went 4 and 0 with the bound at 4)."""
        slots = self.spectr_config(gpu).batch_size
        return min(self.max_concurrent_batches, -(-slots // self.batch_size) + 1)

    def data_config(self) -> DataConfig:
        """The job's `data.*` rules for a row: chat mode, the template's options, the sampling_params column."""
        from pipeline.row_columns import check_row_columns_config

        data = DataConfig(path="", chat=bool(self.apply_chat_template), chat_template_kwargs=self.chat_template_kwargs,
                          sampling_params_column=SAMPLING_PARAMS_COLUMN)
        check_row_columns_config(data)
        return data


def missing_local_path(key: str, source: Any) -> None:
    """A model source that names a local path (absolute, ./ or ../, ~, or more than one '/': not a hub id
    `org/name`) must exist: refused on the driver, before any actor starts. A hub id or an s3:// / gs:// URI
    goes on to loading, as in `ray.data.llm` (which this machine cannot reach: not tested beyond this)."""
    from pathlib import Path

    text = str(source)
    if "://" in text:
        return
    local = text.startswith(("/", "./", "../", "~")) or text.count("/") > 1 or Path(text).exists()
    if local and not Path(text).expanduser().exists():
        raise ValueError(f"SpecTrProcessorConfig: {key} {text!r} is a local path that does not exist")


def pool_size(concurrency: Any) -> dict[str, int]:
    """`ActorPoolStrategy`'s arguments: {"size": n}, or {"min_size": m, "max_size": n} for (m, n)."""
    if isinstance(concurrency, int) and not isinstance(concurrency, bool) and concurrency >= 1:
        return {"size": concurrency}
    if (isinstance(concurrency, (tuple, list)) and len(concurrency) == 2
            and all(isinstance(c, int) and c >= 1 for c in concurrency) and concurrency[0] <= concurrency[1]):
        return {"min_size": concurrency[0], "max_size": concurrency[1]}
    raise ValueError(f"SpecTrProcessorConfig: concurrency must be an int >= 1 or (min, max) with 1 <= min <= max, "
                     f"got {concurrency!r}")
