"""The traversal tests' negative control: traversal verification with each node's children visited by
token id instead of the order the drafts first reached them (not exact).

`token_order(rule)` wraps a sequence rule: it sorts each row's drafts lexicographically by their tokens
(so that at every node the children's leaders come in token order), runs the rule on the sorted drafts
and maps `draft_index` back. Every draft's draft row is first replaced by its node leader's (the row the
node's children were drawn from), so the sorted drafts read the same p as the original ones.
"""

from __future__ import annotations

import torch

from spectr.tree import prefix_leaders


def lexicographic_order(draft_tokens: torch.Tensor) -> torch.Tensor:
    """[B, K, L] -> [B, K] the drafts of each row sorted by their token sequences (stable)."""
    batch, num_drafts, length = draft_tokens.shape
    order = torch.arange(num_drafts, device=draft_tokens.device).expand(batch, num_drafts)
    for depth in reversed(range(length)):  # least significant position first, stable sorts
        keys = draft_tokens[:, :, depth].gather(1, order)
        order = order.gather(1, torch.sort(keys, dim=1, stable=True).indices)
    return order


def token_order(rule):
    """The sequence rule `rule` on each row's drafts sorted by token id (same signature as `rule`)."""

    def select(draft_tokens, draft_probs, node_target_probs, node_of, uniforms):
        batch, num_drafts, length = draft_tokens.shape
        leader = prefix_leaders(draft_tokens)  # [B, K, L + 1]
        rows = torch.arange(batch, device=draft_tokens.device)[:, None, None]
        depths = torch.arange(length, device=draft_tokens.device)
        draft_probs = draft_probs[rows, leader[:, :, :length], depths]  # [B, K, L, V] the leaders' rows
        node_of = node_of.gather(1, leader)  # [B, K, L + 1]
        order = lexicographic_order(draft_tokens)  # [B, K]
        out = rule(draft_tokens.gather(1, order[:, :, None].expand(-1, -1, length)),
                   draft_probs.gather(1, order[:, :, None, None].expand(draft_probs.shape)),
                   node_target_probs, node_of.gather(1, order[:, :, None].expand(node_of.shape)), uniforms)
        out.draft_index = order.gather(1, out.draft_index[:, None]).squeeze(1)
        return out

    return select
