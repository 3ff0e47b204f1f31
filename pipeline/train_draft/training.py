"""Distil a draft for a target: the logic behind `python -m jobs.train_draft`.

1. check the config, the output directory, the target (architecture, tokenizer) before any work;
2. the prompts, split into training and held-out; the target's own completions of both (`completions`);
3. a small Llama draft with the target's vocabulary (`draft_model`);
4. the target's full next-token laws at every completion position, from one pass of the target, kept in
   memory when they fit (`train.law_cache_gib`; else the target runs again at every step);
5. the loop: a batch of the target's sequences through the draft; the loss is the divergence
   (`train.loss`: forward KL or total variation, `pipeline.distillation`) between the target's full
   next-token distribution and the draft's at every completion position; checkpoints in `out`;
6. the draft saved as a Hugging Face model directory with the target's tokenizer; its acceptance
   sum_x min(p, q) on the held-out completions (the saved weights, as the generate job loads them).

Not here: Hydra (the entry point, `jobs/train_draft.py`) or MLflow's calls (`tracking`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from pipeline.distillation import acceptance_sum, law_loss
from pipeline.train_draft import output
from pipeline.train_draft.completions import (
    Sequences,
    TargetLaws,
    cached_completions,
    law_cache_bytes,
    padded_batch,
    read_prompt_ids,
    target_laws,
)
from pipeline.train_draft.config import DraftJobConfig
from pipeline.train_draft.draft_model import build_draft, count_parameters, draft_shape, load_target

log = logging.getLogger("pipeline")

@dataclass
class DraftResult:
    out: str
    draft_parameters: int
    target_parameters: int
    steps: int
    train_seconds: float
    stopped_by: str
    final_loss: float
    acceptance: float  # mean over held-out completion positions of sum_x min(p, q)
    heldout_positions: int
    train_sequences: int
    train_completion_tokens: int
    compare_acceptance: float | None = None
    history: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    kind: str = "model"
    second_acceptance: float | None = None  # feature drafts: at the second drafted token (the head's own features)
    fit_acceptance: float | None = None  # feature drafts: the same measure on training sequences (overfitting: above)

    def generate_command(self, target: str) -> str:
        return f"python -m jobs.generate model.target={target} model.draft={self.out} data.path=PROMPTS"


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def run_train_draft(config: DraftJobConfig, tracker: Any = None) -> DraftResult:
    # 1) checks, before anything is written
    started = time.monotonic()  # train.max_minutes is the whole run's budget: preparation counts
    device = resolve_device(config.device)
    if config.threads:
        torch.set_num_threads(int(config.threads))
    target, tokenizer = load_target(config.model, device)
    shape = draft_shape(target.config, config.draft)
    max_prompt = max(1, int(target.config.max_position_embeddings) - config.train.max_new_tokens - 1)
    train_prompts, heldout_prompts = read_prompt_ids(config.data, tokenizer, max_prompt)
    # the loop draws train.steps x train.batch_size sequences in shuffled passes: no more need completing
    wanted = config.train.steps * config.train.batch_size
    train_prompts = train_prompts[: min(wanted, config.train.sequences or wanted)]
    folder = output.claim_output(config.out, config.run_key())
    # 2) the target's completions (cached for a resume)
    from pipeline.models import eos_token_ids_of

    eos_ids = eos_token_ids_of(target, tokenizer)
    train_set, heldout_set = cached_completions(folder, target, train_prompts, heldout_prompts, config.train, eos_ids)
    if config.draft.kind != "model":
        return _run_feature(config, tracker, folder, target, tokenizer, train_set, heldout_set, eos_ids, device,
                            started)
    # 3) the draft
    draft = build_draft(target, tokenizer, shape, config.draft.init_embedding, seed=config.train.seed).to(device)
    if tracker is not None:
        tracker.started(config, count_parameters(draft), count_parameters(target), len(train_set))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids or [0])[0]
    # 4) the target's laws, once (not kept on disk: a resumed run computes them again, one pass)
    laws = _laws_in_memory(config, target, train_set, pad_id, device)
    # 5) the loop
    loop = _train_model(config, folder, target, draft, train_set, laws, pad_id, device, tracker,
                        time.monotonic() - started)
    # 6) save, then measure the saved weights
    root = Path(config.out).expanduser()
    output.save_draft(root, draft, tokenizer, config.train.save_dtype)
    saved = draft.to(getattr(torch, config.train.save_dtype)).float().eval()
    accepted, positions = heldout_acceptance(target, saved, heldout_set, pad_id, config, device)
    compare = None
    if config.compare_draft:
        other = _load_compare_draft(config.compare_draft, device)
        compare = heldout_acceptance(target, other, heldout_set, pad_id, config, device)[0]
    result = DraftResult(
        out=str(root), draft_parameters=count_parameters(draft), target_parameters=count_parameters(target),
        steps=loop["step"], train_seconds=loop["seconds"], stopped_by=loop["stopped_by"],
        final_loss=loop["loss"], acceptance=accepted, heldout_positions=positions,
        train_sequences=len(train_set), train_completion_tokens=train_set.completion_tokens(),
        compare_acceptance=compare, history=loop["history"],
    )
    output.write_json(folder / "run.json", {"run_key": config.run_key(), "config": config.to_dict(),
                                            "result": {k: v for k, v in vars(result).items() if k != "history"}})
    return result


def _run_feature(config: DraftJobConfig, tracker: Any, folder: Path, target: Any, tokenizer: Any, train_set: Sequences,
                 heldout_set: Sequences, eos_ids: list[int], device: str, started: float) -> DraftResult:
    """Steps 3-6 for a feature draft (`pipeline.train_draft.feature`): the draft vocabulary, the target's
    features and top-k laws from one pass, the head, the loop, the saved head and its held-out acceptance."""
    from pipeline.train_draft import feature
    from spectr.feature_draft import load_feature_draft, save_feature_draft

    train, kind = config.train, config.draft.kind
    vocab = int(target.get_output_embeddings().weight.shape[0])
    draft_ids = feature.frequent_tokens(train_set, config.draft.vocab_size, vocab, eos_ids)
    start = time.monotonic()
    data = feature.collect(target, train_set, feature.feature_layers(target.config, kind), train.temperature,
                           train.top_k, device)
    log.info("the target's features and top-%d laws at %d positions (%.0f MiB) in %.0f s", train.top_k,
             sum(len(t) for t in data.tokens), data.nbytes() / 2**20, time.monotonic() - start)
    head = feature.build_head(target, kind, draft_ids, config.draft.init, train.seed)
    if not config.draft.train_lm_head and head.lm_head is not None:
        head.lm_head.requires_grad_(False)  # the target's own rows, the head's largest matrix: not fitted
    if tracker is not None:
        tracker.started(config, count_parameters(head), count_parameters(target), len(train_set))
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=train.lr,
                                  weight_decay=train.weight_decay, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(train.seed)
    index = feature.draft_index(head)

    def step(rows: list[int]) -> float:
        batch = feature.make_batch(data, rows, device, head.config.hidden_size, train.prompt_positions)
        if train.shuffle_targets:  # negative control: each position gets another position's target law
            feature.shuffle_laws(batch, generator)
        loss, _ = feature.head_loss(head, batch, index, train.unroll, train.regression_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    loop = _train(config, folder, head, optimizer, generator, len(train_set), step, tracker,
                  time.monotonic() - started)
    root = Path(config.out).expanduser()
    save_feature_draft(head, root, dtype=getattr(torch, train.save_dtype))
    tokenizer.save_pretrained(root)  # the target's: the directory is self-contained (the head reads its ids)
    saved = load_feature_draft(root, target, dtype=torch.float32)
    accepted, second, positions, fit = _feature_acceptance(target, saved, train_set, heldout_set, train.temperature,
                                                           device)
    compare = None
    if config.compare_draft:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids or [0])[0]
        other = _load_compare_draft(config.compare_draft, device)
        compare = heldout_acceptance(target, other, heldout_set, pad_id, config, device)[0]
    result = DraftResult(
        out=str(root), draft_parameters=count_parameters(head), target_parameters=count_parameters(target),
        steps=loop["step"], train_seconds=loop["seconds"], stopped_by=loop["stopped_by"], final_loss=loop["loss"],
        acceptance=accepted, heldout_positions=positions, train_sequences=len(train_set),
        train_completion_tokens=train_set.completion_tokens(), compare_acceptance=compare, history=loop["history"],
        kind=kind, second_acceptance=second, fit_acceptance=fit,
    )
    output.write_json(folder / "run.json", {"run_key": config.run_key(), "config": config.to_dict(),
                                            "result": {k: v for k, v in vars(result).items() if k != "history"}})
    return result


def _feature_acceptance(target: Any, head: Any, train_set: Sequences, heldout_set: Sequences, temperature: float,
                        device: str) -> tuple[float, float, int, float]:
    """(held-out acceptance at the first and second drafted token, positions, the same measure on as many
    training sequences): far above the held-out one, the head learnt its training text rather than the target,
    and more prompts help more than more steps."""
    from pipeline.train_draft import feature

    accepted, second, positions = feature.heldout_acceptance(target, head, heldout_set, temperature, device)
    log.info("held-out acceptance: %.3f at the first drafted token, %.3f at the second (own features)",
             accepted, second)
    fitted = Sequences(train_set.token_ids[: len(heldout_set)], train_set.prompt_lengths[: len(heldout_set)])
    fit = feature.heldout_acceptance(target, head, fitted, temperature, device)[0]
    log.info("acceptance on %d training sequences: %.3f", len(fitted), fit)
    return accepted, second, positions, fit


def _laws_in_memory(config: DraftJobConfig, target: Any, train_set: Sequences, pad_id: int,
                    device: str) -> TargetLaws | None:
    """The target's laws at the training positions when they fit in `train.law_cache_gib`, else None (the
    steps run the target)."""
    need = law_cache_bytes(train_set, int(target.config.vocab_size))
    if need > config.train.law_cache_gib * 2**30:
        log.info("the target's laws would take %.1f GiB > train.law_cache_gib=%s: the target runs at every step",
                 need / 2**30, config.train.law_cache_gib)
        return None
    start = time.monotonic()
    laws = target_laws(target, train_set, config.train.temperature, pad_id, device)
    log.info("the target's laws at %d positions (%.1f GiB, float16) in %.0f s", laws.log_probs.shape[0],
             need / 2**30, time.monotonic() - start)
    return laws


def _load_compare_draft(path: str, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()


def learning_rate(config: DraftJobConfig, step: int, progress: float) -> float:
    train = config.train
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return train.lr * (train.min_lr_ratio + (1.0 - train.min_lr_ratio) * cosine)


def _make_optimizer(draft: Any, config: DraftJobConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in draft.named_parameters() if p.ndim >= 2 and "norm" not in n]
    rest = [p for n, p in draft.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": config.train.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=config.train.lr, betas=(0.9, 0.95))


def _train_model(config, folder: Path, target, draft, train_set: Sequences, laws: TargetLaws | None, pad_id: int,
                 device: str, tracker, prepared_s: float) -> dict:
    """The loop for an independent draft: the divergence at every completion position of a batch."""
    optimizer = _make_optimizer(draft, config)
    generator = torch.Generator().manual_seed(config.train.seed)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda")
                else contextlib.nullcontext())

    def step(rows: list[int]) -> float:
        return _train_step(config, target, draft, optimizer, train_set, laws, rows, pad_id, device, autocast,
                           generator)

    return _train(config, folder, draft, optimizer, generator, len(train_set), step, tracker, prepared_s)


def _train(config, folder: Path, draft, optimizer, generator: torch.Generator, count: int, step_fn,
           tracker, prepared_s: float = 0.0) -> dict:
    """Steps of `step_fn(rows) -> loss` over `count` sequences (`batch_rows`), warm-up then cosine by steps or
    minutes, a progress bar, MLflow's step metrics, checkpoints in `folder` (a rerun resumes from the last).
    The loop's budget is what `train.max_minutes` leaves after this run's `prepared_s` (completions, laws or
    features) and the loop seconds of the runs it resumes, minus a reserve for the held-out measure."""
    train = config.train
    step, seconds_before = output.load_checkpoint(folder, draft, optimizer, generator)
    budget_s = None if train.max_minutes is None else max(train.max_minutes * 60.0 - prepared_s - _RESERVE_S, 1.0)
    state = {"step": step, "loss": float("nan"), "stopped_by": "steps", "history": []}
    start = time.monotonic()
    bar = tqdm(total=train.steps, initial=step, disable=not config.show_progress, desc="train_draft",
               dynamic_ncols=True, mininterval=2.0)
    draft.train()
    while state["step"] < train.steps:
        elapsed = seconds_before + time.monotonic() - start
        if budget_s is not None and elapsed >= budget_s:
            state["stopped_by"] = "max_minutes"
            break
        progress = max(state["step"] / train.steps, elapsed / budget_s if budget_s else 0.0)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, state["step"], progress)
        rows = batch_rows(count, train.batch_size, state["step"], train.seed)
        loss = step_fn(rows)
        state["step"] += 1
        state["loss"] = loss
        state["history"].append((state["step"], loss))
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        if tracker is not None:
            tracker.step(state["step"], loss)
        if state["step"] % train.checkpoint_every == 0 and state["step"] < train.steps:
            output.save_checkpoint(folder, draft, optimizer, state["step"], generator,
                                   seconds_before + time.monotonic() - start)
    bar.close()
    state["seconds"] = seconds_before + time.monotonic() - start
    output.save_checkpoint(folder, draft, optimizer, state["step"], generator, state["seconds"])
    draft.eval()
    return state


_RESERVE_S = 60.0  # the held-out measure and the save, after the loop (a few seconds to a minute on 2 cores)


def batch_rows(count: int, batch_size: int, step: int, seed: int) -> list[int]:
    """The sequences of step `step`: draws step * batch_size onwards of successive passes over the `count`
    sequences, each pass a permutation seeded by (seed, pass), so every sequence is used once per pass and a
    resumed run draws what the first would have."""
    rows = []
    for draw in range(step * batch_size, (step + 1) * batch_size):
        rows.append(_permutation(count, seed, draw // count)[draw % count])
    return rows


_PERMUTATIONS: dict[tuple[int, int, int], list[int]] = {}


def _permutation(count: int, seed: int, index: int) -> list[int]:
    key = (count, seed, index)
    if key not in _PERMUTATIONS:
        _PERMUTATIONS.clear()  # the draws only move forward: the current pass is all that is kept
        generator = torch.Generator().manual_seed(seed * 7919 + index)
        _PERMUTATIONS[key] = torch.randperm(count, generator=generator).tolist()
    return _PERMUTATIONS[key]


def _train_step(config, target, draft, optimizer, train_set, laws, rows, pad_id, device, autocast,
                generator) -> float:
    """One batch of the target's sequences: the divergence at every completion position, one optimiser step.

    The draft's head runs at the completion positions only (the loss reads no other)."""
    inputs, attention, loss_mask = (t.to(device) for t in padded_batch(train_set, rows, pad_id))  # [B, T] each
    temperature = config.train.temperature
    if laws is not None:
        target_log_probs = laws.rows_of(rows).to(device)  # [N, V]
    else:
        with torch.no_grad(), autocast:
            logits = target(input_ids=inputs, attention_mask=attention).logits[loss_mask]  # [N, V]
        target_log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)  # [N, V]
    if config.train.shuffle_targets:  # negative control: each position gets another position's target law
        order = torch.randperm(target_log_probs.shape[0], generator=generator).to(device)
        target_log_probs = target_log_probs[order]
    with autocast:
        hidden = draft.model(input_ids=inputs, attention_mask=attention).last_hidden_state[loss_mask]  # [N, H]
        draft_logits = draft.lm_head(hidden)  # [N, V]
    loss = law_loss(draft_logits, target_log_probs, config.train.loss, temperature)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(draft.parameters(), config.train.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


@torch.no_grad()
def heldout_acceptance(target, draft, heldout: Sequences, pad_id: int, config: DraftJobConfig, device: str,
                       batch_size: int = 8) -> tuple[float, int]:
    """(mean over the held-out completion positions of sum_x min(p, q), number of positions), at the
    training temperature: the single-draft acceptance of speculative sampling on the target's own text."""
    total, positions = 0.0, 0
    for start in range(0, len(heldout), batch_size):
        rows = list(range(start, min(start + batch_size, len(heldout))))
        inputs, attention, mask = (t.to(device) for t in padded_batch(heldout, rows, pad_id))  # [B, T] each
        target_logits = target(input_ids=inputs, attention_mask=attention).logits  # [B, T, V]
        draft_logits = draft(input_ids=inputs, attention_mask=attention).logits  # [B, T, V]
        accepted, count = acceptance_sum(draft_logits, target_logits, mask, config.train.temperature)
        total, positions = total + accepted, positions + count
    return total / max(positions, 1), positions
