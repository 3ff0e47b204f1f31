"""Traversal verification (Weng et al., NeurIPS 2025, arXiv 2505.12398): K drafts verified as one prefix
tree, leaves first, each path judged as a whole sequence. Exact for any K; K = 1 is block verification.

Notation as in the rest of the engine: p is the draft's law, q the target's. The K drafts form the prefix
tree of `spectr.tree` (drafts that share a prefix are one node; a node's leader is the smallest draft
index through it). A node's children are visited in the order the drafts first reached them, i.e. by
leader: that order is what makes the tree's i.i.d. drafts act as children drawn without replacement
(ordering them by token id instead breaks exactness; the tests' negative control).

- w(root) = 1; w(c) = min(1, w(b) * q_b(c) / p_b(c)) for a child c of b, top-down (p_b(c) = 0: ratio inf);
  w stays 0 under a node of w 0.
- Loop: a = the first leaf in post-order (from the root follow each node's first remaining child).
  If a is the root, stop: the token after it is drawn from q_root (a residual by then).
  Test a: accepted iff u < w(a); then the path to a is kept and the next token is drawn from q_a
  (the target's own at depth L, a residual above).
  Else delete a; with b = parent(a): r = (w(b) q_b - p_b)+, S = sum r; S > 0: w(b) = S / (S + 1 - w(b)),
  q_b = r / S; S = 0: w(b) = 0. p_b loses a's token (renormalised). The w of b's remaining
  descendants follow top-down.

The tests run in post-order whatever their outcomes, so a row needs at most (nodes - 1) tests, each at a
node tested once: node (leader k, depth d) reads uniform [d - 1, k] of the row's [L + 1, K + 1]
selection block, the last token reads [L, K] (K = 1: block verification's own slots, so the same
uniforms give the same tokens). The block of the other rules is enough; no more uniforms are drawn.

Batched: the loop runs min(M - 1, K L) steps (M = node_target_probs.shape[1], the widest tree: a shape,
no device read), every row every step, with masks; no Python loop over rows. A row keeps only its
current path: the state of the path's nodes (w per depth, q and p of the nodes that lost a child) and
where it stands. After deleting a, the next leaf is found locally: the next sibling of a (the child of b
with the next larger leader j) starts a fresh subtree whose first leaf is draft j's own leaf at depth L;
without one, b itself. Each step costs O(V) per row (one residual) plus O(K + L).

This module does not draft, run models or touch caches; its slow reference is
`spectr.reference.reference_traversal_sequence` (and `traversal_output_distribution`, the exact law).
"""

from __future__ import annotations

import torch

from spectr.outcome import PAD_TOKEN, SequenceSelection
from spectr.rng import sample_categorical
from spectr.tree import prefix_leaders

_TINY = torch.finfo(torch.float64).tiny


def _descend(w_above: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """w of a child from its parent's w [R] and the ratio q/p of its token at the parent [R]."""
    return torch.where(w_above > 0, torch.clamp(w_above * ratio, max=1.0), 0.0)


def _ratio(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """q / p, inf where p = 0 (float64)."""
    return torch.where(p > 0, q / p.clamp(min=_TINY), torch.inf)


def _weigh_path(weights: torch.Tensor, ratios: torch.Tensor, start: torch.Tensor,
                enter: torch.Tensor) -> torch.Tensor:
    """For the rows `enter` [B]: w of depths start..L [B] along a path with `ratios` [B, L] (depth i's at
    i - 1), from w at depth start - 1. weights [B, L + 1] float64 -> the new weights."""
    columns = [weights[:, 0]]
    for depth in range(1, weights.shape[1]):
        chained = _descend(columns[-1], ratios[:, depth - 1])
        columns.append(torch.where(enter & (depth >= start), chained, weights[:, depth]))
    return torch.stack(columns, 1)


def select_traversal(
    draft_tokens: torch.Tensor,  # [B, K, L] int64, drafts in sampling order
    draft_probs: torch.Tensor,  # [B, K, L, V]: p of draft k's prefix of length i (its leader's row is read)
    node_target_probs: torch.Tensor,  # [B, M, V] q per tree node
    node_of: torch.Tensor,  # [B, K, L + 1] int64 node of draft k's prefix of length i
    uniforms: torch.Tensor,  # [B, L + 1, K + 1] float64
) -> SequenceSelection:
    """Traversal verification of one tree per row -> `SequenceSelection` (see the module docstring)."""
    batch, num_drafts, length = draft_tokens.shape
    device = draft_tokens.device
    rows = torch.arange(batch, device=device)  # [B]
    drafts = torch.arange(num_drafts, device=device)  # [K]
    depths = torch.arange(length, device=device)  # [L]
    leader = prefix_leaders(draft_tokens)  # [B, K, L + 1]
    is_node = leader == drafts[None, :, None]  # [B, K, L + 1] node (k, d) exists iff k leads it
    target_node = node_of.gather(1, leader)  # [B, K, L + 1] q's row of node (leader, d)
    # the original q / p of every draft's token at its parent, depth i + 1's at i: [B, K, L]
    token_q = node_target_probs[rows[:, None, None], target_node[:, :, :length], draft_tokens]
    token_p = draft_probs[rows[:, None, None], leader[:, :, :length], depths, draft_tokens]
    ratios = _ratio(token_q.to(torch.float64), token_p.to(torch.float64))  # [B, K, L]

    # The row's current path: node (k, d) it stands at, w per depth, and the state of the path's internal
    # nodes: q (residual) and p (children removed), valid where `touched` (else the originals).
    k = torch.zeros(batch, dtype=torch.int64, device=device)  # [B] leader of the current node
    d = torch.full((batch,), length, dtype=torch.int64, device=device)  # [B] its depth
    ones = torch.ones(batch, dtype=torch.bool, device=device)
    weights = _weigh_path(torch.ones(batch, length + 1, dtype=torch.float64, device=device), ratios[:, 0],
                          torch.ones_like(k), ones)  # [B, L + 1] w along draft 0's path
    vocab = node_target_probs.shape[-1]
    path_q = torch.zeros(batch, length, vocab, dtype=torch.float64, device=device)  # [B, L, V]
    path_p = torch.zeros(batch, length, vocab, dtype=torch.float64, device=device)  # [B, L, V]
    touched = torch.zeros(batch, length, dtype=torch.bool, device=device)  # [B, L]
    accepted = torch.zeros(batch, dtype=torch.bool, device=device)  # [B] the current node was accepted

    steps = min(node_target_probs.shape[1] - 1, num_drafts * length)  # tests per row <= non-root nodes
    for _ in range(steps):
        # Invariant: a row not accepted stands at the first leaf of its remaining tree (the root: done).
        testing = ~accepted & (d > 0)  # [B]
        above = (d - 1).clamp(min=0)  # [B] depth of the parent b
        u = uniforms[rows, above, k]  # [B]
        w_here = weights.gather(1, d[:, None]).squeeze(1)  # [B]
        accepted = accepted | (testing & (u < w_here))
        rejected = testing & ~accepted  # [B]
        # delete the current node a: its parent b = (leader of draft k at depth d - 1, d - 1)
        parent = leader[rows, k, above]  # [B]
        token = draft_tokens[rows, k, above]  # [B] a's token
        fresh = ~touched[rows, above, None]  # [B, 1]
        q_b = torch.where(fresh, node_target_probs[rows, target_node[rows, parent, above]].to(torch.float64),
                          path_q[rows, above])  # [B, V]
        p_b = torch.where(fresh, draft_probs[rows, parent, above].to(torch.float64), path_p[rows, above])
        w_b = weights.gather(1, above[:, None])  # [B, 1]
        residual = (w_b * q_b - p_b).clamp_(min=0)  # [B, V]
        mass = residual.sum(-1, keepdim=True)  # [B, 1]
        w_b = torch.where(mass > 0, mass / (mass + (1.0 - w_b)).clamp(min=_TINY), 0.0)  # [B, 1]
        q_b = torch.where(mass > 0, residual / mass.clamp(min=_TINY), q_b)
        p_b = p_b.scatter(1, token[:, None], 0.0)
        kept = p_b.sum(-1, keepdim=True)  # [B, 1]
        p_b = torch.where(kept > 0, p_b / kept.clamp(min=_TINY), p_b)
        path_q[rows, above] = torch.where(rejected[:, None], q_b, path_q[rows, above])
        path_p[rows, above] = torch.where(rejected[:, None], p_b, path_p[rows, above])
        touched[rows, above] = touched[rows, above] | rejected
        w_b = torch.where(rejected[:, None], w_b, weights.gather(1, above[:, None]))
        weights = weights.scatter(1, above[:, None], w_b)
        # the next leaf: the first leaf of a's next sibling (leader j > k), else b itself
        sibling = ((leader[rows, :, above] == parent[:, None]) & is_node[rows, :, d]
                   & (drafts[None, :] > k[:, None]))  # [B, K]
        enter = rejected & sibling.any(1)  # [B]
        j = sibling.to(torch.int8).argmax(1)  # [B]
        sibling_token = draft_tokens[rows, j, above]  # [B]
        entry = _ratio(q_b.gather(1, sibling_token[:, None]), p_b.gather(1, sibling_token[:, None]))  # [B, 1]
        path_ratios = ratios[rows, j].scatter(1, above[:, None], entry)  # [B, L] entry at depth d
        weights = _weigh_path(weights, path_ratios, d, enter)
        touched = touched & ~(enter[:, None] & (depths[None, :] >= d[:, None]))  # the new subtree is fresh
        up = rejected & ~enter
        k = torch.where(enter, j, torch.where(up, parent, k))
        d = torch.where(enter, length, torch.where(up, above, d))

    # Rows not accepted stand at the root (d = 0, k = 0). The last token: q of the node they stand at,
    # the target's own at depth L, else the node's residual.
    leaf_q = node_target_probs[rows, target_node[rows, k, length]].to(torch.float64)  # [B, V]
    last_q = torch.where((d == length)[:, None], leaf_q, path_q[rows, d.clamp(max=length - 1)])
    last = sample_categorical(last_q, uniforms[:, length, num_drafts])  # [B]
    kept_positions = depths[None, :] < d[:, None]  # [B, L]
    out = torch.full((batch, length + 1), PAD_TOKEN, dtype=torch.int64, device=device)
    out[:, :length] = torch.where(kept_positions, draft_tokens[rows, k], PAD_TOKEN)
    out.scatter_(1, d[:, None], last[:, None])
    return SequenceSelection(tokens=out, num_tokens=d + 1, num_accepted=d, draft_index=k,
                             accepted_per_position=kept_positions.sum(0))
