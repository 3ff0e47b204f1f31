"""The distillation loss shared by the draft trainers: a divergence between the target's full next-token
distribution and the draft's, per position, averaged.

`jobs.train_pair` (the embedded pair) and `jobs.train_draft` (a draft for any target) both use it. Two
divergences, chosen by name:

- `forward_kl`: KL(q || p) = sum_x q(x) (log q(x) - log p(x)), q the target, p the draft: the draft learns
  to cover where the target puts mass (DistillSpec's FKL).
- `tv`: total variation 1/2 sum_x |q(x) - p(x)| = 1 - sum_x min(p(x), q(x)): exactly one minus the
  single-draft acceptance of speculative sampling, so minimising it maximises acceptance (DistillSpec's TVD).

Not here: the data the logits come from, optimisers, any model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOSSES = ("forward_kl", "tv")


def per_position_divergence(
    draft_log_probs: torch.Tensor, target_log_probs: torch.Tensor, loss: str
) -> torch.Tensor:
    """Divergence of the draft from the target at each position. # [...]

    draft_log_probs, target_log_probs: # [..., V] log-probabilities (the target's detached by the caller).
    """
    if loss == "forward_kl":
        return (target_log_probs.exp() * (target_log_probs - draft_log_probs)).sum(-1)
    if loss == "tv":
        return 0.5 * (target_log_probs.exp() - draft_log_probs.exp()).abs().sum(-1)
    raise ValueError(f"unknown distillation loss {loss!r}; known: {', '.join(LOSSES)}")


def distillation_loss(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    loss: str,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Mean divergence over the positions (the `mask`ed ones when given), a scalar.

    draft_logits, target_logits: # [B, T, V]; mask: # [B, T] bool or None. The target is detached and both
    are read in float32 at `temperature` (the law generation samples from).
    """
    draft_log_probs = F.log_softmax(draft_logits.float() / temperature, dim=-1)  # [B, T, V]
    target_log_probs = F.log_softmax(target_logits.detach().float() / temperature, dim=-1)  # [B, T, V]
    divergence = per_position_divergence(draft_log_probs, target_log_probs, loss)  # [B, T]
    if mask is None:
        return divergence.mean()
    weights = mask.to(divergence.dtype)  # [B, T]
    return (divergence * weights).sum() / weights.sum().clamp(min=1.0)


def law_loss(draft_logits: torch.Tensor, target_log_probs: torch.Tensor, loss: str,
             temperature: float = 1.0) -> torch.Tensor:
    """Mean divergence over positions, the target given as its log-probabilities (already at `temperature`,
    e.g. kept from one pass of the target), a scalar.

    draft_logits: # [N, V]; target_log_probs: # [N, V] (float16 is fine: renormalised here in float32).
    """
    draft_log_probs = F.log_softmax(draft_logits.float() / temperature, dim=-1)  # [N, V]
    target = F.log_softmax(target_log_probs.detach().float(), dim=-1)  # [N, V]
    return per_position_divergence(draft_log_probs, target, loss).sum() / max(draft_logits.shape[0], 1)


@torch.no_grad()
def acceptance_sum(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor,
                   temperature: float = 1.0) -> tuple[float, int]:
    """(sum over the masked positions of sum_x min(p(x), q(x)), number of positions).

    draft_logits, target_logits: # [B, T, V]; mask: # [B, T] bool.
    """
    p = F.softmax(draft_logits.float() / temperature, dim=-1)  # [B, T, V]
    q = F.softmax(target_logits.float() / temperature, dim=-1)  # [B, T, V]
    overlap = torch.minimum(p, q).sum(-1)  # [B, T]
    return float(overlap[mask].sum()), int(mask.sum())
