"""`SpecTrProcessorConfig`: what the Ray Data stage runs, with `ray.data.llm`'s processor-config fields.

    config = SpecTrProcessorConfig(model_source="assets/models/target", draft_model_source="assets/models/draft",
                                   batch_size=32, concurrency=2, engine_kwargs={"method": "spectr", "num_drafts": 2})

The fields of `ray.data.llm.vLLMEngineProcessorConfig` (Ray 2.60) with Ray's defaults and meanings where the
stage can honour them: `model_source`, `batch_size` (rows per Ray Data batch), `concurrency` (n: an
autoscaling pool of 1..n actors; (m, n): m..n; (n, n): fixed), `accelerator_type`, `runtime_env`,
`max_concurrent_batches`, `max_tasks_in_flight_per_actor`, `should_continue_on_error`, the per-stage
settings `chat_template_stage`, `tokenize_stage`, `detokenize_stage` (bool, dict, or Ray's stage config
objects), `task_type` ("generate"), the older `apply_chat_template` (True, as Ray's was), and Ray's
`prepare_multimodal_stage`, `placement_group_config`, `dynamic_lora_loading_path` at their defaults only. Plus the
draft's directory and `engine_kwargs`: the engine's settings by the Hydra job's names (`spectr.*`: `method`,
`num_drafts`, `draft_length`, `batch_size` rows in flight per actor, `max_num_drafts`, `max_draft_length`,
`seed`, the row defaults `max_new_tokens`, `temperature`, `top_k`, `top_p`, ... and `compile`; `model.*`:
`dtype`, `trust_remote_code`, `allow_pickle`, `device_map`), `max_logprobs` (vLLM's: the most alternatives a
row's `logprobs=N` may ask), and vLLM engine settings: those with no use here are accepted with one warning
naming them (`VLLM_IGNORED`), `max_num_seqs` is the engine's rows in flight, and those that would change the
output's meaning are refused with the reason (`VLLM_REFUSED`). Everything is checked here, on the driver
(`ValueError`, before any actor starts), by the job's own checks.

Not here: running anything (`pipeline.ray_data.processor`, `pipeline.ray_data.stage`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from pipeline.config import DataConfig, ModelConfig, check_model
from pipeline.generate.config import SpectrConfig, check_spectr

log = logging.getLogger("pipeline")
_warned: set[str] = set()  # warnings given in this process (a config copied by dataclasses.replace is checked again)


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)

# engine_kwargs that are not `spectr.*` settings: the models' (`model.*`)
MODEL_KEYS = ("dtype", "trust_remote_code", "allow_pickle", "device_map")
# `spectr.*` settings a row sets for itself instead (sampling_params) or that the stage fixes
NOT_ENGINE_KEYS = ("num_samples", "stop", "logprobs", "plan_cache")
# the stage's own engine_kwargs: vLLM's names with vLLM's meaning
STAGE_KEYS = ("max_logprobs", "max_num_seqs")
SAMPLING_PARAMS_COLUMN = "sampling_params"
# rows in flight per actor (the engine's batch) when engine_kwargs has no batch_size: a GPU is filled by more rows
# (a guess until a GPU run measures it); a CPU forward costs about in proportion to its rows
ENGINE_BATCH_SIZE = {"gpu": 64, "cpu": 8}
# vLLM engine settings with no use here and no effect on what a row's output means (a memory or scheduling
# knob of vLLM's own engine, its logging, or a value this engine has anyway): accepted, one warning names them
VLLM_IGNORED = (
    "max_model_len", "enable_chunked_prefill", "max_num_batched_tokens", "gpu_memory_utilization",
    "enable_prefix_caching", "enforce_eager", "disable_log_stats", "swap_space", "block_size", "cpu_offload_gb",
    "max_seq_len_to_capture", "disable_custom_all_reduce", "distributed_executor_backend", "load_format",
    "tokenizer_mode", "served_model_name", "compilation_config", "limit_mm_per_prompt", "task_type",
    "max_num_partial_prefills", "long_prefill_token_threshold", "scheduling_policy", "async_scheduling",
    "disable_log_requests", "enable_log_requests", "worker_cls", "model_impl",
)
# vLLM engine settings whose value here would change the output's meaning: refused (their neutral values pass)
VLLM_REFUSED = {
    "quantization": ("quantized weights are another model than model_source's", (None,)),
    "kv_cache_dtype": ("a lower-precision KV cache changes the target's law", (None, "auto")),
    "speculative_config": ("SpecTr is the speculative decoding here: the draft is draft_model_source", (None,)),
    "enable_lora": ("LoRA adapters are another model than model_source's", (None, False)),
    "tensor_parallel_size": ("split the target over an actor's GPUs with num_gpus=N and engine_kwargs "
                             "device_map='auto' instead", (None, 1)),
    "pipeline_parallel_size": ("split the target over an actor's GPUs with num_gpus=N and engine_kwargs "
                               "device_map='auto' instead", (None, 1)),
    "revision": ("the model is model_source's directory as it is", (None,)),
    "tokenizer_revision": ("the tokenizer is model_source's as it is", (None,)),
    "hf_overrides": ("overriding the model's config changes the model", (None, {})),
    "rope_scaling": ("overriding the model's config changes the model", (None, {})),
    "logits_processors": ("arbitrary logits processors cannot be applied identically to the draft tree's "
                          "nodes", (None, [])),
    "generation_config": ("the rows' sampling_params and engine_kwargs are the sampling defaults here "
                          "(no generation_config.json defaults)", (None, "vllm")),
}
# Ray's per-stage settings: which keys each takes (the resource ones are Ray Data map settings)
STAGE_RESOURCE_KEYS = ("batch_size", "concurrency", "runtime_env", "num_cpus", "memory")
STAGE_CONFIG_KEYS = {
    "chat_template_stage": ("enabled", "model_source", "chat_template", "chat_template_kwargs") + STAGE_RESOURCE_KEYS,
    "tokenize_stage": ("enabled", "model_source") + STAGE_RESOURCE_KEYS,
    "detokenize_stage": ("enabled", "model_source") + STAGE_RESOURCE_KEYS,
}


def engine_keys() -> tuple[str, ...]:
    """Every key `engine_kwargs` takes with a meaning here (the engine's `SpectrConfig` fields as this checkout
    has them, the models', the stage's); vLLM's other engine settings are `VLLM_IGNORED` or `VLLM_REFUSED`."""
    spectr = tuple(f.name for f in dataclasses.fields(SpectrConfig) if f.name not in NOT_ENGINE_KEYS)
    return spectr + MODEL_KEYS + STAGE_KEYS


@dataclass(frozen=True)
class StageSettings:
    """One of Ray's per-stage settings, resolved: whether it runs and what it renders with. The stage's
    actor does all of them (templating, tokenizing, detokenizing around the engine), so the resource keys
    of Ray's stage configs have no stage of their own to apply to: accepted, and named in one warning."""

    enabled: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    model_source: str | None = None
    resources: tuple[str, ...] = ()  # the resource keys the user set (not applied: see the class docstring)


def stage_settings(name: str, value: Any) -> StageSettings:
    """Ray's stage config value (bool, dict, or one of `ray.data.llm`'s `*StageConfig` objects) resolved."""
    if isinstance(value, StageSettings):
        return value
    if isinstance(value, bool):
        return StageSettings(enabled=value)
    if hasattr(value, "model_dump"):  # ray.data.llm.ChatTemplateStageConfig and its siblings (pydantic)
        value = {k: v for k, v in value.model_dump().items() if v is not None}
    if not isinstance(value, dict):
        raise ValueError(f"SpecTrProcessorConfig: {name} must be a bool, a dict or a ray.data.llm stage config, "
                         f"got {type(value).__name__}")
    known = STAGE_CONFIG_KEYS[name]
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"SpecTrProcessorConfig: {name}: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
    kwargs = value.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(f"SpecTrProcessorConfig: {name}.chat_template_kwargs must be a dict, got {kwargs!r}")
    return StageSettings(enabled=bool(value.get("enabled", True)), chat_template=value.get("chat_template"),
                         chat_template_kwargs=kwargs, model_source=value.get("model_source"),
                         resources=tuple(k for k in STAGE_RESOURCE_KEYS if value.get(k) is not None))


def stage_enabled(value: Any) -> bool:
    """Whether one of Ray's stage config values turns its stage on (a bool, a dict or a stage config object)."""
    if isinstance(value, bool):
        return value
    if hasattr(value, "model_dump"):
        value = value.model_dump()
    return bool(value.get("enabled", True)) if isinstance(value, dict) else bool(value)


@dataclass(frozen=True)
class SpecTrProcessorConfig:
    """The SpecTr stage of a Ray Data pipeline: one draft/target pair and one continuous batch per actor."""

    model_source: str  # the target's directory (as the job's model.target)
    draft_model_source: str  # the draft's directory (model.draft): same tokenizer and vocabulary
    batch_size: int = 32  # rows per Ray Data batch (the engine's rows in flight are engine_kwargs' batch_size)
    concurrency: int | tuple[int, int] = 1  # as Ray's: n: an autoscaling pool of 1..n actors; (m, n): m..n
    accelerator_type: str | None = None  # e.g. "H100": each actor takes GPUs of that type
    num_gpus: int = 1  # GPUs per actor where there are GPUs; > 1 with engine_kwargs device_map="auto" splits the target
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    runtime_env: dict[str, Any] | None = None  # the actors' Ray runtime_env (working_dir, py_modules, env_vars, ...)
    apply_chat_template: bool = True  # a row with `messages` is rendered with the chat template (Ray's default)
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": False}
    chat_template_stage: Any = True  # Ray's: bool | dict | ray.data.llm.ChatTemplateStageConfig
    tokenize_stage: Any = True  # Ray's: True writes `tokenized_prompt`; False: rows may bring `tokenized_prompt`
    detokenize_stage: Any = True  # Ray's: True decodes generated_text from the tokens, skipping special tokens
    prepare_multimodal_stage: Any = False  # Ray's; the engine is text-only: only off
    placement_group_config: dict[str, Any] | None = None  # Ray's (vLLM's TP/PP workers): only None (see num_gpus)
    dynamic_lora_loading_path: str | None = None  # Ray's (LoRA adapters): only None
    max_concurrent_batches: int = 4  # at most this many Ray Data batches per actor at once (`batches_in_flight`)
    max_tasks_in_flight_per_actor: int | None = None  # Ray's; None: `batches_in_flight()`
    max_pending_requests: int | None = None  # Ray's; the engine's rows in flight are engine_kwargs batch_size
    should_continue_on_error: bool = False  # True: a failed row carries `__inference_error__`, the rest go on
    task_type: str = "generate"  # Ray's; the stage generates (no embedding or classification tasks)
    log_engine_metrics: bool = True  # Ray's (vLLM's Prometheus metrics): this engine exports none
    num_cpus: float | None = None  # CPUs per actor without a GPU (its torch threads); None: 1

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"SpecTrProcessorConfig: batch_size must be an int >= 1, got {self.batch_size!r}")
        pool_size(self.concurrency)
        for key in ("max_concurrent_batches", "max_tasks_in_flight_per_actor", "max_pending_requests"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"SpecTrProcessorConfig: {key} must be an int >= 1, got {value!r}")
        if not isinstance(self.num_gpus, int) or self.num_gpus < 1:
            raise ValueError(f"SpecTrProcessorConfig: num_gpus must be an int >= 1, got {self.num_gpus!r}")
        if self.num_cpus is not None and not self.num_cpus > 0:
            raise ValueError(f"SpecTrProcessorConfig: num_cpus must be > 0 or None, got {self.num_cpus!r}")
        if self.task_type != "generate":
            raise ValueError(f"SpecTrProcessorConfig: task_type {self.task_type!r}: the SpecTr stage generates "
                             "(task_type='generate'); embedding and classification are not speculative decoding")
        if self.runtime_env is not None and not isinstance(self.runtime_env, dict):
            raise ValueError(f"SpecTrProcessorConfig: runtime_env must be a dict or None, got {self.runtime_env!r}")
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
            raise ValueError("SpecTrProcessorConfig: chat_template_kwargs must be a dict or None, "
                             f"got {self.chat_template_kwargs!r}")
        refused = {
            "prepare_multimodal_stage": (stage_enabled(self.prepare_multimodal_stage),
                                         "multimodal rows: the SpecTr stage generates from text"),
            "placement_group_config": (self.placement_group_config is not None,
                                       "an actor's GPUs are num_gpus (the target split over them with engine_kwargs "
                                       "device_map='auto'), their type accelerator_type"),
            "dynamic_lora_loading_path": (self.dynamic_lora_loading_path is not None,
                                          "LoRA adapters are another model than model_source's"),
        }
        for key, (set_, reason) in refused.items():
            if set_:
                raise ValueError(f"SpecTrProcessorConfig: {key}={getattr(self, key)!r} is not supported: {reason}")
        stages = {name: stage_settings(name, getattr(self, name)) for name in STAGE_CONFIG_KEYS}
        for name, stage in stages.items():
            if stage.model_source is not None and str(stage.model_source) != str(self.model_source):
                raise ValueError(f"SpecTrProcessorConfig: {name}.model_source {stage.model_source!r} is not "
                                 f"model_source {self.model_source!r}: the stage renders, tokenizes and decodes "
                                 "with the target's own tokenizer (one tokenizer for the pair)")
        check_engine_kwargs(self.engine_kwargs)
        for key in ("model_source", "draft_model_source"):
            missing_local_path(key, getattr(self, key))
        check_model(self.model_config())
        check_spectr(self.spectr_config())
        max_logprobs = self.engine_kwargs.get("max_logprobs", 0)
        if isinstance(max_logprobs, bool) or not isinstance(max_logprobs, int) or not 0 <= max_logprobs <= 20:
            raise ValueError(f"SpecTrProcessorConfig: engine_kwargs max_logprobs must be an int in [0, 20], "
                             f"got {max_logprobs!r}")
        resources = sorted(f"{name}.{key}" for name, stage in stages.items() for key in stage.resources)
        if resources:
            warn_once(f"SpecTrProcessorConfig: {', '.join(resources)} not applied: the SpecTr actor templates, "
                      "tokenizes and decodes its rows itself (one stage, its resources those of the actor)")

    def stage(self, name: str) -> StageSettings:
        """One of Ray's per-stage settings, resolved (`chat_template_stage`, `tokenize_stage`, `detokenize_stage`)."""
        return stage_settings(name, getattr(self, name))

    def chat(self) -> StageSettings:
        """The chat template stage as it runs: enabled by both `apply_chat_template` and `chat_template_stage`;
        its template variables: the stage's own, else the config's `chat_template_kwargs`."""
        stage = self.stage("chat_template_stage")
        kwargs = stage.chat_template_kwargs if stage.chat_template_kwargs is not None else self.chat_template_kwargs
        return dataclasses.replace(stage, enabled=bool(self.apply_chat_template and stage.enabled),
                                   chat_template_kwargs=kwargs)

    def model_config(self) -> ModelConfig:
        """The job's `model.*` section for this pair."""
        own = {k: v for k, v in self.engine_kwargs.items() if k in MODEL_KEYS}
        return ModelConfig(target=str(self.model_source), draft=str(self.draft_model_source), **own)

    def spectr_config(self, gpu: bool = False) -> SpectrConfig:
        """The job's `spectr.*` section: the engine_kwargs, with each token's log-probability kept (a row's
        `sampling_params.logprobs` decides whether its `logprobs` is filled) and the top `max_logprobs` where
        that is set. Rows in flight: engine_kwargs `batch_size`, else vLLM's `max_num_seqs`, else
        `ENGINE_BATCH_SIZE` for the device (`gpu`)."""
        own = {k: v for k, v in self.engine_kwargs.items() if k in engine_keys() and k not in MODEL_KEYS + STAGE_KEYS}
        if "max_num_seqs" in self.engine_kwargs:
            own.setdefault("batch_size", self.engine_kwargs["max_num_seqs"])
        own.setdefault("batch_size", ENGINE_BATCH_SIZE["gpu" if gpu else "cpu"])
        spectr = SpectrConfig(**{**own, "logprobs": self.engine_kwargs.get("max_logprobs") or True})
        if spectr.method in ("speculative", "block"):
            spectr = dataclasses.replace(spectr, num_drafts=1)  # K = 1 methods, as the job's config says
        return spectr

    def max_logprobs(self) -> int:
        """The most alternatives per token a row's `logprobs=N` may ask (vLLM's engine setting)."""
        return int(self.engine_kwargs.get("max_logprobs") or 0)

    def batches_in_flight(self, gpu: bool = False) -> int:
        """Ray Data batches an actor holds at once: enough rows to fill its engine's slots (rows in flight,
        engine_kwargs `batch_size`) plus one batch to refill them as rows finish, at most
        `max_concurrent_batches`. More would only sit in the actor: the first actor to load would hold the
        batches that another, ready a moment later, could run (4 batches of 32 rows on 2 actors of 8 slots
        went 4 and 0 with the bound at 4)."""
        slots = self.spectr_config(gpu).batch_size
        return min(self.max_concurrent_batches, -(-slots // self.batch_size) + 1)

    def data_config(self) -> DataConfig:
        """The job's `data.*` rules for the actor: the sampling_params column (the stage renders chat rows itself,
        row by row: a batch may mix `messages` and `prompt` rows)."""
        return DataConfig(path="", sampling_params_column=SAMPLING_PARAMS_COLUMN)


def check_engine_kwargs(engine_kwargs: Any) -> None:
    """engine_kwargs: known keys pass; vLLM's `VLLM_REFUSED` ones with a meaning-changing value are refused with
    the reason; vLLM's `VLLM_IGNORED` ones are named in one warning; anything else is refused."""
    if not isinstance(engine_kwargs, dict):
        raise ValueError(f"SpecTrProcessorConfig: engine_kwargs must be a dict, got {type(engine_kwargs).__name__}")
    refused = [f"{key}={engine_kwargs[key]!r} ({reason})" for key, (reason, neutral) in VLLM_REFUSED.items()
               if key in engine_kwargs and engine_kwargs[key] not in neutral]
    if refused:
        raise ValueError(f"SpecTrProcessorConfig: engine_kwargs {'; '.join(refused)}")
    known = set(engine_keys()) | set(VLLM_IGNORED) | set(VLLM_REFUSED) | {"model", "tokenizer"}
    unknown = sorted(set(engine_kwargs) - known)
    if unknown:
        raise ValueError(f"SpecTrProcessorConfig: unknown engine_kwargs {', '.join(unknown)}; known: "
                         f"{', '.join(engine_keys())} (and vLLM's engine settings: {', '.join(VLLM_IGNORED)} are "
                         "accepted and unused; per-row settings go in the rows' sampling_params)")
    for key in ("model", "tokenizer"):  # vLLM's: the model is model_source, its tokenizer the target's
        if engine_kwargs.get(key) is not None:
            raise ValueError(f"SpecTrProcessorConfig: engine_kwargs {key}={engine_kwargs[key]!r}: the target is "
                             "model_source, with its own tokenizer (remove it from engine_kwargs)")
    ignored = sorted(set(engine_kwargs) & set(VLLM_IGNORED))
    if ignored:
        warn_once(f"SpecTrProcessorConfig: engine_kwargs {', '.join(ignored)} are vLLM engine settings with no use "
                  "in the SpecTr engine: ignored")


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
    """`ActorPoolStrategy`'s arguments, as `ray.data.llm`'s engine stages take `concurrency`: n -> an
    autoscaling pool {"min_size": 1, "max_size": n}; (m, n) -> {"min_size": m, "max_size": n}; (n, n) is a
    fixed pool of n."""
    if isinstance(concurrency, int) and not isinstance(concurrency, bool) and concurrency >= 1:
        return {"min_size": 1, "max_size": concurrency}
    if (isinstance(concurrency, (tuple, list)) and len(concurrency) == 2
            and all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in concurrency)
            and concurrency[0] <= concurrency[1]):
        return {"min_size": concurrency[0], "max_size": concurrency[1]}
    raise ValueError(f"SpecTrProcessorConfig: concurrency must be an int >= 1 or (min, max) with 1 <= min <= max, "
                     f"got {concurrency!r}")
