"""Block verification (Sun, Mendlovic, Leviathan, Aharoni, Ro, Beirami, Suresh, ICLR 2025): one draft
of L tokens verified jointly, which is optimal among single-draft verifiers.

Notation: one draft X_1..X_L per row (K = 1); p_i = p(. | X_<i) and q_i = q(. | X_<i) for
i = 1..L + 1 (q_{L+1} gives the bonus token).

- w_0 = 1; w_i = min(1, w_{i-1} * q_i(X_i) / p_i(X_i))   (a draft token with p = 0 counts as ratio inf).
- For i < L: S_i = sum_x max(w_i * q_{i+1}(x) - p_{i+1}(x), 0) and h_i = S_i / (S_i + 1 - w_i),
  h_i = 1 where the denominator is 0; h_L = w_L.
- With eta_1..eta_L i.i.d. U(0, 1): tau = the largest i with eta_i <= h_i (0 if none); keep X_<=tau.
- If tau < L the next token is drawn from norm(max(w_tau * q_{tau+1} - p_{tau+1}, 0)) (from q_{tau+1}
  if that mass is zero, a case of probability 0); if tau = L it is the bonus token from q_{L+1}.

Accepted tokens are X_1..X_tau, the correction (tau < L) or bonus (tau = L) token follows.
Uniforms: the selection block `[B, L + 1, 2]` of a K = 1 iteration (spectr.rng): eta_i is
column 0 of row i - 1, the last token's uniform is column 1 of row L. Every op runs for every
row (no host reads). The rule registered as "block" in `SEQUENCE_RULES`; `block_rule` builds
variants with another stopping probability (the tests' negative controls).

This module does not draft, run models, or touch caches; its slow reference is
`spectr.reference.reference_block_sequence`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spectr.outcome import PAD_TOKEN, SequenceSelection
from spectr.rng import sample_categorical

StopProbabilities = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def block_stop_probabilities(weights: torch.Tensor, excess: torch.Tensor) -> torch.Tensor:
    """h_1..h_L from w_1..w_L [B, L] and S_1..S_{L-1} [B, L - 1] (float64) -> [B, L]."""
    w_before_last = weights[:, :-1]  # [B, L - 1]
    denominator = excess + 1.0 - w_before_last
    h = torch.where(denominator > 0, excess / denominator.clamp(min=torch.finfo(torch.float64).tiny), 1.0)
    return torch.cat([h, weights[:, -1:]], 1)


def _weights(draft_tokens: torch.Tensor, draft_p: torch.Tensor, target_q: torch.Tensor) -> torch.Tensor:
    """w_1..w_L [B, L] float64 from the draft tokens [B, L] and p_i, q_i [B, L, V] of their positions."""
    token_p = draft_p.gather(2, draft_tokens[:, :, None]).squeeze(2).to(torch.float64)  # [B, L]
    token_q = target_q.gather(2, draft_tokens[:, :, None]).squeeze(2).to(torch.float64)  # [B, L]
    ratio = torch.where(token_p > 0, token_q / token_p.clamp(min=torch.finfo(torch.float64).tiny), torch.inf)
    weights, w = [], torch.ones_like(ratio[:, 0])  # w_0 = 1
    for i in range(ratio.shape[1]):
        # w stays 0 once 0 (0 * inf would be NaN): a token q cannot produce ends every longer block
        w = torch.where(w > 0, torch.clamp(w * ratio[:, i], max=1.0), 0.0)
        weights.append(w)
    return torch.stack(weights, 1)


def block_rule(stop_probabilities: StopProbabilities):
    """A block-verification sequence rule with the given h (see `select_block` for the signature)."""

    def select(draft_tokens, draft_probs, node_target_probs, node_of, uniforms):
        return select_block(draft_tokens, draft_probs, node_target_probs, node_of, uniforms,
                            stop_probabilities=stop_probabilities)

    return select


def select_block(
    draft_tokens: torch.Tensor,  # [B, 1, L] int64
    draft_probs: torch.Tensor,  # [B, 1, L, V]: p_{i+1} = draft_probs[:, 0, i]
    node_target_probs: torch.Tensor,  # [B, M, V] q per tree node
    node_of: torch.Tensor,  # [B, 1, L + 1] node of the draft's prefix of length i
    uniforms: torch.Tensor,  # [B, L + 1, 2] float64
    *,
    stop_probabilities: StopProbabilities = block_stop_probabilities,
):
    """Block verification of one draft per row -> `SequenceSelection`."""
    batch, num_drafts, length = draft_tokens.shape
    if num_drafts != 1:
        raise ValueError(f"method 'block' verifies exactly one draft per row, got K = {num_drafts}")
    rows = torch.arange(batch, device=draft_tokens.device)
    tokens = draft_tokens[:, 0]  # [B, L]
    p = draft_probs[:, 0]  # [B, L, V] p_1..p_L
    q = node_target_probs[rows[:, None], node_of[:, 0]]  # [B, L + 1, V] q_1..q_{L+1}
    weights = _weights(tokens, p, q[:, :length])  # [B, L] w_1..w_L
    # S_i for i < L: the block residual's mass after X_<=i
    excess = (weights[:, :-1, None] * q[:, 1:length].to(torch.float64) - p[:, 1:].to(torch.float64))
    h = stop_probabilities(weights, excess.clamp_(min=0).sum(-1))  # [B, L] h_1..h_L
    positions = torch.arange(1, length + 1, device=tokens.device)  # [L]
    passes = uniforms[:, :length, 0] <= h  # [B, L] eta_i <= h_i
    tau = torch.where(passes, positions, 0).amax(1)  # [B] the largest passing i, 0 if none
    # the last token: bonus from q_{L+1} when tau = L, else the block residual after X_<=tau
    w_tau = torch.cat([torch.ones_like(weights[:, :1]), weights], 1).gather(1, tau[:, None])  # [B, 1]
    q_next = q.gather(1, tau[:, None, None].expand(-1, 1, q.shape[-1])).squeeze(1)  # [B, V]
    p_next = torch.cat([p, torch.zeros_like(p[:, :1])], 1)  # [B, L + 1, V], zero after the draft
    p_next = p_next.gather(1, tau[:, None, None].expand(-1, 1, p.shape[-1])).squeeze(1)  # [B, V]
    residual = (w_tau * q_next.to(torch.float64) - p_next.to(torch.float64)).clamp_(min=0)  # [B, V]
    # the bonus (tau = L) is drawn from q itself, as is a residual of zero mass
    from_q = (tau == length)[:, None] | (residual.sum(-1, keepdim=True) <= 0)  # [B, 1]
    last = sample_categorical(torch.where(from_q, q_next.to(torch.float64), residual), uniforms[:, length, 1])
    kept = positions[None, :] <= tau[:, None]  # [B, L]
    out = torch.full((batch, length + 1), PAD_TOKEN, dtype=torch.int64, device=tokens.device)
    out[:, :length] = torch.where(kept, tokens, PAD_TOKEN)
    out.scatter_(1, tau[:, None], last[:, None])
    return SequenceSelection(tokens=out, num_tokens=tau + 1, num_accepted=tau,
                             draft_index=torch.zeros_like(tau), accepted_per_position=kept.sum(0))
