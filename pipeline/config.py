"""Typed, validated job configuration: the edge where Hydra/OmegaConf becomes plain dataclasses.

`from_omegaconf` (or `from_dict`) turns the composed config into a frozen `GenerateConfig`, checking
every key, type and range up front, and raises `JobInputError` naming the key and the bad value. The
rest of the pipeline sees only these dataclasses, never OmegaConf.

This module does not touch the file system (paths are checked in `pipeline.io` and `pipeline.models`).
It also defines which settings change the generated rows (`generation_settings`), which is what the
output directory's config hash covers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pipeline.errors import JobInputError

PROJECT_ROOT = Path(__file__).resolve().parents[1]

METHODS = ("autoregressive", "speculative", "spectr", "specinfer")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DATA_FORMATS = ("auto", "parquet", "jsonl", "csv", "hf_disk")


@dataclass(frozen=True)
class ModelConfig:
    target: str
    draft: str
    dtype: str = "float32"
    allow_pickle: bool = False  # load .bin/.pt weights (pickle can run code); off by default
    trust_remote_code: bool = False


@dataclass(frozen=True)
class DataConfig:
    path: str
    format: str = "auto"
    prompt_column: str = "prompt"
    id_column: str = "id"  # when absent from the data, the row number is the id
    limit: int | None = None  # first N rows
    chat: bool = False  # apply the target tokenizer's chat template to `messages_column`
    messages_column: str = "messages"
    add_special_tokens: bool = True


@dataclass(frozen=True)
class SpectrConfig:
    method: str = "spectr"
    num_drafts: int = 4
    draft_length: int = 4
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    batch_size: int = 8
    seed: int = 0


@dataclass(frozen=True)
class RayConfig:
    address: str | None = None  # None: start a local Ray; "auto" or "host:port": join a cluster
    num_actors: int | None = None  # None: one per GPU, else cluster CPUs // cpus_per_actor
    gpus_per_actor: float | None = None  # None: 1 when the cluster has GPUs, else 0
    cpus_per_actor: int = 1
    max_restarts: int = 2  # Ray restarts a dead actor this many times
    max_task_retries: int = 2  # and re-runs its unfinished shard on the restarted actor
    shard_attempts: int = 3  # the driver re-dispatches a shard whose task failed, up to this many tries
    local_num_cpus: int | None = None  # CPUs of a local Ray instance (None: all)
    local_object_store_mb: int = 256


@dataclass(frozen=True)
class MlflowConfig:
    enabled: bool = True
    tracking_uri: str | None = None  # None: sqlite:///<cwd>/mlflow.db
    experiment: str = "spectr-generate"
    run_name: str | None = None


@dataclass(frozen=True)
class GenerateConfig:
    model: ModelConfig
    data: DataConfig
    spectr: SpectrConfig
    ray: RayConfig
    mlflow: MlflowConfig
    output_dir: str | None = None  # None: runs/generate-<config hash>
    shard_size: int = 16
    max_failed_fraction: float = 0.0
    progress: bool = True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "spectr": SpectrConfig,
    "ray": RayConfig,
    "mlflow": MlflowConfig,
}


def resolved_container(cfg: Any) -> dict[str, Any]:
    """An OmegaConf/Hydra config as a plain resolved dict, without Hydra's own `hydra` node."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        container = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        raise JobInputError(f"config: {err}") from None
    container.pop("hydra", None)
    return container


def from_omegaconf(cfg: Any) -> GenerateConfig:
    """Resolve an OmegaConf/Hydra config and validate it into a `GenerateConfig`."""
    return from_dict(resolved_container(cfg))


def from_dict(raw: dict[str, Any]) -> GenerateConfig:
    """Validate a plain nested dict (as the YAML would give it) into a `GenerateConfig`."""
    if not isinstance(raw, dict):
        raise JobInputError(f"config: expected a mapping, got {type(raw).__name__}")
    top_fields = {f.name: f for f in fields(GenerateConfig)}
    unknown = sorted(set(raw) - set(top_fields))
    if unknown:
        raise JobInputError(f"config: unknown key(s) {', '.join(unknown)}; known: {', '.join(top_fields)}")
    sections = {}
    for name, cls in _SECTIONS.items():
        if name not in raw or raw[name] is None:
            raise JobInputError(f"config: missing section '{name}'")
        sections[name] = build_section(cls, raw[name], prefix=name)
    top = {}
    for name in ("output_dir", "shard_size", "max_failed_fraction", "progress"):
        if name in raw:
            top[name] = _coerce(raw[name], top_fields[name].type, name)
    config = GenerateConfig(**sections, **top)
    _check_ranges(config)
    if config.spectr.method == "speculative" and config.spectr.num_drafts != 1:
        # speculative sampling is the K = 1 method by definition; say so in the resolved config
        config = dataclasses.replace(config, spectr=dataclasses.replace(config.spectr, num_drafts=1))
    return config


def build_section(cls: type, raw: Any, prefix: str, nested: dict[str, type] | None = None) -> Any:
    """Check a mapping against the dataclass `cls` (known keys, types from the annotations) and build it.

    nested: fields that are themselves dataclass sections, built the same way under `prefix.field`.
    """
    if not isinstance(raw, dict):
        raise JobInputError(f"config: '{prefix}' must be a mapping, got {type(raw).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise JobInputError(
            f"config: unknown key(s) {', '.join(prefix + '.' + k for k in unknown)}; "
            f"'{prefix}' takes: {', '.join(known)}"
        )
    values = {}
    for name, field in known.items():
        key = f"{prefix}.{name}"
        if name in raw:
            if nested and name in nested:
                values[name] = build_section(nested[name], raw[name], key)
            else:
                values[name] = _coerce(raw[name], field.type, key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise JobInputError(f"config: {key} is required")
    return cls(**values)


def _coerce(value: Any, type_name: str, key: str) -> Any:
    """Check `value` against the annotation string (e.g. 'int | None', 'tuple[int, ...]') and return it."""
    text = str(type_name)
    if text.startswith("tuple[") and text.endswith(", ...]"):
        item = text[len("tuple[") : -len(", ...]")]
        if not isinstance(value, (list, tuple)) or not value:
            raise JobInputError(f"config: {key} must be a non-empty list of {item}s, got {value!r}")
        return tuple(_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value))
    allowed = [t.strip() for t in text.split("|")]
    if value is None:
        if "None" in allowed:
            return None
        raise JobInputError(f"config: {key} must not be null")
    for t in allowed:
        if t == "bool" and isinstance(value, bool):
            return value
        if t == "int" and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if t == "str" and isinstance(value, str):
            return value
    wanted = " or ".join("null" if t == "None" else t for t in allowed)
    raise JobInputError(f"config: {key} must be {wanted}, got {value!r} ({type(value).__name__})")


def _check_ranges(c: GenerateConfig) -> None:
    def bad(key: str, rule: str, value: Any) -> JobInputError:
        return JobInputError(f"config: {key} must be {rule}, got {value!r}")

    s = c.spectr
    if s.method not in METHODS:
        raise bad("spectr.method", f"one of {', '.join(METHODS)}", s.method)
    if s.num_drafts < 1:
        raise bad("spectr.num_drafts (K)", ">= 1", s.num_drafts)
    if s.draft_length < 1:
        raise bad("spectr.draft_length (L)", ">= 1", s.draft_length)
    if s.max_new_tokens < 1:
        raise bad("spectr.max_new_tokens", ">= 1", s.max_new_tokens)
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise bad("spectr.temperature", "a finite number >= 0 (0 means greedy)", s.temperature)
    if s.top_k < 0:
        raise bad("spectr.top_k", ">= 0 (0 means no top-k)", s.top_k)
    if not (0.0 < s.top_p <= 1.0):
        raise bad("spectr.top_p", "in (0, 1]", s.top_p)
    if s.batch_size < 1:
        raise bad("spectr.batch_size", ">= 1", s.batch_size)
    if s.seed < 0:
        raise bad("spectr.seed", ">= 0", s.seed)

    if c.model.dtype not in DTYPES:
        raise bad("model.dtype", f"one of {', '.join(DTYPES)}", c.model.dtype)
    for key, path in (("model.target", c.model.target), ("model.draft", c.model.draft)):
        if not path.strip():
            raise bad(key, "a model directory", path)

    d = c.data
    if not d.path.strip():
        raise bad("data.path", "a file or directory", d.path)
    if d.format not in DATA_FORMATS:
        raise bad("data.format", f"one of {', '.join(DATA_FORMATS)}", d.format)
    if d.limit is not None and d.limit < 1:
        raise bad("data.limit", ">= 1 or null (all rows)", d.limit)

    r = c.ray
    if r.num_actors is not None and r.num_actors < 1:
        raise bad("ray.num_actors", ">= 1 or null (one per GPU / per cpus_per_actor CPUs)", r.num_actors)
    if r.gpus_per_actor is not None and r.gpus_per_actor < 0:
        raise bad("ray.gpus_per_actor", ">= 0 or null (auto)", r.gpus_per_actor)
    if r.cpus_per_actor < 1:
        raise bad("ray.cpus_per_actor", ">= 1", r.cpus_per_actor)
    for key in ("max_restarts", "max_task_retries"):
        if getattr(r, key) < -1:
            raise bad(f"ray.{key}", ">= -1 (-1 means unlimited)", getattr(r, key))
    if r.shard_attempts < 1:
        raise bad("ray.shard_attempts", ">= 1", r.shard_attempts)
    if r.local_num_cpus is not None and r.local_num_cpus < 1:
        raise bad("ray.local_num_cpus", ">= 1 or null", r.local_num_cpus)
    if r.local_object_store_mb < 80:
        raise bad("ray.local_object_store_mb", ">= 80 (Ray's minimum)", r.local_object_store_mb)

    if c.shard_size < 1:
        raise bad("shard_size", ">= 1", c.shard_size)
    if not (0.0 <= c.max_failed_fraction <= 1.0):
        raise bad("max_failed_fraction", "in [0, 1]", c.max_failed_fraction)
    if c.output_dir is not None and not c.output_dir.strip():
        raise bad("output_dir", "a directory or null", c.output_dir)
    if not c.mlflow.experiment.strip():
        raise bad("mlflow.experiment", "a non-empty name", c.mlflow.experiment)


def generation_settings(c: GenerateConfig) -> dict[str, Any]:
    """The settings that decide the generated rows: what the output directory's hash covers.

    Left out on purpose: where and how it runs (ray.*, spectr.batch_size: a row's output does not depend on
    its batch), where it logs (mlflow.*), output_dir, progress and max_failed_fraction.
    """
    spectr = dataclasses.asdict(c.spectr)
    spectr.pop("batch_size")
    return {
        "model": {"target": c.model.target, "draft": c.model.draft, "dtype": c.model.dtype},
        "data": dataclasses.asdict(c.data),
        "spectr": spectr,
        "shard_size": c.shard_size,
    }


def stable_hash(obj: Any) -> str:
    """sha256 of the canonical JSON of `obj` (sorted keys), as hex."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}"""
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, prefix=name + "."))
        else:
            out[name] = value
    return out


def _register_resolvers() -> None:
    from omegaconf import OmegaConf

    # ${project_root:} is the repository root, so that the default config finds assets/ from any cwd.
    OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT), replace=True)


_register_resolvers()
