"""Typed configuration of draft training (the core never sees OmegaConf), with its checks.

`draft_config_from_mapping` builds a `DraftJobConfig` from the composed config; every bad key or value is a
`JobInputError` naming the key. Not here: models, data or training.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from pipeline.config import MlflowConfig
from pipeline.distillation import LOSSES
from pipeline.errors import JobInputError

EMBEDDING_INITS = ("target", "random")


@dataclass(frozen=True)
class TargetSpec:
    target: str
    dtype: str = "auto"  # the target's dtype for generation and its logits: bfloat16 on CUDA, float32 on CPU
    trust_remote_code: bool = False


@dataclass(frozen=True)
class PromptSpec:
    path: str
    prompt_column: str = "prompt"
    limit: int | None = None  # first N prompts
    heldout: int = 32  # the last N prompts are held out for the acceptance measure


@dataclass(frozen=True)
class DraftShape:
    """The draft's size; null fields are derived from the target's (`pipeline.train_draft.draft_model`)."""

    num_hidden_layers: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    tie_word_embeddings: bool = True
    init_embedding: str = "target"  # target: the target's embedding projected on its top directions | random
    kind: str = "eagle3"  # eagle3 (a head over three fused layers of the target) | eagle (its last state) | model
    vocab_size: int | None = 8192  # feature drafts: the N most frequent completion tokens (null: the whole vocabulary)
    init: str = "target"  # feature drafts: the head starts from the target's last layer | random
    train_lm_head: bool = False  # feature drafts: the head's output rows are trained (false: kept as the target's)


@dataclass(frozen=True)
class TrainSpec:
    loss: str = "forward_kl"  # forward_kl | tv
    max_new_tokens: int = 128  # the target's completions of each prompt
    temperature: float = 1.0  # the target samples its completions, and both laws are read, at this temperature
    generate_batch_size: int = 32
    sequences: int | None = None  # training prompts completed at most (the first ones); None: as many as drawn
    batch_size: int = 8  # sequences per step
    steps: int = 1000
    max_minutes: float | None = None  # wall-clock budget of the whole run, preparation included (None: steps only)
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    checkpoint_every: int = 200  # steps
    law_cache_gib: float = 4.0  # the target's float16 laws at the training positions kept in memory up to this
    save_dtype: str = "bfloat16"
    seed: int = 0
    shuffle_targets: bool = False  # negative control: the target distributions permuted across positions
    top_k: int = 32  # feature drafts: the target's top-k law kept per position (the loss's support)
    unroll: int = 2  # feature drafts: passes per step (2: the head also reads its own previous states)
    regression_weight: float = 1.0  # feature drafts (eagle): weight of the hidden-state regression
    prompt_positions: bool = True  # feature drafts: the loss also reads the prompts' positions (free data)


@dataclass(frozen=True)
class DraftJobConfig:
    model: TargetSpec
    data: PromptSpec
    draft: DraftShape
    train: TrainSpec
    mlflow: MlflowConfig
    out: str
    device: str = "auto"
    threads: int | None = None
    show_progress: bool = True
    compare_draft: str | None = None  # another draft measured the same way on the same held-out completions

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def run_key(self) -> str:
        """What a resumed run must share with the first: target, prompts, draft and loss (not the budget)."""
        keep = {"model": asdict(self.model), "data": asdict(self.data), "draft": asdict(self.draft),
                "train": {k: v for k, v in asdict(self.train).items()
                          if k not in ("steps", "max_minutes", "checkpoint_every", "law_cache_gib")}}
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


DRAFT_KINDS = ("eagle", "eagle3", "model")


def _section(cls, raw: Any, key: str):
    raw = dict(raw or {})
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise JobInputError(f"{key}: unknown keys {unknown}; known keys are {sorted(known)}")
    try:
        return cls(**raw)
    except TypeError as err:
        raise JobInputError(f"{key}: {err}") from None


def draft_config_from_mapping(raw: Mapping) -> DraftJobConfig:
    raw = dict(raw)
    raw.pop("hydra", None)
    for key in ("model", "data"):
        if not (raw.get(key) or {}).get("target" if key == "model" else "path"):
            name = "model.target" if key == "model" else "data.path"
            raise JobInputError(f"{name}: required (python -m jobs.train_draft model.target=DIR data.path=PROMPTS out=DIR)")
    if not raw.get("out"):
        raise JobInputError("out: required, the draft's output directory")
    known = {f.name for f in fields(DraftJobConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise JobInputError(f"config: unknown keys {unknown}; known keys are {sorted(known)}")
    config = DraftJobConfig(
        model=_section(TargetSpec, raw["model"], "model"),
        data=_section(PromptSpec, raw["data"], "data"),
        draft=_section(DraftShape, raw.get("draft"), "draft"),
        train=_section(TrainSpec, raw.get("train"), "train"),
        mlflow=_section(MlflowConfig, raw.get("mlflow"), "mlflow"),
        out=str(raw["out"]),
        device=str(raw.get("device", "auto")),
        threads=raw.get("threads"),
        show_progress=bool(raw.get("show_progress", True)),
        compare_draft=raw.get("compare_draft"),
    )
    validate(config)
    return config


def validate(config: DraftJobConfig) -> None:
    train, draft, data = config.train, config.draft, config.data
    if draft.kind not in DRAFT_KINDS:
        raise JobInputError(f"draft.kind: {draft.kind!r} is not one of {', '.join(DRAFT_KINDS)}")
    if not isinstance(draft.train_lm_head, bool):
        raise JobInputError(f"draft.train_lm_head: true or false, got {draft.train_lm_head!r}")
    if draft.init not in ("target", "random"):
        raise JobInputError(f"draft.init: {draft.init!r} is not target or random")
    if draft.vocab_size is not None and (not isinstance(draft.vocab_size, int) or draft.vocab_size < 2):
        raise JobInputError(f"draft.vocab_size: an integer >= 2 or null, got {draft.vocab_size!r}")
    for key, low in (("top_k", 1), ("unroll", 1)):
        value = getattr(train, key)
        if not isinstance(value, int) or value < low:
            raise JobInputError(f"train.{key}: a positive integer, got {value!r}")
    if train.loss not in LOSSES:
        raise JobInputError(f"train.loss: {train.loss!r} is not one of {', '.join(LOSSES)}")
    if draft.init_embedding not in EMBEDDING_INITS:
        raise JobInputError(f"draft.init_embedding: {draft.init_embedding!r} is not one of {', '.join(EMBEDDING_INITS)}")
    if train.save_dtype not in ("float32", "bfloat16", "float16"):
        raise JobInputError(f"train.save_dtype: {train.save_dtype!r} is not float32, bfloat16 or float16")
    if not train.temperature > 0:
        raise JobInputError(f"train.temperature: must be > 0 (the laws are read at it), got {train.temperature}")
    for key in ("max_new_tokens", "generate_batch_size", "batch_size", "steps", "checkpoint_every"):
        value = getattr(train, key)
        if not isinstance(value, int) or value < 1:
            raise JobInputError(f"train.{key}: a positive integer, got {value!r}")
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
        value = getattr(draft, key)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise JobInputError(f"draft.{key}: a positive integer or null, got {value!r}")
    if train.sequences is not None and (not isinstance(train.sequences, int) or train.sequences < 1):
        raise JobInputError(f"train.sequences: a positive integer or null, got {train.sequences!r}")
    if not isinstance(train.law_cache_gib, (int, float)) or train.law_cache_gib < 0:
        raise JobInputError(f"train.law_cache_gib: a number >= 0 (0: the target runs at every step), "
                            f"got {train.law_cache_gib!r}")
    if not isinstance(data.heldout, int) or data.heldout < 1:
        raise JobInputError(f"data.heldout: a positive integer, got {data.heldout!r}")
    if config.device not in ("auto", "cpu", "cuda") and not config.device.startswith("cuda:"):
        raise JobInputError(f"device: auto, cpu, cuda or cuda:N, got {config.device!r}")
