"""Token-level optimality: how close K-SEQ and SpecInfer come to the best possible acceptance α_K.

Along target-sampled continuations of held-out prompts we collect, at every position, the warped draft
distribution p and target distribution q (the same warps the engine applies), and average over the
positions, for K = 1..max_drafts:

- K-SEQ: `spectr.selection.kseq_acceptance(p, q, K)` = 1 - (1 - β(ρ*))^K, exact;
- SpecInfer (recursive rejection sampling with replacement, as `spectr.selection.select_specinfer`):
  exact, no Monte Carlo. Round i tests an i.i.d. draft X_i ~ p against the current residual r_i
  (r_1 = q) and accepts with probability Σ_x min(p(x), r_i(x)) =: γ_i, independently of earlier
  rounds; a rejection sets r_{i+1} = norm(max(0, r_i - p)). So P(accept) = 1 - Π_{i<=K} (1 - γ_i)
  (`specinfer_acceptance_curve`);
- the optimum: `spectr.selection.optimal_acceptance(p, q, K)` = α_K.

At K = 1 all three equal Σ min(p, q). This module does not run the generation benchmark.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

import spectr
from spectr.selection import kseq_acceptance, optimal_acceptance
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


@dataclass(frozen=True)
class OptimalityRow:
    num_drafts: int
    kseq: float
    specinfer: float
    optimum: float
    kseq_stderr: float
    specinfer_stderr: float
    optimum_stderr: float

    @property
    def kseq_ratio(self) -> float:
        return self.kseq / self.optimum if self.optimum > 0 else float("nan")

    @property
    def specinfer_ratio(self) -> float:
        return self.specinfer / self.optimum if self.optimum > 0 else float("nan")


@dataclass(frozen=True)
class OptimalityResult:
    rows: list[OptimalityRow]
    num_positions: int
    num_prompts: int


def acceptance_table(
    draft_probs: torch.Tensor, target_probs: torch.Tensor, max_drafts: int
) -> list[OptimalityRow]:
    """Mean (and standard error over positions) of the three acceptances for K = 1..max_drafts.

    draft_probs, target_probs: [N, V], one row per position.
    """
    n = draft_probs.shape[0]
    specinfer = specinfer_acceptance_curve(draft_probs, target_probs, max_drafts)  # [N, K]
    rows = []
    for k in range(1, max_drafts + 1):
        kseq = kseq_acceptance(draft_probs, target_probs, k)  # [N]
        optimum = optimal_acceptance(draft_probs, target_probs, k)  # [N]
        rows.append(
            OptimalityRow(
                num_drafts=k,
                kseq=float(kseq.mean()),
                specinfer=float(specinfer[:, k - 1].mean()),
                optimum=float(optimum.mean()),
                kseq_stderr=_stderr(kseq, n),
                specinfer_stderr=_stderr(specinfer[:, k - 1], n),
                optimum_stderr=_stderr(optimum, n),
            )
        )
    return rows


def _stderr(values: torch.Tensor, n: int) -> float:
    return float(values.std(unbiased=True) / n**0.5) if n > 1 else 0.0


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
    output = spectr.generate(
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


def run_optimality(
    target, draft, prompts, continuation_tokens: int, warp: SamplingWarp, seed: int, max_drafts: int
) -> OptimalityResult:
    draft_probs, target_probs = collect_distributions(target, draft, prompts, continuation_tokens, warp, seed)
    return OptimalityResult(
        rows=acceptance_table(draft_probs, target_probs, max_drafts),
        num_positions=int(draft_probs.shape[0]),
        num_prompts=len(prompts),
    )
