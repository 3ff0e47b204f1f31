"""The generation job's typed, validated configuration (`python -m jobs.generate`).

`from_omegaconf` (or `from_dict`) turns the composed config into a frozen `GenerateConfig`, checking
every key, type and range up front, and raises `JobInputError` naming the key and the bad value.
It also defines which settings change the generated rows (`generation_settings`), which is what the
output directory's config hash covers.

Not here: the shared sections and the typed builder (`pipeline.config`), the file system.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any

from pipeline.config import (
    MAX_RECORD_BYTES,
    DataConfig,
    MlflowConfig,
    ModelConfig,
    build_section,
    check_data,
    check_mapping,
    check_mlflow,
    check_model,
    coerce,
    out_of_range,
    require_sections,
    resolved_container,
)
from pipeline.errors import JobInputError
from pipeline.row_columns import JOB_KEYS, check_stop_list, job_settings

# data.max_samples in conf/data: the most samples (vLLM's n) one row may ask for. vLLM users ask for a few dozen
# at most (pass@k, best-of-n); one row's n sets the samples the plan places per prompt, so one outlier (n=10000)
# would cut every prompt into thousands of sample slots: a row over the cap is an error row instead.
DEFAULT_MAX_SAMPLES = 64
METHODS = ("auto", "autoregressive", "speculative", "block", "spectr", "specinfer", "traversal")


@dataclass(frozen=True)
class SpectrConfig:
    method: str = "auto"  # the planner picks the fastest exact method for this pair and hardware
    num_drafts: int = 4  # K of a fixed method (auto: see max_num_drafts)
    draft_length: int = 4  # L of a fixed method (auto: see max_draft_length)
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    batch_size: int = 8
    max_row_tokens: int | None = None  # memory: a row whose prompt + max_tokens exceeds this is an error row (None: no cap)
    seed: int = 0
    max_num_drafts: int | None = None  # auto: the largest K the planner may choose (None: 8)
    max_draft_length: int | None = None  # auto: the largest L the planner may choose (None: 8)
    plan_cache: bool = True  # auto: warm-start from what earlier runs on this pair and device learned
    num_samples: int = 1  # completions per prompt, one output row each (`sample_index`)
    stop: Any = None  # stop strings (a list): a completion ends before the first one it contains
    logprobs: Any = False  # true: a `completion_logprobs` column (logprobs_mode); an int N (vLLM's): also
    # `completion_top_logprobs`, each token's N most likely tokens (0: the column alone)
    logprobs_mode: str = "raw"  # raw: the target's log-softmax (vLLM's default); processed: the warped law's
    compile: Any = "auto"  # true | false | auto: Llama/Qwen2 forwards under torch.compile (spectr.native)
    # vLLM's SamplingParams names for every row (a row's sampling_params value replaces each): pipeline.row_columns
    structured_outputs: Any = None  # vLLM's structured_outputs for every row (json / regex / choice / grammar ...)
    min_p: float = 0.0  # 0 = off
    logit_bias: Any = None  # {token id: bias}, added to both models' logits first
    presence_penalty: float = 0.0  # in [-2, 2], 0 = off
    frequency_penalty: float = 0.0  # in [-2, 2], 0 = off
    repetition_penalty: float = 1.0  # > 0, 1 = off
    min_tokens: int = 0  # no EOS, stop token or stop string ends a row before this many tokens
    stop_token_ids: Any = None  # a list of token ids that end a row (finish_reason stop, stop_reason the id)
    ignore_eos: bool = False  # end-of-sequence does not end a row (stop_token_ids still do)
    include_stop_str_in_output: bool = False  # the completion keeps the stop string that ended it


@dataclass(frozen=True)
class RayConfig:
    address: str | None = None  # None: start a local Ray; "auto" or "host:port": join a cluster
    num_actors: int | None = None  # None: one per GPU, else cluster CPUs // cpus_per_actor
    gpus_per_actor: float | None = None  # None: 1 when the cluster has GPUs, else 0
    cpus_per_actor: int = 1
    max_restarts: int = 2  # restarts and replacements of an actor (it reloads the pair) per restart_window_s
    restart_window_s: float = 3600.0  # max_restarts counts those of the last this many seconds (a budget per window)
    max_task_retries: int = 0  # Ray's own re-runs of a task on a restarted actor (the driver re-queues instead)
    shard_attempts: int = 3  # the driver re-dispatches a shard whose task failed, up to this many tries
    shards_per_actor: int = 2  # shards queued on each actor, so that it never waits for the driver
    heartbeat_s: float = 5.0  # how often the driver pings each busy actor
    heartbeat_timeout_s: float = 30.0  # a busy actor that has not answered for this long is given up
    shard_timeout_s: float | None = None  # a shard running longer than this is given up (None: no limit)
    stall_timeout_s: float = 300.0  # a busy actor whose engine completes no iteration this long is replaced
    actor_start_timeout_s: float = 900.0  # actors (or restarts) not up by then are given up
    local_num_cpus: int | None = None  # CPUs of a local Ray instance (None: all)
    local_object_store_mb: int = 256


@dataclass(frozen=True)
class GenerateConfig:
    model: ModelConfig
    data: DataConfig
    spectr: SpectrConfig
    ray: RayConfig
    mlflow: MlflowConfig
    output_dir: str | None = None  # None: runs/generate-<config hash>; a path or a URI (s3://, gs://, ...)
    shard_size: int | None = None  # rows per part file; None: sized for the job (`shards.auto_shard_size`)
    max_failed_fraction: float = 0.0
    retry_failed: bool = True  # on resume, regenerate shards that have error rows
    lease_timeout_s: float = 60.0  # another job's lease without a heartbeat for this long is taken over
    progress: bool = True
    verbose: bool = False  # the libraries' INFO lines too (MLflow's store and system metrics, Ray's start)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "spectr": SpectrConfig,
    "ray": RayConfig,
    "mlflow": MlflowConfig,
}
_TOP_LEVEL = ("output_dir", "shard_size", "max_failed_fraction", "retry_failed", "lease_timeout_s", "progress")


def from_omegaconf(cfg: Any) -> GenerateConfig:
    """Resolve an OmegaConf/Hydra config and validate it into a `GenerateConfig`."""
    return from_dict(resolved_container(cfg))


def from_dict(raw: dict[str, Any]) -> GenerateConfig:
    """Validate a plain nested dict (as the YAML would give it) into a `GenerateConfig`."""
    top_fields = {f.name: f for f in fields(GenerateConfig)}
    check_mapping(raw, top_fields)
    require_sections(raw, tuple(_SECTIONS))
    sections = {name: build_section(cls, raw[name], prefix=name) for name, cls in _SECTIONS.items()}
    top = {name: coerce(raw[name], top_fields[name].type, name) for name in _TOP_LEVEL if name in raw}
    config = GenerateConfig(**sections, **top)
    check_spectr(config.spectr)
    check_model(config.model)
    check_data(config.data)
    check_ray(config.ray)
    _check_top_level(config)
    check_mlflow(config.mlflow)
    if config.spectr.method in ("speculative", "block") and config.spectr.num_drafts != 1:
        # speculative sampling and block verification are K = 1 methods by definition; say so in the config
        config = dataclasses.replace(config, spectr=dataclasses.replace(config.spectr, num_drafts=1))
    return config


def top_count(logprobs: Any) -> int | None:
    """spectr.logprobs as vLLM's count: N for an int N (0 included), 0 for true, None for false."""
    if isinstance(logprobs, bool):
        return 0 if logprobs else None
    return logprobs if isinstance(logprobs, int) else None


def logprobs_wanted(s: SpectrConfig) -> bool:
    """Whether rows get `completion_logprobs`: spectr.logprobs true, or an int N (vLLM's logprobs=N, 0 included)."""
    return top_count(s.logprobs) is not None


def top_logprobs(s: SpectrConfig) -> int:
    """N of spectr.logprobs=N: each token's N most likely tokens (`completion_top_logprobs`); 0 otherwise."""
    return top_count(s.logprobs) or 0


def check_spectr(s: SpectrConfig) -> None:
    if not (isinstance(s.logprobs, bool) or (isinstance(s.logprobs, int) and 0 <= s.logprobs <= 20)):
        raise out_of_range("spectr.logprobs", "true, false, or an int N in [0, 20] (N most likely tokens per token)",
                           s.logprobs)
    if s.logprobs_mode not in ("raw", "processed"):
        raise out_of_range("spectr.logprobs_mode", "raw (the target's log-softmax) or processed (the warped law)",
                           s.logprobs_mode)
    if s.method not in METHODS:
        raise out_of_range("spectr.method", f"one of {', '.join(METHODS)}", s.method)
    if s.num_drafts < 1:
        raise out_of_range("spectr.num_drafts (K)", ">= 1", s.num_drafts)
    if s.draft_length < 1:
        raise out_of_range("spectr.draft_length (L)", ">= 1", s.draft_length)
    if s.max_new_tokens < 1:
        raise out_of_range("spectr.max_new_tokens", ">= 1", s.max_new_tokens)
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise out_of_range("spectr.temperature", "a finite number >= 0 (0 means greedy)", s.temperature)
    if s.top_k < -1:
        raise out_of_range("spectr.top_k", ">= 0, or -1 (0 and -1 mean no top-k, as vLLM's)", s.top_k)
    if not (0.0 < s.top_p <= 1.0):
        raise out_of_range("spectr.top_p", "in (0, 1]", s.top_p)
    if s.batch_size < 1:
        raise out_of_range("spectr.batch_size", ">= 1", s.batch_size)
    if s.seed < 0:
        raise out_of_range("spectr.seed", ">= 0", s.seed)
    for key in ("max_num_drafts", "max_draft_length"):
        if getattr(s, key) is not None and getattr(s, key) < 1:
            raise out_of_range(f"spectr.{key}", ">= 1 or null (the planner's default, 8)", getattr(s, key))
    if s.num_samples < 1:
        raise out_of_range("spectr.num_samples", ">= 1", s.num_samples)
    check_stop_list(s.stop, "spectr.stop")
    try:
        values = job_settings(s)  # vLLM's names and ranges, as a row's sampling_params
    except ValueError as err:
        raise JobInputError(f"config: {err}") from None
    if values["min_tokens"] > s.max_new_tokens:
        raise out_of_range("spectr.min_tokens", f"<= spectr.max_new_tokens ({s.max_new_tokens}), as vLLM's "
                           f"min_tokens <= max_tokens", s.min_tokens)
    if not any(s.compile is choice for choice in (True, False)) and s.compile != "auto":
        raise out_of_range("spectr.compile", "true, false or auto", s.compile)


def check_ray(r: RayConfig) -> None:
    if r.num_actors is not None and r.num_actors < 1:
        raise out_of_range(
            "ray.num_actors", ">= 1 or null (one per GPU / per cpus_per_actor CPUs)", r.num_actors
        )
    if r.gpus_per_actor is not None and r.gpus_per_actor < 0:
        raise out_of_range("ray.gpus_per_actor", ">= 0 or null (auto)", r.gpus_per_actor)
    if r.cpus_per_actor < 1:
        raise out_of_range("ray.cpus_per_actor", ">= 1", r.cpus_per_actor)
    for key in ("max_restarts", "max_task_retries"):
        if getattr(r, key) < -1:
            raise out_of_range(f"ray.{key}", ">= -1 (-1 means unlimited)", getattr(r, key))
    if r.shard_attempts < 1:
        raise out_of_range("ray.shard_attempts", ">= 1", r.shard_attempts)
    if r.shards_per_actor < 1:
        raise out_of_range("ray.shards_per_actor", ">= 1", r.shards_per_actor)
    for key in ("heartbeat_s", "heartbeat_timeout_s", "stall_timeout_s", "actor_start_timeout_s",
                "restart_window_s"):
        if not getattr(r, key) > 0:
            raise out_of_range(f"ray.{key}", "> 0 seconds", getattr(r, key))
    if r.heartbeat_timeout_s < r.heartbeat_s:
        raise out_of_range("ray.heartbeat_timeout_s", f">= ray.heartbeat_s ({r.heartbeat_s:g})", r.heartbeat_timeout_s)
    if r.shard_timeout_s is not None and not r.shard_timeout_s > 0:
        raise out_of_range("ray.shard_timeout_s", "> 0 seconds or null", r.shard_timeout_s)
    if r.local_num_cpus is not None and r.local_num_cpus < 1:
        raise out_of_range("ray.local_num_cpus", ">= 1 or null", r.local_num_cpus)
    if r.local_object_store_mb < 80:
        raise out_of_range("ray.local_object_store_mb", ">= 80 (Ray's minimum)", r.local_object_store_mb)


def _check_top_level(c: GenerateConfig) -> None:
    if c.shard_size is not None and c.shard_size < 1:
        raise out_of_range("shard_size", ">= 1", c.shard_size)
    if not (0.0 <= c.max_failed_fraction <= 1.0):
        raise out_of_range("max_failed_fraction", "in [0, 1]", c.max_failed_fraction)
    if c.output_dir is not None and not c.output_dir.strip():
        raise out_of_range("output_dir", "a directory or null", c.output_dir)
    if not c.lease_timeout_s > 0:
        raise out_of_range("lease_timeout_s", "> 0 seconds", c.lease_timeout_s)
    if c.spectr.max_row_tokens is not None and c.spectr.max_row_tokens < 2:
        raise out_of_range("spectr.max_row_tokens", ">= 2 positions, or null", c.spectr.max_row_tokens)
    if c.data.max_samples is not None and c.data.max_samples < c.spectr.num_samples:
        raise out_of_range("data.max_samples", f">= spectr.num_samples ({c.spectr.num_samples}), the n of a row "
                           "without its own", c.data.max_samples)


def generation_settings(c: GenerateConfig) -> dict[str, Any]:
    """The settings that decide the generated rows: what the output directory's hash covers.

    Left out on purpose: where and how it runs (ray.*, spectr.batch_size: a row's output does not depend on
    its batch; spectr.plan_cache, spectr.compile), where it logs (mlflow.*), output_dir, progress, max_failed_fraction, retry_failed and
    lease_timeout_s. The plan adds the identity of the input files and of the models.
    """
    spectr = dataclasses.asdict(c.spectr)
    spectr.pop("batch_size")
    if spectr["max_row_tokens"] is None:
        spectr.pop("max_row_tokens")  # unset: the hash of output dirs written before the key
    spectr.pop("plan_cache")  # speed only: every configuration the planner may run is exact
    spectr.pop("compile")  # speed only: the same models' law (a compiled forward rounds differently, no more)
    data = dataclasses.asdict(c.data)
    for key in ("max_new_tokens_column", "keep_columns", "stop_column", "sampling_params_column", "chat_template",
                "chat_template_kwargs", "max_samples"):
        if data[key] is None:
            data.pop(key)  # unset, the hash is the one output dirs written before the key existed
    if data.get("max_samples") == DEFAULT_MAX_SAMPLES:
        data.pop("max_samples")  # at its default, likewise (rows' own n up to it place as before)
    if data["max_record_bytes"] == MAX_RECORD_BYTES:
        data.pop("max_record_bytes")  # likewise at its default
    if not logprobs_wanted(c.spectr):
        spectr.pop("logprobs_mode")  # no column: the mode decides nothing
    for key, default in (("num_samples", 1), ("stop", None), ("logprobs", False)):
        if spectr[key] == default:
            spectr.pop(key)
    for key, value in job_settings(c.spectr).items():
        off = JOB_KEYS[key]
        if value == off or (not value and not off):  # off: the hash of output dirs written before the key
            spectr.pop(key)
        else:
            spectr[key] = value  # as the rows read it: logit_bias as (id, bias) pairs, whatever the keys' type
    return {
        "model": {"target": c.model.target, "draft": c.model.draft, "dtype": c.model.dtype},
        "data": data,
        "spectr": spectr,
        "shard_size": c.shard_size,
    }
