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
  q_b = r / S; S = 0: w(b) = 0. p_b loses a's token: p_b(x) / (1 - p_b(token of a)), the law of the
  next distinct child. The w of b's remaining descendants follow top-down.

Uniforms: the tests run in post-order whatever their outcomes (an acceptance only ends them), so a row
makes at most (nodes - 1) tests, each at a node tested once: node (leader k, depth d) reads uniform
[d - 1, k] of the row's [L + 1, K + 1] selection block and the last token reads [L, K] (K = 1: block
verification's own slots, so the same uniforms give the same tokens). The block the other rules read is
enough; no more uniforms are drawn.

Batched: each row's schedule is computed before the loop from its tree alone (`post_order`): test t is
node t of the post-order; its parent b still has its original q and p iff it is b's first child; b's p
after deletions is its original without the deleted children's tokens (known from the schedule) over
1 - their mass; after a rejection the next node is b or the first leaf of the next sibling's subtree,
draft j's own leaf at depth L, whose path's w follow in closed form (w_i = min(1, w_{i-1} r_i) is
exp(C_i - max_{m <= i} C_m) for the cumulative log-ratios C). The loop runs min(M - 1, K L) steps
(M = node_target_probs.shape[1], the widest tree: a shape, no device read), every row every step with
masks, no Python loop over rows; a row keeps w along its current path and the residual q of the path's
nodes that lost a child. A step costs a few passes over one [V] row per row (one residual) plus O(K + L).

This module does not draft, run models or touch caches; its slow reference is
`spectr.reference.reference_traversal_sequence` (and `traversal_output_distribution`, the exact law).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spectr.outcome import PAD_TOKEN, SequenceSelection
from spectr.rng import sample_categorical
from spectr.tree import prefix_leaders

_TINY = torch.finfo(torch.float64).tiny
_LOG_CAP = 1e4  # log of an infinite ratio (p = 0): any w > 0 times it is capped at 1, and 0 stays 0


def _log_ratio(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """log(q / p) in float64, -inf where q = 0, _LOG_CAP where p = 0 < q (an infinite ratio)."""
    q, p = q.to(torch.float64), p.to(torch.float64)
    ratio = torch.where(p > 0, q / p.clamp(min=_TINY), torch.inf)
    return ratio.log().clamp(max=_LOG_CAP)


def post_order(leader: torch.Tensor) -> torch.Tensor:
    """The nodes of each row's tree in post-order (children by leader), then the root, then non-nodes.

    leader [B, K, L + 1] -> [B, K (L + 1)] int64 flat slots k (L + 1) + d of (draft k, depth d); node
    (k, d) exists where leader[b, k, d] = k. Sorted by the path's leaders (l_1, ..., l_d, K, ..., K):
    a subtree before its root, siblings by leader (a radix sort: L stable sorts, last depth first).
    """
    batch, num_drafts, width = leader.shape
    depth = torch.arange(width, device=leader.device)  # [L + 1]
    is_node = leader == torch.arange(num_drafts, device=leader.device)[None, :, None]  # [B, K, L + 1]
    order = torch.arange(num_drafts * width, device=leader.device).expand(batch, -1)  # [B, N]
    for i in range(width - 1, 0, -1):
        digit = torch.where(depth >= i, leader[:, :, i : i + 1], num_drafts)  # [B, K, L + 1]
        if i == 1:
            digit = torch.where(is_node, digit, num_drafts + 1)  # non-nodes after the root
        keys = digit.reshape(batch, -1).gather(1, order)  # [B, N]
        order = order.gather(1, torch.sort(keys, dim=1, stable=True).indices)
    return order


@dataclass
class _Schedule:
    """Each row's tests in post-order, one column per step t (see `_schedule`); T = the number of steps."""

    node_k: torch.Tensor  # [B, T + 1] the leader of the t-th node of the post-order
    node_d: torch.Tensor  # [B, T + 1] its depth
    columns: tuple  # per-step tensors [B, T, ...] in the order `_run` unpacks them

    def steps(self):
        return zip(*(column.unbind(1) for column in self.columns))


def _log_ratios(draft_tokens, draft_probs, node_target_probs, leader, target_node) -> torch.Tensor:
    """log q / p of every draft's token at its parent, by the token's depth 0..L + 1 (0, L + 1: padding)
    -> [B, K, L + 2] float64."""
    batch, _, length = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)[:, None, None]  # [B, 1, 1]
    depths = torch.arange(length, device=draft_tokens.device)  # [L]
    token_q = node_target_probs[rows, target_node[:, :, :length], draft_tokens]  # [B, K, L]
    token_p = draft_probs[rows, leader[:, :, :length], depths, draft_tokens]  # [B, K, L]
    return torch.nn.functional.pad(_log_ratio(token_q, token_p), (1, 1))


def _schedule(draft_tokens, leader, target_node, log_ratios, steps: int, nodes: int) -> _Schedule:
    """Test t is node (k_t, d_t), the t-th of the post-order, for t < T = `steps`; all columns [B, T, ...]."""
    batch, num_drafts, length = draft_tokens.shape
    device = draft_tokens.device
    column = torch.arange(batch, device=device)[:, None]  # [B, 1]
    drafts = torch.arange(num_drafts, device=device)  # [K]
    order = post_order(leader)[:, : steps + 1]  # [B, T + 1]
    node_k, node_d = order // (length + 1), order % (length + 1)  # [B, T + 1]
    k, d = node_k[:, :steps], node_d[:, :steps]  # [B, T] the tested nodes
    real = (leader[column, k, d] == k) & (d > 0)  # [B, T] a node other than the root
    above = (d - 1).clamp(min=0)  # [B, T] the parent's depth
    parent = leader[column, k, above]  # [B, T] the parent's leader
    first_child = k == parent  # [B, T] the parent has lost no child yet: its q, p are the originals
    token = draft_tokens[column, k, above]  # [B, T]
    q_row = column * nodes + target_node[column, parent, above]  # [B, T] the parent's q in [B M, V]
    p_row = (column * num_drafts + parent) * length + above  # [B, T] the parent's p in [B K L, V]
    state_row = column * (length + 1) + above  # [B, T] the parent's stored q in [B (L + 1), V]
    # the parent's children deleted before this one (leader < k): p at the parent is p without their tokens
    children = leader[column, :, above].eq(parent[..., None]) & (leader[column, :, d] == drafts)  # [B, T, K]
    elder = children & (drafts < k[..., None])  # [B, T, K]
    elder_tokens = torch.where(elder, draft_tokens[column, :, above], token[..., None])  # [B, T, K] (pad: own)
    # after a rejection: the parent next, or the next sibling's subtree (its root at depth d, draft k_{t+1})
    enters = node_d[:, 1:] != d - 1  # [B, T]
    next_token = draft_tokens[column, node_k[:, 1:], above]  # [B, T] the sibling's token
    axis = torch.arange(length + 2, device=device)  # [L + 2] depths, L + 1: scratch
    path_logs = torch.where(axis > d[..., None], log_ratios[column, node_k[:, 1:]], 0.0)  # [B, T, L + 2]
    at_entry = axis == d[..., None]  # [B, T, L + 2]
    chained = (axis >= d[..., None]) & (axis <= length) & enters[..., None]  # [B, T, L + 2]
    return _Schedule(node_k, node_d, (real, d, above, first_child, k, token, q_row, p_row, state_row,
                                      next_token, elder, elder_tokens, path_logs, at_entry, chained))


def _run(schedule: _Schedule, uniforms, weights, target_rows, draft_rows, path_q) -> torch.Tensor:
    """The tests, one step per column of the schedule, every row with masks -> the step that accepted [B]
    (-1: none, the root). weights [B, L + 2] (w along the current path; L + 1: scratch) and path_q
    [B (L + 1), V] (q of the path's nodes that lost a child; slot L: scratch) are updated in place."""
    batch, length = weights.shape[0], weights.shape[1] - 2
    rows = torch.arange(batch, device=weights.device)  # [B]
    scratch = rows * (length + 1) + length  # [B] the scratch slot of each row
    accepted_at = torch.full((batch,), -1, dtype=torch.int64, device=weights.device)  # [B]
    for t, (real_t, d_t, above_t, fresh_t, k_t, token_t, q_row_t, p_row_t, state_t, next_t, elder_t, removed_t,
            logs_t, entry_t, chained_t) in enumerate(schedule.steps()):
        testing = real_t & (accepted_at < 0)  # [B]
        passes = uniforms[rows, above_t, k_t] < weights.gather(1, d_t[:, None]).squeeze(1)  # [B] u[d - 1, k] < w
        accepted_at = torch.where(testing & passes, t, accepted_at)
        rejected = testing & ~passes  # [B]
        # delete the node: its parent b gets the residual, w = S / (S + 1 - w), q = the residual normalised
        q_b = torch.where(fresh_t[:, None], target_rows.index_select(0, q_row_t),
                          path_q.index_select(0, state_t))  # [B, V] float64
        p_orig = draft_rows.index_select(0, p_row_t)  # [B, V] p at b before any deletion
        p_elder = p_orig.gather(1, removed_t)  # [B, K]
        p_b = p_orig.scatter(1, removed_t, torch.where(elder_t, 0.0, p_elder))  # [B, V] the elders' tokens out
        left = 1.0 - torch.where(elder_t, p_elder.to(torch.float64), 0.0).sum(1, keepdim=True)  # [B, 1]
        w_b = weights.gather(1, above_t[:, None])  # [B, 1]
        residual = torch.addcmul(w_b * q_b, p_b, -1.0 / left.clamp(min=_TINY)).clamp_(min=0)  # [B, V]
        mass = residual.sum(-1, keepdim=True)  # [B, 1]
        w_b = torch.where(mass > 0, mass / (mass + (1.0 - w_b)).clamp(min=_TINY), 0.0)  # [B, 1]
        q_b = torch.where(mass > 0, residual / mass.clamp(min=_TINY), q_b)
        path_q.index_copy_(0, torch.where(rejected, state_t, scratch), q_b)  # rows not rejecting: scratch
        weights.scatter_(1, torch.where(rejected, above_t, length + 1)[:, None], w_b)
        # entering the next sibling's subtree: w from b's new state down its first leaf's path, where p at b
        # is now without this node's token too
        p_own = p_orig.gather(1, token_t[:, None]).to(torch.float64)  # [B, 1]
        p_next = p_orig.gather(1, next_t[:, None]) / (left - p_own).clamp(min=_TINY)  # [B, 1]
        entry = _log_ratio(q_b.gather(1, next_t[:, None]), p_next) + w_b.log()  # [B, 1]
        logs = torch.where(entry_t, entry, logs_t).cumsum(1)  # [B, L + 2] C_i from b's depth
        weights.copy_(torch.where(chained_t & rejected[:, None], (logs - logs.cummax(1).values).exp(), weights))
    return accepted_at


def select_traversal(
    draft_tokens: torch.Tensor,  # [B, K, L] int64, drafts in sampling order
    draft_probs: torch.Tensor,  # [B, K, L, V]: p of draft k's prefix of length i (its leader's row is read)
    node_target_probs: torch.Tensor,  # [B, M, V] q per tree node
    node_of: torch.Tensor,  # [B, K, L + 1] int64 node of draft k's prefix of length i
    uniforms: torch.Tensor,  # [B, L + 1, K + 1] float64
) -> SequenceSelection:
    """Traversal verification of one tree per row -> `SequenceSelection` (see the module docstring)."""
    batch, num_drafts, length = draft_tokens.shape
    nodes, vocab = node_target_probs.shape[1:]
    device = draft_tokens.device
    rows = torch.arange(batch, device=device)  # [B]
    leader = prefix_leaders(draft_tokens)  # [B, K, L + 1]
    target_node = node_of.gather(1, leader)  # [B, K, L + 1] q's row of node (leader, d)
    log_ratios = _log_ratios(draft_tokens, draft_probs, node_target_probs, leader, target_node)  # [B, K, L + 2]
    # 1) the schedule: at most T = min(M - 1, K L) tests per row (its non-root nodes)
    schedule = _schedule(draft_tokens, leader, target_node, log_ratios, min(nodes - 1, num_drafts * length), nodes)
    # 2) w along draft 0's path (its leaf is tested first): exp(C_i - max(0, C_1..C_i)), and no stored q yet
    path = torch.where(torch.arange(1, length + 2, device=device) <= length, log_ratios[:, 0, 1:], 0.0).cumsum(1)
    weights = torch.cat([torch.ones_like(path[:, :1]), (path - path.cummax(1).values.clamp(min=0)).exp()], 1)
    path_q = torch.zeros(batch * (length + 1), vocab, dtype=torch.float64, device=device)  # [B (L + 1), V]
    # 3) the tests
    accepted_at = _run(schedule, uniforms, weights, node_target_probs.reshape(-1, vocab),
                       draft_probs.reshape(-1, vocab), path_q)  # [B]
    # 4) the accepted node (the root where none was) and the token after it: the target's own q at depth L,
    # else the node's residual
    done, step = accepted_at >= 0, accepted_at.clamp(min=0)[:, None]  # [B], [B, 1]
    k = torch.where(done, schedule.node_k.gather(1, step).squeeze(1), 0)  # [B]
    d = torch.where(done, schedule.node_d.gather(1, step).squeeze(1), 0)  # [B]
    leaf_q = node_target_probs[rows, target_node[rows, k, length]].to(torch.float64)  # [B, V]
    last_q = torch.where((d == length)[:, None], leaf_q, path_q.index_select(0, rows * (length + 1) + d))
    last = sample_categorical(last_q, uniforms[:, length, num_drafts])  # [B]
    kept = torch.arange(length, device=device)[None, :] < d[:, None]  # [B, L]
    out = torch.full((batch, length + 1), PAD_TOKEN, dtype=torch.int64, device=device)
    out[:, :length] = torch.where(kept, draft_tokens[rows, k], PAD_TOKEN)
    out.scatter_(1, d[:, None], last[:, None])
    return SequenceSelection(tokens=out, num_tokens=d + 1, num_accepted=d, draft_index=k,
                             accepted_per_position=kept.sum(0))
