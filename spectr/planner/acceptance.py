"""Exact per-position acceptance of each selection rule, and the (p, q) pairs to evaluate it on.

`specinfer_acceptance_curve` / `specinfer_acceptance`: SpecInfer's exact acceptance with K i.i.d.
drafts, 1 - prod_i (1 - gamma_i) (K-SEQ's is `spectr.selection.kseq_acceptance`);
`collect_distributions`: p and q at every position of target-sampled continuations of prompts
(the benchmark's token-level optimality analysis, `pipeline.benchmark.optimality`).

Not here: the online chooser (`spectr.planner.chooser`), which measures acceptance on real
iterations instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spectr.generate import generate
from spectr.warps import SamplingWarp


def specinfer_acceptance_curve(
    draft_probs: torch.Tensor, target_probs: torch.Tensor, max_drafts: int
) -> torch.Tensor:
    """Exact SpecInfer acceptance for K = 1..max_drafts: [..., V] pair -> [..., max_drafts] float64."""
    if draft_probs.shape != target_probs.shape:
        raise ValueError(
            f"draft_probs has shape {tuple(draft_probs.shape)} but target_probs has {tuple(target_probs.shape)}"
        )
    if isinstance(max_drafts, bool) or not isinstance(max_drafts, int) or max_drafts < 1:
        raise ValueError(f"max_drafts must be an int >= 1, got {max_drafts!r}")
    p = draft_probs.to(torch.float64)  # [..., V]
    residual = target_probs.to(torch.float64)  # [..., V]
    all_rejected = torch.ones(p.shape[:-1], dtype=torch.float64, device=p.device)  # [...]
    curve = []
    for _ in range(max_drafts):
        accept_here = torch.minimum(p, residual).sum(-1).clamp(0.0, 1.0)  # [...] γ_i
        all_rejected = all_rejected * (1.0 - accept_here)
        curve.append(1.0 - all_rejected)
        leftover = (residual - p).clamp(min=0.0)  # [..., V]
        mass = leftover.sum(-1, keepdim=True)  # [..., 1]
        # mass 0 means r == p: γ = 1 and nothing is ever rejected again; keep r.
        residual = torch.where(mass > 0, leftover / mass.clamp(min=torch.finfo(torch.float64).tiny), residual)
    return torch.stack(curve, -1)  # [..., max_drafts]


def specinfer_acceptance(
    draft_probs: torch.Tensor, target_probs: torch.Tensor, num_drafts: int
) -> torch.Tensor:
    """Exact SpecInfer acceptance with `num_drafts` i.i.d. drafts: [..., V] pair -> [...] float64."""
    return specinfer_acceptance_curve(draft_probs, target_probs, num_drafts)[..., -1]


def as_float64_distribution(probs: torch.Tensor) -> torch.Tensor:
    """float32 probabilities [..., V] -> float64 rows renormalised to sum to 1.

    Over a large vocabulary float32 rows sum to 1 only within ~1e-6, outside the float64 tolerance of
    `spectr.selection`'s input checks."""
    probs = probs.to(torch.float64)
    return probs / probs.sum(-1, keepdim=True)


@torch.inference_mode()
def collect_distributions(
    target,
    draft,
    prompts: Sequence[Sequence[int]],
    continuation_tokens: int,
    warp: SamplingWarp,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """p and q at every position of a target-sampled continuation of each prompt: ([N, V], [N, V]).

    The continuation (`continuation_tokens` tokens, EOS not special) is sampled by our autoregressive
    engine from the warped target, seeded `seed + prompt index`; then each model runs once over
    prompt + continuation, without a cache, and the distributions for the continuation tokens are kept.
    """
    output = generate(
        target,
        None,
        prompts,
        method="autoregressive",
        max_new_tokens=continuation_tokens,
        temperature=warp.temperature,
        top_k=warp.top_k,
        top_p=warp.top_p,
        eos_token_id=None,
        seed=[seed + i for i in range(len(prompts))],
    )
    device = next(target.parameters()).device
    draft_rows, target_rows = [], []
    for prompt, continuation in zip(prompts, output.tokens):
        ids = torch.tensor([list(prompt) + continuation[:-1]], device=device)  # [1, P + T - 1]
        start = len(prompt) - 1  # logits at `start` predict the first continuation token
        for model, rows in ((draft, draft_rows), (target, target_rows)):
            logits = model(input_ids=ids, use_cache=False).logits[0, start:]  # [T, V]
            rows.append(as_float64_distribution(warp.probs(logits.float()).cpu()))  # [T, V]
    return torch.cat(draft_rows), torch.cat(target_rows)
