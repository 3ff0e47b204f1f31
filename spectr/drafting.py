"""The proposer: K drafts x L tokens per row from the draft model, drafted as a prefix tree.

`TreeDrafter.propose` returns a `spectr.tree.DraftTree`: the draft tokens *together with*
the draft-model rows they were sampled from, and the tree's node maps. It runs one draft
forward per draft position:

- step 0 feeds the row's pending tokens (1, or 2 after an all-accepted iteration: the last
  draft token never entered the draft cache, and the bonus token) and samples the K first
  tokens i.i.d. from the one root distribution p(. | context);
- step i >= 1 feeds the K drafts' tokens of depth i-1 in one forward; draft k attends the
  committed prefix plus its own earlier tokens, so the K drafts share the prefix in the draft
  cache instead of copying it K times.

Prefix tree: drafts whose first i tokens agree are one node, and all children of that node
are sampled from ONE row, its leader's (the smallest draft index through the node). The
other drafts through the node compute duplicate rows, which are never read: a fixed width of
K rows per depth keeps the step free of host syncs, and reading only the leader's row makes
the sampled tokens and the selection use the same p bit for bit, whatever the dtype.
Children stay i.i.d. given the node: each draft has its own uniform. With penalties or min_tokens
(`spectr.penalties`) a draft's row at depth i is penalised with the row's committed tokens plus the
draft's own first i tokens: the node's path, which the verify counts at that node too.

Draft-cache layout during an iteration (see spectr.kv_cache for the invariant): with
`base = lengths + num_pending`, draft k's token of depth i (i < L-1) sits at slot
`base + i*K + k`; its depth-L-1 token is never fed. `commit` gathers the accepted path to
`base + i` and advances the committed prefix, for the rows still running only.

K and L are each call's (the shape of its uniforms), not the drafter's: consecutive iterations
may draft different trees over the same cache and pending tokens. `catch_up` feeds the cache, in
one forward, the tokens committed while the drafter sat idle (autoregressive iterations), so that
the next `propose` starts from the row's whole committed prefix.

Rows of the pool: `reset` starts newly admitted rows (their last prompt token pending),
`prefix` / `put_prefix` make a drafter of the rows [0, R) (over that prefix of the cache) and
write its pending tokens back.

Randomness: the caller passes the uniforms ([B, L, K] per iteration: slot i*K + k of the
row's counter-based stream, see spectr.rng). This module does not verify or select drafts.
"""

from __future__ import annotations

import torch

from spectr.kv_cache import tree_attention
from spectr.penalties import draft_paths, root_paths
from spectr.rng import sample_categorical_many
from spectr.tree import DraftTree, compact_nodes, extend_same_prefix, leaders_of, shared_depths
from spectr.warps import SamplingWarp


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[B, T, V] -> [B, T] bool: NaN or +inf anywhere, or every logit -inf (no distribution)."""
    return ~torch.isfinite(logits.amax(-1))


class TreeDrafter:
    """Owns the draft model's per-row cache and pending tokens for the rows of the batch."""

    def __init__(self, model, cache, warp: SamplingWarp, pending_tokens: torch.Tensor):
        """pending_tokens: [B] the last prompt token of each row (the cache holds the rest).

        K and L are the iteration's (the shapes of `propose`'s uniforms), so that consecutive
        iterations may draft different trees over the same cache and pending tokens."""
        self.model = model
        self.cache = cache
        self.warp = warp
        batch = pending_tokens.shape[0]
        device = pending_tokens.device
        self.pending = torch.zeros(batch, 2, dtype=torch.int64, device=device)  # [B, 2]
        self.pending[:, 0] = pending_tokens
        self.num_pending = torch.ones(batch, dtype=torch.int64, device=device)  # [B]
        self._branch_visibility: dict[tuple[int, int], torch.Tensor] = {}  # (K, depth) -> [K, depth*K]

    def _visibility(self, num_drafts: int, depth: int) -> torch.Tensor:
        """[K, depth*K] bool: draft k's query at depth `depth` sees its own tokens of depth < depth."""
        key = (num_drafts, depth)
        if key not in self._branch_visibility:
            columns = torch.arange(depth * num_drafts, device=self.pending.device)
            drafts = torch.arange(num_drafts, device=self.pending.device)
            self._branch_visibility[key] = (columns[None, :] % num_drafts) == drafts[:, None]
        return self._branch_visibility[key]

    def row_tensors(self) -> list[torch.Tensor]:
        """The per-row state [B, ...] that moves with a row (`RowState.move`)."""
        return [self.pending, self.num_pending]

    def host_extent(self) -> torch.Tensor:
        """[2] int64 on the device: max(lengths + num_pending) and max(num_pending), for the host copy."""
        return torch.stack([(self.cache.rows.lengths + self.num_pending).max(), self.num_pending.max()])

    def propose(self, uniforms: torch.Tensor, extent: tuple[int, int], running: torch.Tensor) -> DraftTree:
        """Draw K drafts of L tokens per row. uniforms: [B, L, K] float64 in [0, 1).

        extent: host copy of `host_extent()` (max base, max pending count); running: [B] bool,
        rows still generating (the others draft token 0 everywhere: a one-path tree).
        """
        batch, draft_length, num_drafts = uniforms.shape
        max_base, max_pending = extent
        lengths = self.cache.rows.lengths  # [B]
        device = lengths.device
        tokens = torch.empty(batch, num_drafts, draft_length, dtype=torch.int64, device=device)
        probs = torch.empty(batch, num_drafts, draft_length, self.model.vocab_size, dtype=torch.float32,
                            device=device)  # [B, K, L, V]

        # step 0: the pending tokens (padded to the widest row), one root distribution per row
        offsets = torch.arange(max_pending, device=device)
        slots = lengths[:, None] + offsets  # [B, W]
        causal = offsets[:, None] >= offsets[None, :]  # [W, W]
        allowed = tree_attention(lengths, causal, max_base - 1 + max_pending)
        logits = self.model.forward(self.pending[:, :max_pending], slots, allowed, self.cache, slots)  # [B, W, V]
        last = (self.num_pending - 1)[:, None, None].expand(batch, 1, logits.shape[-1])
        root_logits = logits.gather(1, last)  # [B, 1, V]
        nonfinite = nonfinite_rows(root_logits)[:, 0]  # [B]
        penalised = self.warp.path_dependent  # penalties / min_tokens: each row's law counts its own path
        probs[:, 0, 0] = self.warp.probs(root_logits[:, 0], root_paths(batch, device) if penalised else None)
        tokens[:, :, 0] = sample_categorical_many(probs[:, 0, 0], uniforms[:, 0])  # [B, K] i.i.d. children
        same = extend_same_prefix(
            torch.ones(batch, num_drafts, num_drafts, dtype=torch.bool, device=device), tokens[:, :, 0]
        )  # [B, K, K] drafts with the same prefix of length 1
        leaders = [torch.zeros(batch, num_drafts, dtype=torch.int64, device=device), leaders_of(same)]

        # steps 1..L-1: the K drafts advance together, each attending its own path
        base = lengths + self.num_pending  # [B] slot of the first draft token
        branch = torch.arange(num_drafts, device=device)
        for depth in range(1, draft_length):
            slots = base[:, None] + (depth - 1) * num_drafts + branch  # [B, K]
            positions = (base + depth - 1)[:, None].expand(batch, num_drafts)  # [B, K]
            allowed = tree_attention(base, self._visibility(num_drafts, depth), max_base + depth * num_drafts)
            logits = self.model.forward(tokens[:, :, depth - 1], positions, allowed, self.cache, slots)  # [B, K, V]
            nonfinite |= nonfinite_rows(logits).any(1)
            same = self._draw(logits, depth, tokens, probs, uniforms, leaders, same)
        return self._tree(tokens, probs, leaders, nonfinite, running)

    def _draw(self, logits, depth: int, tokens, probs, uniforms, leaders: list, same):
        """Depth `depth` of the tree from the K rows' logits [B, K, V]: each row's law (penalties: on its own path)
        into probs[:, :, depth], each draft's token drawn from its node's leader row (draws[b, r, k] is draft k's
        draw from row r), the prefix groups and leaders extended. Returns the new `same` [B, K, K]."""
        num_drafts = tokens.shape[1]
        penalised = self.warp.path_dependent
        probs[:, :, depth] = self.warp.probs(logits, draft_paths(tokens[:, :, :depth]) if penalised else None)
        draws = sample_categorical_many(probs[:, :, depth], uniforms[:, depth, None, :].expand(-1, num_drafts, -1))
        tokens[:, :, depth] = draws.gather(1, leaders[depth][:, None, :]).squeeze(1)
        same = extend_same_prefix(same, tokens[:, :, depth])
        leaders.append(leaders_of(same))
        return same

    def _tree(self, tokens, probs, leaders, nonfinite, running) -> DraftTree:
        """Finish the tree: rows that stopped generating get a single path (token 0 at every depth)."""
        stopped = ~running[:, None, None]  # [B, 1, 1]
        tokens = tokens.masked_fill(stopped, 0)
        leader = torch.stack(leaders, -1).masked_fill(stopped, 0)  # [B, K, L + 1]
        node_of, num_nodes = compact_nodes(leader)
        return DraftTree(tokens=tokens, draft_probs=probs, leader=leader, node_of=node_of, num_nodes=num_nodes,
                         nonfinite=nonfinite & running, shared=shared_depths(leader) & running[:, None])

    def commit(self, tree: DraftTree, draft_index: torch.Tensor, num_accepted: torch.Tensor,
               next_tokens: torch.Tensor, running: torch.Tensor) -> None:
        """Keep the accepted path of draft `draft_index` in the draft cache, for rows still `running`.

        draft_index, num_accepted, next_tokens, running: [B] (next_tokens = the correction or bonus
        token). The accepted tokens of depth < L-1 are in the cache and are gathered to base + i;
        when all L were accepted, the last draft token and the bonus become the 2 pending tokens.
        Rows not running keep their cache, pending tokens and lengths as they were.
        """
        num_drafts, draft_length = tree.tokens.shape[1:]
        lengths = self.cache.rows.lengths  # [B]
        base = lengths + self.num_pending  # [B]
        kept = torch.where(running, num_accepted.clamp(max=draft_length - 1), 0)  # [B]
        depth = torch.arange(draft_length - 1, device=base.device)  # [L-1]
        dest = base[:, None] + depth  # [B, L-1]
        source = base[:, None] + depth * num_drafts + draft_index[:, None]  # [B, L-1]
        self.cache.rows.keep_path(torch.where(depth < kept[:, None], source, dest), dest)
        self.cache.rows.advance(torch.where(running, self.num_pending + kept, 0))  # to base + kept, in place

        all_accepted = num_accepted == draft_length  # [B]
        last_draft = tree.tokens[:, :, -1].gather(1, draft_index[:, None]).squeeze(1)  # [B]
        pending = torch.stack([torch.where(all_accepted, last_draft, next_tokens),
                               torch.where(all_accepted, next_tokens, 0)], 1)  # [B, 2]
        self.pending = torch.where(running[:, None], pending, self.pending)
        self.num_pending = torch.where(running, 1 + all_accepted.to(torch.int64), self.num_pending)

    def catch_up(self, recent: torch.Tensor, lag: torch.Tensor, view_length: int) -> None:
        """Feed the draft cache, in ONE forward, the tokens committed while it sat idle.

        recent: [B, M] each row's last M committed tokens (the last one is the row's newest);
        lag: [B] how many of them the draft has not seen (0..M; 0 for rows that are not running);
        view_length: host bound of max(cache lengths) + M + 1. Afterwards a row with lag > 0 has
        its pending tokens and all but the newest missing token in the cache, and the newest
        pending, as after an admission. No host sync.
        """
        batch, missing = recent.shape
        lengths = self.cache.rows.lengths  # [B]
        device = lengths.device
        width = 1 + missing  # the longest fed sequence: 2 pending + M missing - the newest
        offsets = torch.arange(width, device=device)  # [W]
        # the row's sequence: its pending tokens, then the missing ones (the right end of `recent`)
        source = torch.cat([self.pending, recent], 1)  # [B, 2 + M]
        index = torch.where(offsets < self.num_pending[:, None], offsets,
                            offsets - self.num_pending[:, None] + 2 + missing - lag[:, None])  # [B, W]
        fed = source.gather(1, index.clamp(0, 1 + missing))  # [B, W]
        counts = torch.where(lag > 0, self.num_pending + lag - 1, 0)  # [B] tokens the cache takes
        slots = (lengths[:, None] + offsets).clamp(max=self.cache.rows.capacity - 1)  # [B, W] padding clamped
        causal = offsets[:, None] >= offsets[None, :]  # [W, W]
        allowed = tree_attention(lengths, causal, min(view_length, self.cache.rows.capacity))
        self.model.forward(fed, lengths[:, None] + offsets, allowed, self.cache, slots, last_only=True)
        newest = recent[:, -1]  # [B]
        self.cache.rows.advance(counts)
        self.pending[:, 0] = torch.where(lag > 0, newest, self.pending[:, 0])
        self.num_pending = torch.where(lag > 0, 1, self.num_pending)

    # -- rows of the pool ------------------------------------------------------------
    def reset(self, rows: torch.Tensor, last_tokens: torch.Tensor) -> None:
        """Newly admitted rows `rows` ([N] int64): their last prompt tokens ([N]) become pending."""
        self.pending.index_copy_(0, rows, torch.stack([last_tokens, torch.zeros_like(last_tokens)], 1))
        self.num_pending.index_fill_(0, rows, 1)

    def prefix(self, count: int, cache) -> TreeDrafter:
        """A drafter for rows [0, count) only, over `cache` (their prefix of the draft cache)."""
        part = object.__new__(TreeDrafter)
        part.__dict__.update(self.__dict__)
        part.cache = cache
        part.pending = self.pending[:count]  # [R, 2] a view
        part.num_pending = self.num_pending[:count]  # [R] a view
        return part

    def put_prefix(self, count: int, part: TreeDrafter) -> None:
        """Write back the pending tokens of a drafter made by `prefix(count, ...)` (its commit rebinds them)."""
        self.pending[:count] = part.pending
        self.num_pending[:count] = part.num_pending
