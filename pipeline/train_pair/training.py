"""Train the embedded default draft/target pair from the Python standard library's source: the loop.

What this is: the logic behind ``python -m jobs.train_pair``. It

1. collects the running Python's stdlib ``.py`` files and splits them, deterministically by path,
   into training modules and held-out modules (used for evaluation and for the default prompts);
2. trains a byte-level BPE tokenizer on the training modules;
3. trains a Llama-style target and a Llama-style draft in one loop. The draft learns from the data
   and, distilled online, from the target's detached next-token distribution;
4. saves both with ``save_pretrained`` (safetensors) next to the tokenizer files, so each directory
   loads through ``AutoModelForCausalLM`` and ``AutoTokenizer``, and writes a manifest of the run;
5. writes the default prompts from the held-out modules (``pipeline/train_pair/prompts.py``).

What this is not: an evaluation (see ``scripts/eval_pair.py``). It never downloads anything.

Training stops at whichever comes first, ``max_steps`` or the wall-clock budget ``max_minutes``; the
learning rate follows a cosine over that same progress, so a run stopped by the clock is annealed.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from pipeline.distillation import per_position_divergence
from pipeline.train_pair.corpus import list_corpus_files, read_sources
from pipeline.train_pair.model import build_model, count_parameters, save_pair
from pipeline.train_pair.spec import TrainSpec, validate_train_spec
from pipeline.train_pair.tokenizer import tokenize_documents, train_tokenizer


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
    kl = per_position_divergence(draft_log_probs, target_log_probs, "forward_kl").mean()
    return (1.0 - distill_weight) * data_ce + distill_weight * kl, data_ce


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


@dataclass
class PairData:
    """The tokenized corpus a run trains on, and where it came from."""

    root: Path
    train_files: list[str]
    heldout_files: list[str]
    tokenizer: object
    train_stream: torch.Tensor  # [N] token ids of the training modules
    heldout_stream: torch.Tensor  # [M] token ids of the held-out modules


@dataclass
class LoopState:
    step: int = 0
    tokens_seen: int = 0
    target_loss: float = float("nan")
    draft_loss: float = float("nan")
    stopped_by: str = "max_steps"
    train_seconds: float = 0.0


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
    data = _prepare_data(spec, root, train_files, heldout_files)
    # 3) models
    target = build_model(spec.target, data.tokenizer, seed=spec.seed)
    draft = build_model(spec.draft, data.tokenizer, seed=spec.seed + 1)
    manifest = _run_manifest(spec, data, target, draft)
    # 4) the loop: one batch feeds both models; the draft also sees the target's distribution
    state = _train_loop(spec, data, target, draft, output_dir, manifest, show_progress)
    # 5) save the final pair
    manifest.update(
        steps=state.step,
        tokens_seen=state.tokens_seen,
        train_seconds=round(state.train_seconds, 1),
        stopped_by=state.stopped_by,
        partial=False,
        final_target_train_loss=state.target_loss,
        final_draft_train_ce=state.draft_loss,
    )
    save_pair(output_dir / "pair", target, draft, data.tokenizer, spec.save_dtype, manifest)
    # 6) the default prompts, from the held-out modules
    from pipeline.train_pair.prompts import build_prompts, write_jsonl

    prompts = build_prompts(
        root, heldout_files, data.tokenizer, max_prompt_tokens=spec.prompt_max_tokens,
        max_prompts=spec.max_prompts,
    )
    write_jsonl(prompts, output_dir / "prompts.jsonl")
    return TrainingResult(
        output_dir=str(output_dir / "pair"),
        steps=state.step,
        tokens_seen=state.tokens_seen,
        train_seconds=state.train_seconds,
        final_target_loss=state.target_loss,
        final_draft_loss=state.draft_loss,
        stopped_by=state.stopped_by,
        extra={"prompts_path": str(output_dir / "prompts.jsonl"), "num_prompts": len(prompts)},
    )


def _prepare_data(spec: TrainSpec, root: Path, train_files: list[str], heldout_files: list[str]) -> PairData:
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
    return PairData(root, train_files, heldout_files, tokenizer, train_stream, heldout_stream)


def _run_manifest(spec: TrainSpec, data: PairData, target, draft) -> dict:
    """What the saved pair's manifest says about its corpus, models and environment."""
    return {
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "stdlib_dir": str(data.root),
        "excluded_dirs": list(spec.corpus.excluded_dirs),
        "heldout_rule": f"sha1(relative path) % {spec.corpus.heldout_every} == 0",
        "heldout_modules": data.heldout_files,
        "num_train_modules": len(data.train_files),
        "train_tokens_in_corpus": int(data.train_stream.numel()),
        "heldout_tokens_in_corpus": int(data.heldout_stream.numel()),
        "vocab_size": len(data.tokenizer),
        "target_parameters": count_parameters(target),
        "draft_parameters": count_parameters(draft),
        "config": _jsonable(asdict(spec)),
        "torch_version": torch.__version__,
        "platform": platform.platform(),
        "argv": sys.argv,
    }


def _stop_reason(spec: TrainSpec, step: int, elapsed: float) -> tuple[str | None, float]:
    """(why to stop now or None, progress in [0, 1] for the learning-rate schedule)."""
    budget_s = spec.max_minutes * 60.0
    progress = elapsed / budget_s
    if spec.max_steps is not None:
        progress = max(progress, step / spec.max_steps)
        if step >= spec.max_steps:
            return "max_steps", progress
    if elapsed >= budget_s:
        return "max_minutes", progress
    return None, progress


def _train_loop(spec, data: PairData, target, draft, output_dir: Path, manifest: dict, show_progress: bool):
    target.train()
    draft.train()
    optimizers = (
        (target, make_optimizer(target, spec.target_lr, spec.weight_decay), spec.target_lr),
        (draft, make_optimizer(draft, spec.draft_lr, spec.weight_decay), spec.draft_lr),
    )
    generator = torch.Generator().manual_seed(spec.seed)
    state = LoopState()
    start = last_checkpoint = time.monotonic()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if spec.bf16_autocast else contextlib.nullcontext()
    bar = tqdm(total=spec.max_steps, disable=not show_progress, desc="train_pair", dynamic_ncols=True,
               mininterval=5.0)
    while True:
        stop, progress = _stop_reason(spec, state.step, time.monotonic() - start)
        if stop is not None:
            state.stopped_by = stop
            break
        for _, opt, peak in optimizers:
            lr = learning_rate(peak, state.step, progress, spec.warmup_steps, spec.min_lr_ratio)
            for group in opt.param_groups:
                group["lr"] = lr
        _train_step(spec, data, optimizers, generator, autocast, state)
        bar.update(1)
        bar.set_postfix(
            target_loss=f"{state.target_loss:.3f}",
            draft_ce=f"{state.draft_loss:.3f}",
            tok_s=f"{state.tokens_seen / max(time.monotonic() - start, 1e-9):.0f}",
            min=f"{(time.monotonic() - start) / 60:.1f}",
            refresh=False,
        )
        if time.monotonic() - last_checkpoint >= spec.checkpoint_minutes * 60.0:
            checkpoint = {**manifest, "steps": state.step, "tokens_seen": state.tokens_seen, "partial": True,
                          "train_seconds": time.monotonic() - start}
            save_pair(output_dir / "checkpoint", target, draft, data.tokenizer, spec.save_dtype, checkpoint)
            last_checkpoint = time.monotonic()
    bar.close()
    state.train_seconds = time.monotonic() - start
    return state


def _train_step(spec, data: PairData, optimizers, generator, autocast, state: LoopState) -> None:
    """One batch through both models; the draft's loss mixes the data and the target's distribution."""
    (target, _, _), (draft, _, _) = optimizers
    batch = sample_windows(data.train_stream, spec.batch_size, spec.seq_len + 1, generator)  # [B, T+1]
    inputs, labels = batch[:, :-1], batch[:, 1:]  # [B, T], [B, T]
    with autocast:
        target_logits = target(input_ids=inputs).logits  # [B, T, V]
        draft_logits = draft(input_ids=inputs).logits  # [B, T, V]
    target_loss = F.cross_entropy(target_logits.float().reshape(-1, target_logits.shape[-1]), labels.reshape(-1))
    draft_loss, draft_ce = draft_loss_fn(draft_logits, target_logits, labels, spec.distill_weight)
    (target_loss + draft_loss).backward()
    for model, opt, _ in optimizers:
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    state.step += 1
    state.tokens_seen += inputs.numel()
    state.target_loss, state.draft_loss = float(target_loss.detach()), float(draft_ce.detach())


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
