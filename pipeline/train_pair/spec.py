"""Typed configuration of pair training (the core never sees OmegaConf), with its checks.

`train_spec_from_mapping` builds a `TrainSpec` from the composed `train` section; `validate_train_spec`
raises `ValueError` naming the key. Not here: any training.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_EXCLUDED_DIRS = ("site-packages", "test", "tests", "idle_test", "__pycache__")


@dataclass(frozen=True)
class CorpusSpec:
    """Which stdlib files to read and which of them are held out."""

    stdlib_dir: str | None = None  # None: the running interpreter's sysconfig stdlib path
    excluded_dirs: tuple[str, ...] = DEFAULT_EXCLUDED_DIRS  # any path component with one of these names
    heldout_every: int = 12  # a module is held out when sha1(relative path) % heldout_every == 0
    max_files: int | None = None  # keep only the first N training files (smoke runs)


@dataclass(frozen=True)
class TokenizerSpec:
    vocab_size: int = 8192
    min_frequency: int = 2


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-style decoder; maps one-to-one onto ``transformers.LlamaConfig``."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class TrainSpec:
    corpus: CorpusSpec
    tokenizer: TokenizerSpec
    target: ModelSpec
    draft: ModelSpec
    seq_len: int = 512
    batch_size: int = 8
    target_lr: float = 1e-3
    draft_lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    distill_weight: float = 0.5  # draft loss = (1 - w) * data CE + w * KL(target || draft)
    max_minutes: float = 80.0
    max_steps: int | None = None
    checkpoint_minutes: float = 10.0
    num_threads: int = 2
    bf16_autocast: bool = True
    save_dtype: str = "bfloat16"
    seed: int = 0
    prompt_max_tokens: int = 200  # default prompts longer than this (BOS included) are dropped
    max_prompts: int = 1000


def _as_tuple(value) -> tuple:
    return tuple(value) if value is not None else ()


def train_spec_from_mapping(raw: Mapping) -> TrainSpec:
    """Build a TrainSpec from a plain mapping (e.g. ``OmegaConf.to_container(cfg.train)``)."""
    raw = dict(raw)
    corpus_raw = dict(raw.pop("corpus", {}) or {})
    if "excluded_dirs" in corpus_raw:
        corpus_raw["excluded_dirs"] = _as_tuple(corpus_raw["excluded_dirs"])
    known = set(TrainSpec.__dataclass_fields__)
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"train config: unknown keys {sorted(unknown)}; known keys are {sorted(known)}")
    for key in ("target", "draft"):
        if key not in raw:
            raise ValueError(f"train config: missing the '{key}' model section")
    return TrainSpec(
        corpus=CorpusSpec(**corpus_raw),
        tokenizer=TokenizerSpec(**dict(raw.pop("tokenizer", {}) or {})),
        target=ModelSpec(**dict(raw.pop("target"))),
        draft=ModelSpec(**dict(raw.pop("draft"))),
        **raw,
    )


def validate_model_spec(spec: ModelSpec, name: str) -> None:
    """Raise ValueError naming the model and the field when a Llama config cannot be built or run."""
    for attr in (
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
    ):
        value = getattr(spec, attr)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"train.{name}.{attr} must be a positive integer, got {value!r}")
    if spec.hidden_size % spec.num_attention_heads != 0:
        raise ValueError(
            f"train.{name}: num_attention_heads={spec.num_attention_heads} does not divide "
            f"hidden_size={spec.hidden_size}"
        )
    if spec.num_attention_heads % spec.num_key_value_heads != 0:
        raise ValueError(
            f"train.{name}: num_key_value_heads={spec.num_key_value_heads} does not divide "
            f"num_attention_heads={spec.num_attention_heads}"
        )
    if (spec.hidden_size // spec.num_attention_heads) % 2 != 0:
        raise ValueError(
            f"train.{name}: head dim hidden_size/num_attention_heads="
            f"{spec.hidden_size // spec.num_attention_heads} must be even for rotary embeddings"
        )


def validate_train_spec(spec: TrainSpec) -> None:
    """All config checks that can run before any file is read."""
    validate_model_spec(spec.target, "target")
    validate_model_spec(spec.draft, "draft")
    for name in ("seq_len", "batch_size", "warmup_steps", "num_threads"):
        value = getattr(spec, name)
        if not isinstance(value, int) or value < (0 if name == "warmup_steps" else 1):
            raise ValueError(f"train.{name} must be a positive integer, got {value!r}")
    for model_name, model in (("target", spec.target), ("draft", spec.draft)):
        if spec.seq_len > model.max_position_embeddings:
            raise ValueError(
                f"train.seq_len={spec.seq_len} exceeds train.{model_name}.max_position_embeddings="
                f"{model.max_position_embeddings}"
            )
    if not 0.0 <= spec.distill_weight <= 1.0:
        raise ValueError(f"train.distill_weight must lie in [0, 1], got {spec.distill_weight}")
    if spec.max_minutes <= 0:
        raise ValueError(f"train.max_minutes must be positive, got {spec.max_minutes}")
    if spec.max_steps is not None and spec.max_steps < 1:
        raise ValueError(f"train.max_steps must be >= 1 or null, got {spec.max_steps}")
    if spec.tokenizer.vocab_size < 300:
        raise ValueError(
            f"train.tokenizer.vocab_size={spec.tokenizer.vocab_size} is below the 256 byte "
            "symbols plus special tokens"
        )
    if spec.corpus.heldout_every < 2:
        raise ValueError(f"train.corpus.heldout_every must be >= 2, got {spec.corpus.heldout_every}")
    if spec.save_dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"train.save_dtype must be float32, bfloat16 or float16, got {spec.save_dtype!r}")
