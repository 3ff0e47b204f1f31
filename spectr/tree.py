"""The draft tree: K drafts of L tokens per row as a prefix tree, and its verification layout.

Drafts that share a prefix share one *node*. A node is named two ways:

- by its **leader**: the smallest draft index whose prefix it is. `leader[b, k, i]` is the
  leader of draft k's prefix of length i (i = 0 is the root, whose leader is draft 0). The
  drafter computes one draft-model row per draft and depth, and a node's distribution p is
  *the leader's row*: every child token of the node is sampled from it, and the selection
  reads it (`draft_probs[b, leader, i]`), so both use the same numbers bit for bit;
- by its **compact index** in breadth-first order: node 0 is the root, then the nodes of
  depth 1 in leader order, then depth 2, ... `node_of[b, k, i]` is the compact index of draft
  k's prefix of length i, and `num_nodes[b]` counts the row's nodes (between L + 1, when all
  drafts coincide, and 1 + K * L). The target verifies one token per compact node.

Verification layout (`verify_layout`): node n of row b sits at cache slot `lengths[b] + n`,
at position `lengths[b] + depth(n)`; the root holds the row's last committed token and a
node of depth i >= 1 the last token of its prefix, so the target's output at node n is q
after node n's prefix. Node n attends the committed prefix and its ancestors (itself
included). Rows are padded to the widest tree; a padding node repeats nothing, attends only
itself and the prefix, and its output is never read.

This module only computes indices and masks from token ids: it runs no model and selects
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD_NODE_TOKEN = 0  # input id of padding nodes (their outputs are never read)


@dataclass
class DraftTree:
    """One iteration's drafts, with the distributions they were sampled from and their tree.

    tokens:      [B, K, L] int64, draft k's token at depth i (i.e. the (i+1)-th draft token);
    draft_probs: [B, K, L, V] float32, the draft-model row of draft k's prefix of length i;
                 only leader rows are read: tokens[b, k, i] ~ draft_probs[b, leader[b, k, i], i];
    leader:      [B, K, L + 1] int64 (see the module docstring);
    node_of:     [B, K, L + 1] int64 compact node index of draft k's prefix of length i;
    num_nodes:   [B] int64 nodes per row (root included);
    nonfinite:   [B] bool, a draft-model row of this row had non-finite logits;
    shared:      [B, L] bool, the row has a node of depth i through which two or more drafts pass
                 (only there can the selection meet several alive drafts at position i).
    """

    tokens: torch.Tensor
    draft_probs: torch.Tensor
    leader: torch.Tensor
    node_of: torch.Tensor
    num_nodes: torch.Tensor
    nonfinite: torch.Tensor
    shared: torch.Tensor


def leaders_of(same_prefix: torch.Tensor) -> torch.Tensor:
    """same_prefix [B, K, K] bool (reflexive) -> [B, K] the smallest draft with the same prefix."""
    return same_prefix.to(torch.int8).argmax(-1)


def extend_same_prefix(same_prefix: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """Prefixes one token longer: same [B, K, K] and the next tokens [B, K] -> [B, K, K]."""
    return same_prefix & (next_tokens[:, :, None] == next_tokens[:, None, :])


def prefix_leaders(tokens: torch.Tensor) -> torch.Tensor:
    """leader [B, K, L + 1] of every prefix length of drafts tokens [B, K, L]."""
    batch, num_drafts, draft_length = tokens.shape
    same = torch.ones(batch, num_drafts, num_drafts, dtype=torch.bool, device=tokens.device)  # [B, K, K]
    leaders = [leaders_of(same)]
    for depth in range(draft_length):
        same = extend_same_prefix(same, tokens[:, :, depth])
        leaders.append(leaders_of(same))
    return torch.stack(leaders, -1)  # [B, K, L + 1]


def nodes_per_depth(leader: torch.Tensor) -> torch.Tensor:
    """Nodes of each depth [B, L + 1] from leaders [B, K, L + 1] (depth 0: the root)."""
    drafts = torch.arange(leader.shape[1], device=leader.device)[None, :, None]  # [1, K, 1]
    return (leader == drafts).sum(1)


def shared_depths(leader: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: depth i (< L) has a node with two or more drafts, i.e. fewer nodes than drafts."""
    return nodes_per_depth(leader)[:, :-1] < leader.shape[1]


def compact_nodes(leader: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Breadth-first node indices from leaders [B, K, L + 1] -> (node_of [B, K, L + 1], num_nodes [B])."""
    num_drafts = leader.shape[1]
    drafts = torch.arange(num_drafts, device=leader.device)[None, :, None]  # [1, K, 1]
    is_leader = leader == drafts  # [B, K, L + 1] one leader per node
    per_depth = is_leader.sum(1)  # [B, L + 1] nodes of each depth (depth 0: the root)
    first_of_depth = per_depth.cumsum(1) - per_depth  # [B, L + 1]
    rank = is_leader.cumsum(1) - 1  # [B, K, L + 1] a leader's rank among its depth's leaders
    leader_node = first_of_depth[:, None, :] + rank  # [B, K, L + 1], valid at leaders
    return leader_node.gather(1, leader), per_depth.sum(1)


def verify_layout(tree: DraftTree, root_tokens: torch.Tensor, width: int):
    """Target input of the tree, padded to `width` >= max(num_nodes) nodes per row.

    root_tokens: [B] the last committed token of each row.
    Returns (input_ids [B, W] int64, depth [B, W] int64, visible [B, W, W] bool: node t may attend node r).
    """
    batch, num_drafts, draft_length = tree.tokens.shape
    device = root_tokens.device
    full = 1 + num_drafts * draft_length  # the widest possible tree
    nodes = tree.node_of[:, :, 1:].reshape(batch, -1)  # [B, K * L] node of each draft token
    input_ids = torch.full((batch, full), PAD_NODE_TOKEN, dtype=torch.int64, device=device)  # [B, T]
    input_ids[:, 0] = root_tokens
    # Drafts through one node carry the same token there, so repeated writes agree.
    input_ids.scatter_(1, nodes, tree.tokens.reshape(batch, -1))
    depths = torch.arange(1, draft_length + 1, device=device).repeat(num_drafts)  # [K * L]
    depth = torch.zeros(batch, full, dtype=torch.int64, device=device).scatter_(
        1, nodes, depths.expand(batch, -1)
    )  # [B, T]
    # Ancestor pairs along every draft: (node of prefix i, node of prefix j) for j <= i.
    row_node = tree.node_of[:, :, :, None]  # [B, K, L + 1, 1]
    col_node = tree.node_of[:, :, None, :]  # [B, K, 1, L + 1]
    lower = torch.ones(draft_length + 1, draft_length + 1, dtype=torch.bool, device=device).tril()
    pairs = torch.where(lower, row_node * full + col_node, row_node * (full + 1))  # [B, K, L + 1, L + 1]
    visible = torch.eye(full, dtype=torch.bool, device=device).repeat(batch, 1, 1)  # [B, T, T]
    visible.view(batch, full * full).scatter_(1, pairs.reshape(batch, -1), True)
    return input_ids[:, :width], depth[:, :width], visible[:, :width, :width]
