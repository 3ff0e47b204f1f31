"""Sequence-level draft selection: walk a draft set position by position (SpecTr).

Given K drafts of L tokens per prompt, the draft distribution each token was sampled from
and the target distribution after each prefix, produce the tokens that one target call
yields for that prompt:

1) start with all K drafts alive;
2) at position i, run the token-level rule (`spectr.selection`) on the i-th tokens of the
   alive drafts. Alive drafts share their prefix, so they are at one node of the draft tree;
   the node's p and q are read at the first alive draft (for drafts from the engine's tree,
   that draft is the node's leader: the row its children were sampled from, see
   `spectr.tree`). The alive count k counts duplicates and rho* is recomputed per node;
3) keep alive only the drafts whose i-th token equals the output (a correction token that
   happens to equal a rejected draft's token keeps that draft alive: the drafts' later
   tokens are still i.i.d. from p given the new prefix);
4) stop at the first position where no draft is alive: its output is the correction token.
   After L positions with drafts alive, add a bonus token drawn from q at position L.

Every row walks all L positions with masks (a row that stopped keeps running the same ops
on no alive drafts, and its results are discarded), so the walk reads no device value on
the host. Each row uses exactly its own [L + 1, K + 1] block of uniforms per call, whatever
it accepts, so a row's randomness never depends on the other rows.

Block verification (`spectr.block`, method "block", K = 1) and traversal verification
(`spectr.traversal`, method "traversal", any K) are sequence-level rules of their own, registered in
`SEQUENCE_RULES`; `select_tree` and `select_sequences` dispatch to them by name.

Randomness is passed in: the caller gives each row's [L + 1, K + 1] uniforms (the engine draws
them from its counter-based streams, `spectr.rng.counter_uniforms`).

Target distributions come either per draft (`[B, K, L + 1, V]`, `select_sequences`) or per
tree node (`[B, M, V]` with a node map `[B, K, L + 1]`, `select_tree`); the walk is the same.

This module does not draft, run models, or touch KV caches; it returns what the engine
needs to commit: the tokens, their count, and a draft consistent with the accepted prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spectr.block import block_rule, block_stop_probabilities
from spectr.outcome import PAD_TOKEN, SequenceSelection
from spectr.rng import sample_categorical
from spectr.selection import TOKEN_SELECTORS, TokenSelector, get_token_selector
from spectr.traversal import select_traversal
from spectr.tree import prefix_leaders, shared_depths
from spectr.validation import check_probabilities, check_shape, check_token_ids, check_uniforms

__all__ = ["PAD_TOKEN", "SEQUENCE_RULES", "SequenceSelection", "row_splits", "select_sequences", "select_tree",
           "sequence_methods", "uniforms_shape"]

# Sequence-level rules that are not a walk of a token-level rule; same signature as the walk
# (draft_tokens, draft_probs, node_target_probs, node_of, uniforms) -> SequenceSelection.
SEQUENCE_RULES = {"block": block_rule(block_stop_probabilities), "traversal": select_traversal}
SINGLE_DRAFT_METHODS = ("speculative", "block")


def sequence_methods() -> list[str]:
    """Every selection method by name: the walked token-level rules and the sequence-level ones."""
    return sorted({*TOKEN_SELECTORS, *SEQUENCE_RULES})


def _check_method(method: str) -> None:
    if method not in SEQUENCE_RULES:
        get_token_selector(method)

def uniforms_shape(num_drafts: int, draft_length: int) -> tuple[int, int]:
    """Per-row uniforms of one call: row i (< L) decides position i, row L the bonus token."""
    return (draft_length + 1, num_drafts + 1)


def select_sequences(
    draft_tokens: torch.Tensor,  # [B, K, L] int64
    draft_probs: torch.Tensor,  # [B, K, L, V]
    target_probs: torch.Tensor,  # [B, K, L + 1, V]
    uniforms: torch.Tensor,  # [B, L + 1, K + 1] float64: row i decides position i, row L the bonus
    *,
    method: str = "spectr",
    validate: bool = True,
) -> SequenceSelection:
    """Sequence-level selection for a batch of draft sets with the given uniforms; see the module docstring."""
    if validate:
        _check_method(method)
        _check_sequence_inputs(draft_tokens, draft_probs, target_probs, method)
        batch_size, num_drafts, draft_length = draft_tokens.shape
        check_shape(
            "uniforms", uniforms, (batch_size, *uniforms_shape(num_drafts, draft_length)), "[B, L + 1, K + 1]"
        )
        check_uniforms("uniforms", uniforms)
    batch_size, num_drafts, draft_length = draft_tokens.shape
    splits = None
    if num_drafts > 1 and method not in SEQUENCE_RULES:
        shared = shared_depths(prefix_leaders(draft_tokens))  # [B, L]
        splits = row_splits(shared, shared.sum(0).tolist())  # this API reads the split sizes on the host
    # Each draft's own rows as "nodes": draft k's prefix of length i is node k * (L + 1) + i.
    per_draft = torch.arange(num_drafts * (draft_length + 1), device=draft_tokens.device)
    node_of = per_draft.view(1, num_drafts, draft_length + 1).expand(batch_size, -1, -1)  # [B, K, L + 1]
    node_probs = target_probs.reshape(batch_size, num_drafts * (draft_length + 1), -1)  # [B, K * (L + 1), V]
    return select_tree(draft_tokens, draft_probs, node_probs, node_of, uniforms, method=method, row_splits=splits)


RowSplit = tuple[torch.Tensor, torch.Tensor]  # (rows that may have several alive drafts [R], the others [B - R])


def row_splits(shared: torch.Tensor, counts: Sequence[int]) -> list[RowSplit | None]:
    """Per draft position, the rows with a node of two or more drafts at that depth and the others.

    shared: [B, L] bool (`spectr.tree.shared_depths`); counts[i] = shared[:, i].sum(), read on the
    host. Position 0 is None (every row's drafts are all alive at the root).
    """
    splits: list[RowSplit | None] = [None]
    for position in range(1, shared.shape[1]):
        order = torch.argsort((~shared[:, position]).to(torch.int8), stable=True)  # sharing rows first
        splits.append((order[: counts[position]], order[counts[position] :]))
    return splits


def select_tree(
    draft_tokens: torch.Tensor,  # [B, K, L] int64, drafts in sampling order
    draft_probs: torch.Tensor,  # [B, K, L, V]: p of draft k's prefix of length i is draft_probs[:, k, i]
    node_target_probs: torch.Tensor,  # [B, M, V] q per tree node
    node_of: torch.Tensor,  # [B, K, L + 1] int64: node of draft k's prefix of length i (< M)
    uniforms: torch.Tensor,  # [B, L + 1, K + 1] float64
    *,
    method: str = "spectr",
    row_splits: Sequence[RowSplit | None] | None = None,
    selector: TokenSelector | None = None,
) -> SequenceSelection:
    """One call's selection on a tree (unchecked: the engine's hot path): a sequence-level rule
    (`SEQUENCE_RULES`, e.g. block verification) or the masked walk of a token-level rule.

    row_splits[i] (optional, per position): rows that may reach position i with several alive
    drafts, and the rows that cannot (no node of depth i with two drafts, see
    `spectr.tree.shared_depths`). The latter are selected as one-draft nodes (their alive draft's
    column, and the correction column), which gives the same tokens for less work.
    selector (optional): the token rule to call instead of `method`'s own (the compiled engine passes
    the same rule under torch.compile, `spectr.native.compiled_select_tree`).
    """
    if method in SEQUENCE_RULES:
        return SEQUENCE_RULES[method](draft_tokens, draft_probs, node_target_probs, node_of, uniforms)
    selector = selector or get_token_selector(method)
    batch_size, num_drafts, draft_length = draft_tokens.shape
    device = draft_tokens.device
    rows = torch.arange(batch_size, device=device)  # [B]
    tokens = torch.full((batch_size, draft_length + 1), PAD_TOKEN, dtype=torch.int64, device=device)  # [B, L + 1]
    alive = torch.ones(batch_size, num_drafts, dtype=torch.bool, device=device)  # [B, K]
    walking = torch.ones(batch_size, dtype=torch.bool, device=device)  # [B] reached this position
    draft_index = torch.zeros(batch_size, dtype=torch.int64, device=device)  # [B]
    accepted_at = []
    for position in range(draft_length):
        # Invariant: a walking row's alive drafts all carry the accepted prefix (one tree node);
        # a row that stopped has no alive draft and its outputs below are masked out.
        first_alive = alive.to(torch.int8).argmax(1)  # [B]
        node = (draft_probs[:, :, position], node_target_probs, node_of[:, :, position])
        split = row_splits[position] if row_splits is not None else None
        select, which = (_select_rows, rows) if split is None else (_select_split, split)
        token = select(selector, which, first_alive, node, draft_tokens[:, :, position], alive, uniforms[:, position])
        tokens[:, position] = torch.where(walking, token, PAD_TOKEN)
        still_alive = alive & (draft_tokens[:, :, position] == token.unsqueeze(1))  # [B, K]
        continues = still_alive.any(1)  # [B]
        # A draft consistent with the prefix so far: the first one still alive.
        stopped_here = walking & ~continues  # [B]
        draft_index = torch.where(continues, still_alive.to(torch.int8).argmax(1),
                                  torch.where(stopped_here, first_alive, draft_index))
        accepted_at.append(continues)
        alive, walking = still_alive, continues
    # Rows still walking accepted all L positions: the bonus token comes from q after the full draft.
    bonus_q = node_target_probs[rows, node_of[rows, draft_index, draft_length]]  # [B, V]
    bonus = sample_categorical(bonus_q, uniforms[:, draft_length, num_drafts])  # [B]
    tokens[:, draft_length] = torch.where(walking, bonus, PAD_TOKEN)
    accepted = torch.stack(accepted_at, 1) if accepted_at else alive.new_zeros(batch_size, 0)  # [B, L]
    num_accepted = accepted.sum(1)  # [B]
    return SequenceSelection(tokens=tokens, num_tokens=num_accepted + 1, num_accepted=num_accepted,
                             draft_index=draft_index, accepted_per_position=accepted.sum(0))


def _node_distributions(rows, first_alive, node) -> tuple[torch.Tensor, torch.Tensor]:
    """p and q [R, V] of the node each row of `rows` [R] is at, read at its first alive draft."""
    position_probs, node_target_probs, position_nodes = node  # [B, K, V], [B, M, V], [B, K]
    lead = first_alive[rows]  # [R]
    return position_probs[rows, lead], node_target_probs[rows, position_nodes[rows, lead]]


def _select_rows(selector, rows, first_alive, node, drafts, alive, uniforms) -> torch.Tensor:
    """The token rule on the nodes of `rows` [R] -> tokens [R]."""
    node_p, node_q = _node_distributions(rows, first_alive, node)  # [R, V] each
    token, _ = selector(drafts[rows], alive[rows], node_p, node_q, uniforms[rows])
    return token


def _select_split(selector, split: RowSplit, first_alive, node, drafts, alive, uniforms) -> torch.Tensor:
    """`_select_rows` on the rows that may have several alive drafts; the others (at most one alive
    draft) as one-draft nodes: that draft's token and test column, then the correction column."""
    several, single = split  # [R], [B - R]
    token = torch.empty_like(first_alive)  # [B]
    if several.numel():
        token[several] = _select_rows(selector, several, first_alive, node, drafts, alive, uniforms)
    if single.numel():
        column = first_alive[single, None]  # [B - R, 1] the alive draft (if any)
        node_p, node_q = _node_distributions(single, first_alive, node)  # [B - R, V] each
        one_uniforms = torch.cat([uniforms[single].gather(1, column), uniforms[single, drafts.shape[1]:]], 1)
        token[single], _ = selector(drafts[single].gather(1, column), alive[single].gather(1, column), node_p,
                                    node_q, one_uniforms)  # [B - R], uniforms [B - R, 2]
    return token


def _check_sequence_inputs(draft_tokens, draft_probs, target_probs, method) -> None:
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dim() != 3:
        raise ValueError(
            f"draft_tokens must be a [B, K, L] tensor, got {getattr(draft_tokens, 'shape', type(draft_tokens))}"
        )
    batch_size, num_drafts, draft_length = draft_tokens.shape
    if num_drafts < 1:
        raise ValueError(f"draft_tokens must hold K >= 1 drafts per row, got K = {num_drafts}")
    if draft_length < 1:
        raise ValueError(f"draft_tokens must hold drafts of length L >= 1, got L = {draft_length}")
    if method in SINGLE_DRAFT_METHODS and num_drafts != 1:
        raise ValueError(f"method {method!r} needs K = 1 draft per row, got K = {num_drafts}")
    if not isinstance(draft_probs, torch.Tensor) or draft_probs.dim() != 4:
        raise ValueError(
            f"draft_probs must be a [B, K, L, V] tensor, got {getattr(draft_probs, 'shape', type(draft_probs))}"
        )
    vocab_size = draft_probs.shape[-1]
    check_shape(
        "draft_probs", draft_probs, (batch_size, num_drafts, draft_length, vocab_size), "[B, K, L, V]"
    )
    check_shape(
        "target_probs",
        target_probs,
        (batch_size, num_drafts, draft_length + 1, vocab_size),
        "[B, K, L + 1, V]",
    )
    check_token_ids("draft_tokens", draft_tokens, vocab_size)
    check_probabilities("draft_probs", draft_probs)
    check_probabilities("target_probs", target_probs)
