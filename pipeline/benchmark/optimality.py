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

At K = 1 all three equal Σ min(p, q). The exact acceptances and the collection of (p, q) live in
`spectr.planner.acceptance` (the planner uses them too). This module does not run the generation benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spectr.planner.acceptance import (
    collect_distributions,
    specinfer_acceptance_curve,
)
from spectr.selection import kseq_acceptance, optimal_acceptance
from spectr.warps import SamplingWarp


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


def run_optimality(
    target, draft, prompts, continuation_tokens: int, warp: SamplingWarp, seed: int, max_drafts: int
) -> OptimalityResult:
    draft_probs, target_probs = collect_distributions(target, draft, prompts, continuation_tokens, warp, seed)
    return OptimalityResult(
        rows=acceptance_table(draft_probs, target_probs, max_drafts),
        num_positions=int(draft_probs.shape[0]),
        num_prompts=len(prompts),
    )
