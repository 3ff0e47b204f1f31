"""Acceptance for the planner: exact per-position acceptance of each selection rule, and a model of it.

From (p, q) pairs collected along target-sampled continuations of the job's own prompts
(`collect_distributions`), `AcceptanceModel` says, for any candidate (method, K, L), how likely a call is
to accept at least j draft tokens (`reach`) and so how many tokens a target call yields on average
(`expected_tokens`):

- position 1 with K drafts alive: K-SEQ's exact acceptance 1 - (1 - β(ρ*))^K
  (`spectr.selection.kseq_acceptance`), SpecInfer's exact 1 - Π_i (1 - γ_i)
  (`specinfer_acceptance_curve`), or Σ min(p, q) for one draft;
- later positions: after an acceptance usually one draft is still alive, so they are taken at the
  single-draft rate Σ min(p, q) (a lower bound when drafts coincide);
- the rates along one continuation are multiplied position by position and averaged over start
  positions, so heterogeneous contexts are not averaged away (E[α^j] >= E[α]^j).

`calibrated` rescales the model to what a run actually measured (`GenerationStats`).
Not here: costs (`spectr.planner.table`, `spectr.planner.choose`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

import spectr
from spectr.selection import kseq_acceptance
from spectr.warps import SamplingWarp

AUTOREGRESSIVE = "autoregressive"
MULTI_DRAFT = ("spectr", "specinfer")


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




@dataclass(frozen=True)
class AcceptanceModel:
    """Per-position acceptance along continuations: single-draft rates and first-position rates per K.

    single: [N] Σ min(p, q) per position; first: method -> K -> [N] first-position acceptance with K
    drafts; segments: the length of each continuation (positions are consecutive within one).
    scale: a calibration factor on the probability of reaching each position (1 = as computed), fitted
    to a measured run (`calibrated`); one factor for every candidate, since they share the pair.
    """

    single: torch.Tensor
    first: dict[str, dict[int, torch.Tensor]]
    segments: tuple[int, ...]
    scale: float = 1.0

    @classmethod
    def from_distributions(
        cls,
        draft_probs: torch.Tensor,
        target_probs: torch.Tensor,
        segments: Sequence[int] | None = None,
        num_drafts: Sequence[int] = (2, 4, 8),
    ) -> AcceptanceModel:
        """draft_probs, target_probs: [N, V] float64 rows; segments: lengths of the continuations (sum N)."""
        if draft_probs.shape != target_probs.shape or draft_probs.dim() != 2:
            raise ValueError(
                f"expected two [N, V] tensors of one shape, got {tuple(draft_probs.shape)} and {tuple(target_probs.shape)}"
            )
        segments = tuple(segments) if segments is not None else (draft_probs.shape[0],)
        if sum(segments) != draft_probs.shape[0]:
            raise ValueError(f"segments sum to {sum(segments)}, but there are {draft_probs.shape[0]} positions")
        single = torch.minimum(draft_probs, target_probs).sum(-1).clamp(0.0, 1.0)  # [N]
        ks = sorted({int(k) for k in num_drafts})
        curve = specinfer_acceptance_curve(draft_probs, target_probs, max(ks))  # [N, Kmax]
        first = {
            "spectr": {k: kseq_acceptance(draft_probs, target_probs, k).clamp(0.0, 1.0) for k in ks},
            "specinfer": {k: curve[:, k - 1] for k in ks},
        }
        return cls(single, first, segments)

    def first_position(self, method: str, num_drafts: int) -> torch.Tensor:
        """[N] acceptance at position 1 of a call."""
        if method in MULTI_DRAFT and num_drafts > 1:
            if num_drafts not in self.first[method]:
                raise KeyError(f"no {method} acceptance for K={num_drafts}; known: {sorted(self.first[method])}")
            return self.first[method][num_drafts]
        return self.single

    def reach(self, method: str, num_drafts: int, draft_length: int) -> list[float]:
        """s_j, j = 0..L: probability that a call accepts at least j draft tokens (s_0 = 1)."""
        if method == AUTOREGRESSIVE:
            return [1.0]
        first = self.first_position(method, num_drafts)
        scale = self.scale
        reach = [1.0]
        for j in range(1, draft_length + 1):
            values = []
            start = 0
            for length in self.segments:
                if length >= j:
                    window = first[start : start + length - j + 1].clone()  # [length - j + 1]
                    for m in range(1, j):
                        window = window * self.single[start + m : start + length - j + 1 + m]
                    values.append(window)
                start += length
            mean = float(torch.cat(values).mean()) if values else 0.0
            reach.append(min(1.0, mean * scale))
        return reach

    def expected_tokens(self, method: str, num_drafts: int, draft_length: int) -> float:
        """Mean tokens one target call yields per row: accepted draft tokens + the correction or bonus."""
        return sum(self.reach(method, num_drafts, draft_length))

    def calibrated(
        self, method: str, num_drafts: int, draft_length: int, accepted_per_position: Sequence[int], calls: int
    ) -> AcceptanceModel:
        """A copy scaled so that this candidate's expected accepted tokens match a measured run's.

        accepted_per_position[j]: calls that accepted draft position j (0-based), over `calls` target calls.
        (Exact while no reach is capped at 1.)
        """
        if method == AUTOREGRESSIVE or calls <= 0:
            return self
        predicted = self.expected_tokens(method, num_drafts, draft_length) - 1.0
        measured = sum(accepted_per_position[:draft_length]) / calls
        factor = self.scale * measured / predicted if predicted > 0 else self.scale
        return AcceptanceModel(self.single, self.first, self.segments, factor)
