"""Typed config building shared by the jobs: the edge where Hydra/OmegaConf becomes plain dataclasses.

`build_section` checks a mapping against a dataclass (known keys, types from the annotations) and raises
`JobInputError` naming the key and the bad value. The sections every job takes (`model`, `data`,
`mlflow`) live here with their range checks (`shared_sections`), so the generation and the benchmark job
accept the same values. The rest of the code sees only these dataclasses, never OmegaConf.

Not here: each job's own sections and rules (`pipeline.generate.config`, `pipeline.benchmark.config`);
the file system (paths are checked in `pipeline.prompts` and `pipeline.models`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pipeline.errors import JobInputError

PROJECT_ROOT = Path(__file__).resolve().parents[1]

DTYPES = ("auto", "float32", "bfloat16", "float16")
DATA_FORMATS = ("auto", "parquet", "jsonl", "csv", "hf_disk")
MAX_RECORD_BYTES = 4 << 20  # data.max_record_bytes' default


@dataclass(frozen=True)
class ModelConfig:
    target: str
    draft: str
    dtype: str = "auto"  # bfloat16 on CUDA (when supported), float32 on CPU
    allow_pickle: bool = False  # load .bin/.pt weights (pickle can run code); off by default
    trust_remote_code: bool = False
    device_map: str | None = None  # "auto": the target's placement plan over the actor's GPUs (pipeline.placement)


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
    max_new_tokens_column: str | None = None  # each row's budget from this integer column (None: spectr.max_new_tokens)
    keep_columns: Any = None  # input columns carried to the output unchanged: a list of names, or "all"
    stop_column: str | None = None  # each row's stop strings (a list of strings, or one string)
    sampling_params_column: str | None = None  # per-row settings: a struct or JSON object (see pipeline.row_columns)
    max_samples: int | None = None  # a cap on per-row n (vLLM's `n` in sampling_params_column); None: the scan's largest
    chat_template: str | None = None  # chat mode: a Jinja template (a file path or the template itself)
    chat_template_kwargs: Any = None  # chat mode: extra variables for the template, e.g. {enable_thinking: false}
    max_record_bytes: int = MAX_RECORD_BYTES  # JSONL/CSV: a longer record is an error row, never read whole


@dataclass(frozen=True)
class MlflowConfig:
    enabled: bool = True
    tracking_uri: str | None = None  # None: sqlite:///<cwd>/mlflow.db
    experiment: str = "spectr-generate"
    run_name: str | None = None
    parent_run_id: str | None = None  # nest the run under this one (a sweep sets it for each cell)
    log_every_s: float = 5.0  # live metrics while a job runs: one point at most this often (<= 30 s)
    system_metrics: bool = True  # MLflow's system-metrics monitor on the driver (CPU, memory, GPU)
    system_metrics_interval_s: float = 10.0  # its sampling period
    shutdown_timeout_s: float = 10.0  # at a job's end, the most it waits for MLflow (queued points; the final logging)
    required: bool = False  # true: a server that does not answer at the start refuses the job (exit 2)


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


def check_mapping(raw: Any, known: set[str] | dict) -> None:
    """The top level of a job's config: a mapping with only known keys."""
    if not isinstance(raw, dict):
        raise JobInputError(f"config: expected a mapping, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise JobInputError(f"config: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")


def require_sections(raw: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        if name not in raw or raw[name] is None:
            raise JobInputError(f"config: missing section '{name}'")


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
                values[name] = coerce(raw[name], field.type, key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise JobInputError(f"config: {key} is required")
    return cls(**values)


def coerce(value: Any, type_name: str, key: str) -> Any:
    """Check `value` against the annotation string (e.g. 'int | None', 'tuple[int, ...]') and return it."""
    text = str(type_name)
    if text.startswith("tuple[") and text.endswith(", ...]"):
        item = text[len("tuple[") : -len(", ...]")]
        if not isinstance(value, (list, tuple)) or not value:
            raise JobInputError(f"config: {key} must be a non-empty list of {item}s, got {value!r}")
        return tuple(coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value))
    allowed = [t.strip() for t in text.split("|")]
    if value is None:
        if "None" in allowed or "Any" in allowed:
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
        if t == "Any":  # checked by the section's own rules
            return value
    wanted = " or ".join("null" if t == "None" else t for t in allowed)
    raise JobInputError(f"config: {key} must be {wanted}, got {value!r} ({type(value).__name__})")


def out_of_range(key: str, rule: str, value: Any) -> JobInputError:
    return JobInputError(f"config: {key} must be {rule}, got {value!r}")


def check_model(m: ModelConfig) -> None:
    if m.dtype not in DTYPES:
        raise out_of_range("model.dtype", f"one of {', '.join(DTYPES)}", m.dtype)
    if m.device_map not in (None, "auto"):
        raise out_of_range("model.device_map", "null (one device) or auto (split over the actor's GPUs)", m.device_map)
    for key, path in (("model.target", m.target), ("model.draft", m.draft)):
        if not path.strip():
            raise out_of_range(key, "a model directory", path)


def check_data(d: DataConfig) -> None:
    if not d.path.strip():
        raise out_of_range("data.path", "a file or directory", d.path)
    if d.format not in DATA_FORMATS:
        raise out_of_range("data.format", f"one of {', '.join(DATA_FORMATS)}", d.format)
    if d.limit is not None and d.limit < 1:
        raise out_of_range("data.limit", ">= 1 or null (all rows)", d.limit)
    if d.max_record_bytes < 1:
        raise out_of_range("data.max_record_bytes", ">= 1", d.max_record_bytes)
    if d.max_samples is not None and d.max_samples < 1:
        raise out_of_range("data.max_samples", ">= 1 or null (the largest n the scan finds)", d.max_samples)
    if d.max_new_tokens_column is not None:
        others = {d.id_column, d.messages_column if d.chat else d.prompt_column}
        if not d.max_new_tokens_column.strip() or d.max_new_tokens_column in others:
            raise out_of_range(
                "data.max_new_tokens_column", "null or a column other than the prompt and id columns",
                d.max_new_tokens_column,
            )  # fmt: skip
    _check_row_columns(d)


def _check_row_columns(d: DataConfig) -> None:
    """keep_columns, stop_column, sampling_params_column, chat_template(_kwargs): shapes only (the input's
    columns are checked by the scan)."""
    from pipeline.row_columns import check_row_columns_config

    check_row_columns_config(d)


def check_mlflow(m: MlflowConfig) -> None:
    if not m.experiment.strip():
        raise out_of_range("mlflow.experiment", "a non-empty name", m.experiment)
    if not (0.0 < m.log_every_s <= 30.0):
        raise out_of_range("mlflow.log_every_s", "in (0, 30] seconds", m.log_every_s)
    if not (0.0 < m.system_metrics_interval_s <= 3600.0):
        raise out_of_range("mlflow.system_metrics_interval_s", "in (0, 3600] seconds", m.system_metrics_interval_s)
    if not (0.0 <= m.shutdown_timeout_s <= 3600.0):
        raise out_of_range("mlflow.shutdown_timeout_s", "in [0, 3600] seconds", m.shutdown_timeout_s)


def shared_sections(model: Any, data: Any, mlflow: Any) -> tuple[ModelConfig, DataConfig, MlflowConfig]:
    """The `model`, `data` and `mlflow` sections, built and range-checked as every job takes them."""
    built = (
        build_section(ModelConfig, model, prefix="model"),
        build_section(DataConfig, data, prefix="data"),
        build_section(MlflowConfig, mlflow, prefix="mlflow"),
    )
    check_model(built[0])
    check_data(built[1])
    check_mlflow(built[2])
    return built


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
    # ${demo_limit:${data.path}}: the embedded prompts' demo limit, null (every row) for any other data.path
    OmegaConf.register_new_resolver("demo_limit", demo_limit, replace=True)


EMBEDDED_PROMPTS = PROJECT_ROOT / "assets" / "prompts.jsonl"
DEMO_LIMIT = 64  # the embedded prompts: their first 64 keep `make run` to a few minutes on a CPU


def demo_limit(path: str) -> int | None:
    """data.limit's default: `DEMO_LIMIT` for the embedded prompts, None (every row) for the user's data."""
    try:
        return DEMO_LIMIT if Path(path).resolve() == EMBEDDED_PROMPTS.resolve() else None
    except (OSError, ValueError):  # a URI or an odd path: not the embedded file
        return None


_register_resolvers()
