"""Slow reference implementation of draft selection, the oracle of the tests.

Everything here is plain Python on lists of floats, one row and one draft at a time, so it
can be read against the algorithm text in docs/architecture.md line by line. It consumes uniforms
exactly like the batched code (`spectr.selection`, `spectr.sequence`): at a node, uniform j
decides the test of draft j and uniform K the correction token; a sequence uses row i of its
[L + 1, K + 1] block at position i and row L for the bonus token. Under the same uniforms
the batched code must return the same tensors.

Block verification (`spectr.block`, K = 1) has its sampler `reference_block_sequence` (same
uniforms as the batched rule: eta_i is uniforms[i - 1][0], the last token uses uniforms[L][1])
and its exact law `block_output_distribution`; `block_weights_and_stops` gives w_i and h_i.
Traversal verification (`spectr.traversal`, K >= 1) has `reference_traversal_sequence` (node
(leader k, depth d) tested with uniforms[d - 1][k], the last token uniforms[L][K]) and its exact law
`traversal_output_distribution`, both on one mutable tree per row (`_TraversalTree`); `child_order="token"`
visits children by token id, the tests' negative control.

Two kinds of functions:

- samplers (`reference_select_token`, `reference_select_sequence`,
  `reference_select_sequences`) that turn given uniforms into tokens;
- exact distributions (`token_output_distribution`, `sequence_output_distribution`) that
  integrate over the uniforms analytically, by walking the algorithm's branches with their
  probabilities. Summed over draft sets, they prove exactness without sampling.

This module is not fast and not used by the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from spectr.sequence import PAD_TOKEN, SequenceSelection

# Same bisection budget as the batched code, so both stop at the same float64 end point.
_BISECTION_STEPS = 64

Probs = Sequence[float]


def reference_beta(p: Probs, q: Probs, rho: float) -> float:
    return sum(min(px, qx / rho) for px, qx in zip(p, q))


def reference_rho(p: Probs, q: Probs, num_drafts: int) -> float:
    """rho* of K-SEQ by bisection on [1, k], keeping the upper end (where f <= 0)."""
    if num_drafts <= 1:
        return 1.0
    lo, hi = 1.0, float(num_drafts)
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        beta = reference_beta(p, q, mid)
        gap = 1.0 - max(0.0, 1.0 - beta) ** num_drafts - mid * beta
        if gap > 0:
            lo = mid
        else:
            hi = mid
        if 0.5 * (lo + hi) in (lo, hi):
            break  # the ends are adjacent floats
    return hi


def _acceptance_probability(target_mass: float, draft_mass: float) -> float:
    """min(1, target_mass / draft_mass); a draft with draft_mass = 0 passes iff target_mass > 0."""
    if draft_mass <= 0:
        return 1.0 if target_mass > 0 else 0.0
    return min(1.0, target_mass / draft_mass)


def _kseq_residual(p: Probs, q: Probs, scale: float) -> list[float]:
    """max(0, q - scale * p), unnormalised; q itself when that is all zero."""
    residual = [max(0.0, qx - scale * px) for px, qx in zip(p, q)]
    return residual if sum(residual) > 0 else list(q)


def _specinfer_update(residual: Probs, p: Probs) -> list[float]:
    """norm(max(0, r - p)); r unchanged when that is all zero (a rejection of probability 0)."""
    leftover = [max(0.0, rx - px) for rx, px in zip(residual, p)]
    mass = sum(leftover)
    return [x / mass for x in leftover] if mass > 0 else list(residual)


def reference_sample(weights: Probs, u: float) -> int:
    """Inverse CDF: the first token whose cumulative weight exceeds u * total (never a zero one)."""
    total = sum(weights)
    threshold = u * total
    cumulative = 0.0
    last_positive = max(i for i, w in enumerate(weights) if w > 0)
    for token, weight in enumerate(weights):
        cumulative += weight
        if cumulative > threshold and weight > 0:
            return token
    return last_positive


def reference_select_token(
    method: str, drafts: Sequence[int], alive: Sequence[bool], p: Probs, q: Probs, uniforms: Sequence[float]
) -> tuple[int, bool]:
    """One node: (output token, whether it is an accepted draft token)."""
    num_drafts = len(drafts)
    if method in ("spectr", "speculative"):
        if method == "speculative" and num_drafts != 1:
            raise ValueError("speculative needs K = 1")
        alive_count = sum(bool(a) for a in alive)
        rho = 1.0 if method == "speculative" else reference_rho(p, q, alive_count)
        for j in range(num_drafts):
            if not alive[j]:
                continue
            x = drafts[j]
            if uniforms[j] * rho * p[x] < q[x]:
                return x, True
        scale = rho if alive_count > 0 else 0.0
        return reference_sample(_kseq_residual(p, q, scale), uniforms[num_drafts]), False
    if method == "specinfer":
        residual = list(q)
        for j in range(num_drafts):
            if not alive[j]:
                continue
            x = drafts[j]
            if uniforms[j] * p[x] < residual[x]:
                return x, True
            residual = _specinfer_update(residual, p)
        return reference_sample(residual, uniforms[num_drafts]), False
    raise ValueError(f"unknown method {method!r}")


def reference_select_sequence(
    method: str,
    draft_tokens: Sequence[Sequence[int]],  # [K][L]
    draft_probs: Sequence[Sequence[Probs]],  # [K][L][V]
    target_probs: Sequence[Sequence[Probs]],  # [K][L + 1][V]
    uniforms: Sequence[Sequence[float]],  # [L + 1][K + 1]
) -> tuple[list[int], int, list[bool]]:
    """One prompt: (produced tokens, a draft index consistent with the accepted prefix,
    accepted flag per position walked)."""
    num_drafts, draft_length = len(draft_tokens), len(draft_tokens[0])
    alive = [True] * num_drafts
    produced: list[int] = []
    draft_index = 0
    for position in range(draft_length):
        first_alive = alive.index(True)
        node_drafts = [draft_tokens[j][position] for j in range(num_drafts)]
        token, _ = reference_select_token(
            method,
            node_drafts,
            alive,
            draft_probs[first_alive][position],
            target_probs[first_alive][position],
            uniforms[position],
        )
        produced.append(token)
        alive = [alive[j] and node_drafts[j] == token for j in range(num_drafts)]
        if not any(alive):
            return produced, first_alive, [True] * position + [False]
        draft_index = alive.index(True)
    bonus = reference_sample(target_probs[draft_index][draft_length], uniforms[draft_length][num_drafts])
    produced.append(bonus)
    return produced, draft_index, [True] * draft_length


def reference_select_sequences(
    draft_tokens: torch.Tensor,  # [B, K, L]
    draft_probs: torch.Tensor,  # [B, K, L, V]
    target_probs: torch.Tensor,  # [B, K, L + 1, V]
    uniforms: torch.Tensor,  # [B, L + 1, K + 1] float64
    *,
    method: str = "spectr",
) -> SequenceSelection:
    """Row by row version of `spectr.sequence.select_sequences`, on the same uniforms."""
    batch_size, num_drafts, draft_length = draft_tokens.shape
    tokens = torch.full((batch_size, draft_length + 1), PAD_TOKEN, dtype=torch.int64)
    num_tokens = torch.zeros(batch_size, dtype=torch.int64)
    draft_index = torch.zeros(batch_size, dtype=torch.int64)
    accepted_per_position = torch.zeros(draft_length, dtype=torch.int64)
    for row in range(batch_size):
        produced, index, accepted = reference_select_sequence(
            method,
            draft_tokens[row].tolist(),
            draft_probs[row].to(torch.float64).tolist(),
            target_probs[row].to(torch.float64).tolist(),
            uniforms[row].tolist(),
        )
        tokens[row, : len(produced)] = torch.tensor(produced)
        num_tokens[row] = len(produced)
        draft_index[row] = index
        for position, ok in enumerate(accepted):
            accepted_per_position[position] += int(ok)
    return SequenceSelection(
        tokens=tokens,
        num_tokens=num_tokens,
        num_accepted=num_tokens - 1,
        draft_index=draft_index,
        accepted_per_position=accepted_per_position,
    )


# ---------------------------------------------------------------------------------------
# Exact output distributions (no sampling)
# ---------------------------------------------------------------------------------------

TokenDistribution = Callable[[Sequence[int], Sequence[bool], Probs, Probs], tuple[list[float], float]]


def token_output_distribution(
    method: str, drafts: Sequence[int], alive: Sequence[bool], p: Probs, q: Probs
) -> tuple[list[float], float]:
    """Law of the output token given these drafts, and the probability that a draft is accepted.

    Walks the drafts in order: draft j is reached with the probability that all earlier alive
    drafts were rejected, and passes with its acceptance probability; the rest goes to the
    correction distribution.
    """
    vocab_size = len(p)
    law = [0.0] * vocab_size
    reach = 1.0
    if method in ("spectr", "speculative"):
        alive_count = sum(bool(a) for a in alive)
        rho = 1.0 if method == "speculative" else reference_rho(p, q, alive_count)
        for x, is_alive in zip(drafts, alive):
            if is_alive:
                passes = _acceptance_probability(q[x], rho * p[x])
                law[x] += reach * passes
                reach *= 1.0 - passes
        correction = _kseq_residual(p, q, rho if alive_count > 0 else 0.0)
    elif method == "specinfer":
        correction = list(q)
        for x, is_alive in zip(drafts, alive):
            if is_alive:
                passes = _acceptance_probability(correction[x], p[x])
                law[x] += reach * passes
                reach *= 1.0 - passes
                correction = _specinfer_update(correction, p)
    else:
        raise ValueError(f"unknown method {method!r}")
    total = sum(correction)
    for token in range(vocab_size):
        law[token] += reach * correction[token] / total
    return law, 1.0 - reach


def sequence_output_distribution(
    method: str | TokenDistribution,
    draft_tokens: Sequence[Sequence[int]],  # [K][L]
    draft_probs: Sequence[Sequence[Probs]],  # [K][L][V]
    target_probs: Sequence[Sequence[Probs]],  # [K][L + 1][V]
) -> dict[tuple[int, ...], float]:
    """Law of the tokens one call produces for this draft set: {produced tokens: probability}.

    `method` is a method name, or a function with the signature of
    `token_output_distribution` minus the method (used by tests for broken rules).
    """
    if isinstance(method, str):
        name = method

        def token_law(drafts, alive, p, q):
            return token_output_distribution(name, drafts, alive, p, q)

    else:
        token_law = method
    num_drafts, draft_length = len(draft_tokens), len(draft_tokens[0])
    outcomes: dict[tuple[int, ...], float] = {}

    def walk(position: int, alive: list[bool], produced: tuple[int, ...], probability: float) -> None:
        first_alive = alive.index(True)
        if position == draft_length:
            for token, mass in enumerate(target_probs[first_alive][draft_length]):
                if mass > 0:
                    key = (*produced, token)
                    outcomes[key] = outcomes.get(key, 0.0) + probability * mass
            return
        node_drafts = [draft_tokens[j][position] for j in range(num_drafts)]
        law, _ = token_law(
            node_drafts, alive, draft_probs[first_alive][position], target_probs[first_alive][position]
        )
        for token, mass in enumerate(law):
            if mass <= 0:
                continue
            still_alive = [alive[j] and node_drafts[j] == token for j in range(num_drafts)]
            if any(still_alive):
                walk(position + 1, still_alive, (*produced, token), probability * mass)
            else:
                key = (*produced, token)
                outcomes[key] = outcomes.get(key, 0.0) + probability * mass

    walk(0, [True] * num_drafts, (), 1.0)
    return outcomes


# ---------------------------------------------------------------------------------------
# Block verification (K = 1)
# ---------------------------------------------------------------------------------------

StopRule = Callable[[Sequence[float], Sequence[float]], list[float]]


def block_stops(weights: Sequence[float], excess: Sequence[float]) -> list[float]:
    """h_i = S_i / (S_i + 1 - w_i) for i < L (1 where the denominator is 0), h_L = w_L."""
    stops = []
    for w, s in zip(weights[:-1], excess):
        denominator = s + 1.0 - w
        stops.append(s / denominator if denominator > 0 else 1.0)
    return stops + [weights[-1]]


def block_weights_and_stops(
    draft: Sequence[int], p: Sequence[Probs], q: Sequence[Probs], stop_rule: StopRule = block_stops
) -> tuple[list[float], list[float]]:
    """w_0..w_L (w_0 = 1) and h_1..h_L of one draft; p [L][V] = p_1..p_L, q [L + 1][V] = q_1..q_{L+1}."""
    weights = [1.0]
    for i, x in enumerate(draft):
        ratio = q[i][x] / p[i][x] if p[i][x] > 0 else float("inf")
        weights.append(min(1.0, weights[-1] * ratio) if weights[-1] > 0 else 0.0)
    length = len(draft)
    excess = [sum(max(weights[i] * qx - px, 0.0) for px, qx in zip(p[i], q[i])) for i in range(1, length)]
    return weights, stop_rule(weights[1:], excess)


def _block_last_weights(weights, p, q, tau: int, length: int) -> list[float]:
    """What the token after X_<=tau is drawn from: q_{L+1} at tau = L, else the block residual (q if empty)."""
    if tau == length:
        return list(q[length])
    residual = [max(weights[tau] * qx - px, 0.0) for px, qx in zip(p[tau], q[tau])]
    return residual if sum(residual) > 0 else list(q[tau])


def reference_block_sequence(
    draft: Sequence[int], p: Sequence[Probs], q: Sequence[Probs], uniforms: Sequence[Sequence[float]],
    stop_rule: StopRule = block_stops,
) -> tuple[list[int], int]:
    """One row of block verification: (produced tokens, tau). uniforms: [L + 1][2]."""
    length = len(draft)
    weights, stops = block_weights_and_stops(draft, p, q, stop_rule)
    tau = 0
    for i in range(1, length + 1):
        if uniforms[i - 1][0] <= stops[i - 1]:
            tau = i
    last = reference_sample(_block_last_weights(weights, p, q, tau, length), uniforms[length][1])
    return list(draft[:tau]) + [last], tau


def block_output_distribution(
    draft: Sequence[int], p: Sequence[Probs], q: Sequence[Probs], stop_rule: StopRule = block_stops
) -> dict[tuple[int, ...], float]:
    """Exact law of the tokens one call produces for this draft: P(tau = t) = h_t * prod_{i > t} (1 - h_i)."""
    length = len(draft)
    weights, stops = block_weights_and_stops(draft, p, q, stop_rule)
    outcomes: dict[tuple[int, ...], float] = {}
    for tau in range(length + 1):
        chance = stops[tau - 1] if tau > 0 else 1.0
        for h in stops[tau:]:
            chance *= 1.0 - h
        if chance <= 0:
            continue
        last = _block_last_weights(weights, p, q, tau, length)
        total = sum(last)
        for token, mass in enumerate(last):
            if mass > 0:
                key = (*draft[:tau], token)
                outcomes[key] = outcomes.get(key, 0.0) + chance * mass / total
    return outcomes


# ---------------------------------------------------------------------------------------
# Traversal verification (K >= 1 drafts as one prefix tree)
# ---------------------------------------------------------------------------------------

CHILD_ORDERS = ("draft", "token")


class _TraversalTree:
    """One row's prefix tree for traversal verification, with its mutable state (p draft, q target).

    A node is a prefix; its leader is the smallest draft index through it, its children the distinct
    next tokens of its drafts, visited in the order the drafts first reached them ("draft": by leader) or,
    for the tests' negative control only, by token id ("token"). Node state: w, q (target; becomes a
    residual), p (draft; loses the tokens of deleted children).
    """

    def __init__(self, draft_tokens, draft_probs, target_probs, child_order: str = "draft"):
        if child_order not in CHILD_ORDERS:
            raise ValueError(f"child_order must be one of {CHILD_ORDERS}, got {child_order!r}")
        self.length = len(draft_tokens[0])
        self.leader: dict[tuple[int, ...], int] = {}
        self.children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        self.q: dict[tuple[int, ...], list[float]] = {}
        self.p: dict[tuple[int, ...], list[float]] = {}
        for k, draft in enumerate(draft_tokens):
            for depth in range(self.length + 1):
                node = tuple(draft[:depth])
                if node in self.leader:
                    continue
                self.leader[node] = k
                self.children[node] = []
                self.q[node] = list(target_probs[k][depth])
                if depth < self.length:
                    self.p[node] = list(draft_probs[k][depth])
                if depth > 0:
                    self.children[node[:-1]].append(node)
        if child_order == "token":
            for kids in self.children.values():
                kids.sort(key=lambda node: node[-1])
        self.w: dict[tuple[int, ...], float] = {(): 1.0}
        self._weigh_below(())

    def _weigh_below(self, node) -> None:
        """w(c) = min(1, w(parent) * q_parent(c) / p_parent(c)) top-down under `node` (p = 0: ratio inf)."""
        for child in self.children[node]:
            x, w = child[-1], self.w[node]
            p, q = self.p[node][x], self.q[node][x]
            if w <= 0:
                self.w[child] = 0.0
            else:
                self.w[child] = min(1.0, w * q / p) if p > 0 else 1.0
            self._weigh_below(child)

    def first_leaf(self) -> tuple[int, ...]:
        node: tuple[int, ...] = ()
        while self.children[node]:
            node = self.children[node][0]
        return node

    def delete(self, leaf) -> None:
        """Reject `leaf`: its parent b gets w = S / (S + 1 - w), q = norm((w q - p)+), p without the leaf's token
        (p(x) / (1 - p(token)): the law of the next distinct child)."""
        parent = leaf[:-1]
        self.children[parent].remove(leaf)
        w, q, p = self.w[parent], self.q[parent], self.p[parent]
        residual = [max(w * qx - px, 0.0) for qx, px in zip(q, p)]
        mass = sum(residual)
        if mass > 0:
            self.w[parent] = mass / (mass + (1.0 - w))
            self.q[parent] = [r / mass for r in residual]
        else:
            self.w[parent] = 0.0
        kept = 1.0 - p[leaf[-1]]  # p conditioned on another child than the leaf's token
        self.p[parent] = [0.0 if x == leaf[-1] or kept <= 0 else px / kept for x, px in enumerate(p)]
        self._weigh_below(parent)

    def uniform_slot(self, node) -> tuple[int, int]:
        """The test of node (leader k, depth d) reads uniforms[d - 1][k]."""
        return len(node) - 1, self.leader[node]


def reference_traversal_sequence(
    draft_tokens: Sequence[Sequence[int]],  # [K][L]
    draft_probs: Sequence[Sequence[Probs]],  # [K][L][V]
    target_probs: Sequence[Sequence[Probs]],  # [K][L + 1][V]
    uniforms: Sequence[Sequence[float]],  # [L + 1][K + 1]
    child_order: str = "draft",
) -> tuple[list[int], int]:
    """One row of traversal verification: (produced tokens, the accepted node's leader draft).

    Repeatedly take the first leaf a in post-order: the root ends it (its token from the root's q, a
    residual by then); else a is accepted iff uniforms[depth(a) - 1][leader(a)] < w(a), ending with a
    token from a's q (the target's own at depth L, a residual above); else a is deleted (`delete`).
    """
    tree = _TraversalTree(draft_tokens, draft_probs, target_probs, child_order)
    num_drafts = len(draft_tokens)
    while True:
        node = tree.first_leaf()
        if node:
            depth, k = tree.uniform_slot(node)
            if not uniforms[depth][k] < tree.w[node]:
                tree.delete(node)
                continue
        token = reference_sample(tree.q[node], uniforms[len(draft_tokens[0])][num_drafts])
        return [*node, token], tree.leader[node]


def traversal_output_distribution(
    draft_tokens: Sequence[Sequence[int]],  # [K][L]
    draft_probs: Sequence[Sequence[Probs]],  # [K][L][V]
    target_probs: Sequence[Sequence[Probs]],  # [K][L + 1][V]
    child_order: str = "draft",
) -> dict[tuple[int, ...], float]:
    """Exact law of the tokens one call of traversal verification produces for this draft set.

    The order of the tests does not depend on their outcomes (post-order of the tree; an acceptance
    ends the call), so the law is one pass: test t is reached with prob(all earlier tests rejected).
    """
    tree = _TraversalTree(draft_tokens, draft_probs, target_probs, child_order)
    outcomes: dict[tuple[int, ...], float] = {}
    reach = 1.0
    while reach > 0:
        node = tree.first_leaf()
        accept = tree.w[node] if node else 1.0
        if accept > 0:
            total = sum(tree.q[node])
            for token, mass in enumerate(tree.q[node]):
                if mass > 0:
                    key = (*node, token)
                    outcomes[key] = outcomes.get(key, 0.0) + reach * accept * mass / total
        if not node:
            break
        reach *= 1.0 - accept
        tree.delete(node)
    return outcomes
