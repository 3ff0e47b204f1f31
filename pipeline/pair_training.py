"""Train the embedded default draft/target pair from the Python standard library's source.

What this is: the logic behind ``python -m jobs.train_pair``. It

1. collects the running Python's stdlib ``.py`` files and splits them, deterministically by path,
   into training modules and held-out modules (used for evaluation and for the default prompts);
2. trains a byte-level BPE tokenizer on the training modules;
3. trains a Llama-style target and a Llama-style draft in one loop. The draft learns from the data
   and, distilled online, from the target's detached next-token distribution;
4. saves both with ``save_pretrained`` (safetensors) next to the tokenizer files, so each directory
   loads through ``AutoModelForCausalLM`` and ``AutoTokenizer``, and writes a manifest of the run;
5. writes the default prompts from the held-out modules (``pipeline/pair_training_prompts.py``).

What this is not: an evaluation (see ``scripts/eval_pair.py``). It never downloads anything.

Training stops at whichever comes first, ``max_steps`` or the wall-clock budget ``max_minutes``; the
learning rate follows a cosine over that same progress, so a run stopped by the clock is annealed.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
DEFAULT_EXCLUDED_DIRS = ("site-packages", "test", "tests", "idle_test", "__pycache__")


# ----------------------------------------------------------------------------------------------------
# Typed configuration (the core never sees OmegaConf)


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


@dataclass
class TrainingResult:
    output_dir: str
    steps: int
    tokens_seen: int
    train_seconds: float
    final_target_loss: float
    final_draft_loss: float
    stopped_by: str
    extra: dict = field(default_factory=dict)


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


# ----------------------------------------------------------------------------------------------------
# Corpus


def default_stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative_path: str, heldout_every: int) -> bool:
    """Deterministic, interpreter-independent split: sha1 of the POSIX relative path, modulo N."""
    digest = hashlib.sha1(relative_path.encode("utf-8")).hexdigest()
    return int(digest, 16) % heldout_every == 0


def list_corpus_files(corpus: CorpusSpec) -> tuple[Path, list[str], list[str]]:
    """Return (root, training relative paths, held-out relative paths), both sorted.

    Raises ValueError when the directory is missing or holds no usable ``.py`` file.
    """
    root = Path(corpus.stdlib_dir) if corpus.stdlib_dir else default_stdlib_dir()
    if not root.is_dir():
        raise ValueError(f"train.corpus.stdlib_dir: corpus directory {str(root)!r} does not exist")
    excluded = set(corpus.excluded_dirs)
    relative_paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in excluded for part in rel.parts[:-1]):
            continue
        if path.is_file() and path.stat().st_size > 0:
            relative_paths.append(rel.as_posix())
    relative_paths.sort()
    if not relative_paths:
        raise ValueError(
            f"train.corpus.stdlib_dir: no non-empty .py files under {str(root)!r} "
            f"(excluding directories named {sorted(excluded)})"
        )
    heldout = [p for p in relative_paths if is_heldout(p, corpus.heldout_every)]
    train = [p for p in relative_paths if not is_heldout(p, corpus.heldout_every)]
    if not heldout:  # tiny corpora: hold out the last file so that evaluation has something to read
        heldout, train = train[-1:], train[:-1]
    if not train:
        raise ValueError(
            f"train.corpus: only {len(relative_paths)} .py file(s) under {str(root)!r}; "
            "need at least one training and one held-out module"
        )
    if corpus.max_files is not None:
        train = train[: corpus.max_files]
    return root, train, heldout


def read_sources(root: Path, relative_paths: list[str]) -> list[str]:
    texts = []
    for rel in relative_paths:
        try:
            texts.append((root / rel).read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue  # a handful of stdlib files are latin-1 test data; they are simply skipped
    return texts


# ----------------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(texts: list[str], spec: TokenizerSpec):
    """Byte-level BPE without normalization, so that any text round-trips exactly.

    Returns a ``PreTrainedTokenizerFast`` that prepends BOS when ``add_special_tokens`` is true.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=spec.min_frequency,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def tokenize_documents(tokenizer, texts: list[str]) -> torch.Tensor:
    """Concatenate ``BOS doc EOS`` for every document into one flat stream. # [N] int32"""
    encoded = tokenizer._tokenizer.encode_batch(texts, add_special_tokens=False)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    stream: list[int] = []
    for enc in encoded:
        stream.append(bos)
        stream.extend(enc.ids)
        stream.append(eos)
    return torch.tensor(stream, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------------
# Models


def build_model(spec: ModelSpec, tokenizer, seed: int):
    """A freshly initialised LlamaForCausalLM; initialisation is seeded without touching global RNG state."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        intermediate_size=spec.intermediate_size,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_theta=spec.rope_theta,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------------
# Training loop


def sample_windows(
    stream: torch.Tensor, batch_size: int, window: int, generator: torch.Generator
) -> torch.Tensor:
    """Random contiguous windows of ``window`` tokens from the stream. # [B, window] int64"""
    starts = torch.randint(0, stream.numel() - window + 1, (batch_size,), generator=generator)  # [B]
    offsets = torch.arange(window)  # [window]
    return stream[starts[:, None] + offsets[None, :]].long()


def learning_rate(peak: float, step: int, progress: float, warmup_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup over steps, then cosine from peak to ``min_lr_ratio * peak`` over progress in [0, 1]."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return peak * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)


def make_optimizer(model, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )


def draft_loss_fn(
    draft_logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor, distill_weight: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixed draft objective. Returns (total loss, data cross-entropy).

    draft_logits, target_logits: # [B, T, V]; labels: # [B, T]
    """
    vocab_size = draft_logits.shape[-1]
    draft_log_probs = F.log_softmax(draft_logits.float(), dim=-1)  # [B, T, V]
    data_ce = F.nll_loss(draft_log_probs.reshape(-1, vocab_size), labels.reshape(-1))
    if distill_weight == 0.0:
        return data_ce, data_ce
    target_log_probs = F.log_softmax(target_logits.detach().float(), dim=-1)  # [B, T, V]
    # KL(q || p) per position, averaged: pushes the draft to cover where the target puts mass.
    kl = (target_log_probs.exp() * (target_log_probs - draft_log_probs)).sum(-1).mean()
    return (1.0 - distill_weight) * data_ce + distill_weight * kl, data_ce


def save_pair(output_dir: Path, target, draft, tokenizer, save_dtype: str, manifest: dict) -> None:
    """Write ``target/`` and ``draft/`` (model + tokenizer each) and ``manifest.json`` atomically enough:
    into a temporary sibling directory first, then swapped into place."""
    dtype = getattr(torch, save_dtype)
    output_dir = Path(output_dir)
    staging = output_dir.with_name(output_dir.name + ".tmp")
    if staging.exists():
        _remove_tree(staging)
    for name, model in (("target", target), ("draft", draft)):
        model_dir = staging / name
        model_dir.mkdir(parents=True)
        # Save a copy in the shipping dtype; the fp32 master weights being trained stay untouched.
        copy.deepcopy(model).to(dtype).save_pretrained(model_dir, safe_serialization=True)
        tokenizer.save_pretrained(model_dir)
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if output_dir.exists():
        _remove_tree(output_dir)
    staging.rename(output_dir)


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path)


def train_pair(
    spec: TrainSpec, output_dir: str | os.PathLike, *, show_progress: bool = True
) -> TrainingResult:
    """Run the whole job: corpus -> tokenizer -> target + draft -> saved pair in ``output_dir``."""
    # 1) validate everything that can be checked before any work
    validate_train_spec(spec)
    root, train_files, heldout_files = list_corpus_files(spec.corpus)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(spec.num_threads)

    # 2) tokenizer, trained on the training modules only
    train_texts = read_sources(root, train_files)
    if not train_texts:
        raise ValueError(
            f"train.corpus: none of the {len(train_files)} training files under {str(root)!r} "
            "could be read as UTF-8"
        )
    tokenizer = train_tokenizer(train_texts, spec.tokenizer)
    train_stream = tokenize_documents(tokenizer, train_texts)  # [N]
    heldout_stream = tokenize_documents(tokenizer, read_sources(root, heldout_files))  # [M]
    window = spec.seq_len + 1
    if train_stream.numel() < window:
        raise ValueError(
            f"train.corpus: the training stream has {train_stream.numel()} tokens, fewer than "
            f"train.seq_len + 1 = {window}"
        )

    # 3) models and optimizers
    target = build_model(spec.target, tokenizer, seed=spec.seed)
    draft = build_model(spec.draft, tokenizer, seed=spec.seed + 1)
    target.train()
    draft.train()
    target_opt = make_optimizer(target, spec.target_lr, spec.weight_decay)
    draft_opt = make_optimizer(draft, spec.draft_lr, spec.weight_decay)
    generator = torch.Generator().manual_seed(spec.seed)

    manifest = {
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "stdlib_dir": str(root),
        "excluded_dirs": list(spec.corpus.excluded_dirs),
        "heldout_rule": f"sha1(relative path) % {spec.corpus.heldout_every} == 0",
        "heldout_modules": heldout_files,
        "num_train_modules": len(train_files),
        "train_tokens_in_corpus": int(train_stream.numel()),
        "heldout_tokens_in_corpus": int(heldout_stream.numel()),
        "vocab_size": len(tokenizer),
        "target_parameters": count_parameters(target),
        "draft_parameters": count_parameters(draft),
        "config": _jsonable(asdict(spec)),
        "torch_version": torch.__version__,
        "platform": platform.platform(),
        "argv": sys.argv,
    }

    # 4) the loop: one batch feeds both models; the draft also sees the target's distribution
    budget_s = spec.max_minutes * 60.0
    start = time.monotonic()
    last_checkpoint = start
    step = 0
    tokens_seen = 0
    target_loss_value = draft_loss_value = float("nan")
    stopped_by = "max_steps"
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if spec.bf16_autocast else contextlib.nullcontext()
    bar = tqdm(
        total=spec.max_steps,
        disable=not show_progress,
        desc="train_pair",
        dynamic_ncols=True,
        mininterval=5.0,
    )
    while True:
        elapsed = time.monotonic() - start
        progress = elapsed / budget_s
        if spec.max_steps is not None:
            progress = max(progress, step / spec.max_steps)
            if step >= spec.max_steps:
                stopped_by = "max_steps"
                break
        if elapsed >= budget_s:
            stopped_by = "max_minutes"
            break
        for opt, peak in ((target_opt, spec.target_lr), (draft_opt, spec.draft_lr)):
            lr = learning_rate(peak, step, progress, spec.warmup_steps, spec.min_lr_ratio)
            for group in opt.param_groups:
                group["lr"] = lr

        batch = sample_windows(train_stream, spec.batch_size, window, generator)  # [B, T+1]
        inputs, labels = batch[:, :-1], batch[:, 1:]  # [B, T], [B, T]
        with autocast:
            target_logits = target(input_ids=inputs).logits  # [B, T, V]
            draft_logits = draft(input_ids=inputs).logits  # [B, T, V]
        target_loss = F.cross_entropy(
            target_logits.float().reshape(-1, target_logits.shape[-1]), labels.reshape(-1)
        )
        draft_loss, draft_ce = draft_loss_fn(draft_logits, target_logits, labels, spec.distill_weight)
        (target_loss + draft_loss).backward()
        for model, opt in ((target, target_opt), (draft, draft_opt)):
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)

        step += 1
        tokens_seen += inputs.numel()
        target_loss_value, draft_loss_value = float(target_loss.detach()), float(draft_ce.detach())
        bar.update(1)
        bar.set_postfix(
            target_loss=f"{target_loss_value:.3f}",
            draft_ce=f"{draft_loss_value:.3f}",
            tok_s=f"{tokens_seen / max(time.monotonic() - start, 1e-9):.0f}",
            min=f"{(time.monotonic() - start) / 60:.1f}",
            refresh=False,
        )
        if time.monotonic() - last_checkpoint >= spec.checkpoint_minutes * 60.0:
            save_pair(
                output_dir / "checkpoint",
                target,
                draft,
                tokenizer,
                spec.save_dtype,
                {
                    **manifest,
                    "steps": step,
                    "tokens_seen": tokens_seen,
                    "partial": True,
                    "train_seconds": time.monotonic() - start,
                },
            )
            last_checkpoint = time.monotonic()
    bar.close()
    train_seconds = time.monotonic() - start

    # 5) save the final pair
    manifest.update(
        steps=step,
        tokens_seen=tokens_seen,
        train_seconds=round(train_seconds, 1),
        stopped_by=stopped_by,
        partial=False,
        final_target_train_loss=target_loss_value,
        final_draft_train_ce=draft_loss_value,
    )
    save_pair(output_dir / "pair", target, draft, tokenizer, spec.save_dtype, manifest)

    # 6) the default prompts, from the held-out modules
    from pipeline.pair_training_prompts import build_prompts, write_jsonl

    prompts = build_prompts(
        root, heldout_files, tokenizer, max_prompt_tokens=spec.prompt_max_tokens, max_prompts=spec.max_prompts
    )
    write_jsonl(prompts, output_dir / "prompts.jsonl")
    return TrainingResult(
        output_dir=str(output_dir / "pair"),
        steps=step,
        tokens_seen=tokens_seen,
        train_seconds=train_seconds,
        final_target_loss=target_loss_value,
        final_draft_loss=draft_loss_value,
        stopped_by=stopped_by,
        extra={"prompts_path": str(output_dir / "prompts.jsonl"), "num_prompts": len(prompts)},
    )


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
