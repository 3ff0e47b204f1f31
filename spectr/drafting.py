"""The proposer: K drafts x L tokens per row from the draft model, drafted as a tree.

`TreeDrafter.propose` returns the draft tokens *together with* the warped draft distributions
they were sampled from (`DraftProposal`). It runs one draft forward per draft position:

- step 0 feeds the row's pending tokens (1, or 2 after an all-accepted iteration: the last
  draft token never entered the draft cache, and the bonus token) and samples the K first
  tokens i.i.d. from the same p(. | context);
- step j >= 1 feeds the K branches' tokens of depth j-1 in one forward; branch k attends the
  committed prefix plus its own earlier tokens, so the K drafts share the prefix in the draft
  cache instead of copying it K times.

Draft-cache layout during an iteration (see spectr.kv_cache for the invariant): with
`base = lengths + num_pending`, branch k's token of depth i (i < L-1) sits at slot
`base + i*K + k`; its depth-L-1 token is never fed. `commit` gathers the accepted path to
`base + i` and advances the committed prefix.

Randomness: the caller passes the uniforms ([B, K, L] per iteration, from each row's own
generator), so a row consumes a fixed amount of randomness per iteration. This module does
not verify or select drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spectr.kv_cache import tree_attention
from spectr.rng import sample_categorical
from spectr.warps import SamplingWarp


@dataclass
class DraftProposal:
    tokens: torch.Tensor  # [B, K, L] int64
    probs: torch.Tensor  # [B, K, L, V] float32, probs[b, k, j] is the distribution tokens[b, k, j] was drawn from


class TreeDrafter:
    """Owns the draft model's per-row cache and pending tokens for the active rows."""

    def __init__(self, model, cache, warp: SamplingWarp, num_drafts: int, draft_length: int,
                 pending_tokens: torch.Tensor, committed_lengths: list[int]):
        """pending_tokens: [B] the last prompt token of each row; committed_lengths: host mirror of
        cache.rows.lengths (prompt length - 1 after the prefill)."""
        self.model = model
        self.cache = cache
        self.warp = warp
        self.num_drafts = num_drafts
        self.draft_length = draft_length
        batch = pending_tokens.shape[0]
        device = pending_tokens.device
        self.pending = torch.zeros(batch, 2, dtype=torch.int64, device=device)  # [B, 2]
        self.pending[:, 0] = pending_tokens
        self.num_pending = torch.ones(batch, dtype=torch.int64, device=device)  # [B]
        self.lengths_host = list(committed_lengths)
        self.num_pending_host = [1] * batch
        self._branch_visibility = [self._visibility(depth) for depth in range(draft_length)]

    def _visibility(self, depth: int) -> torch.Tensor:
        """[K, depth*K] bool: branch k's query at depth `depth` sees its own tokens of depth < depth."""
        k = self.num_drafts
        columns = torch.arange(depth * k, device=self.pending.device)
        return (columns[None, :] % k) == torch.arange(k, device=self.pending.device)[:, None]

    def propose(self, uniforms: torch.Tensor) -> DraftProposal:
        """Draw K drafts of L tokens per row. uniforms: [B, K, L] float64 in [0, 1)."""
        batch, num_drafts, draft_length = uniforms.shape[0], self.num_drafts, self.draft_length
        lengths = self.cache.rows.lengths  # [B]
        device = lengths.device
        vocab = self.model.vocab_size
        tokens = torch.empty(batch, num_drafts, draft_length, dtype=torch.int64, device=device)
        probs = torch.empty(batch, num_drafts, draft_length, vocab, dtype=torch.float32, device=device)

        # step 0: the pending tokens (padded to the widest row), one distribution per row
        width = max(self.num_pending_host) if batch else 1
        offsets = torch.arange(width, device=device)
        slots = lengths[:, None] + offsets  # [B, W]
        causal = offsets[:, None] >= offsets[None, :]  # [W, W]
        allowed = tree_attention(lengths, causal, max(self.lengths_host) + width)
        logits = self.model.forward(self.pending[:, :width], slots, allowed, self.cache, slots)  # [B, W, V]
        last = (self.num_pending - 1)[:, None, None].expand(batch, 1, logits.shape[-1])
        first_probs = self.warp.probs(logits.gather(1, last).squeeze(1))  # [B, V]
        probs[:, :, 0] = first_probs[:, None, :]
        tokens[:, :, 0] = sample_categorical(probs[:, :, 0], uniforms[:, :, 0])

        # steps 1..L-1: the K branches advance together, each attending its own path
        base = lengths + self.num_pending  # [B] slot of the first draft token
        base_host_max = max(n + p for n, p in zip(self.lengths_host, self.num_pending_host))
        branch = torch.arange(num_drafts, device=device)
        for depth in range(1, draft_length):
            slots = base[:, None] + (depth - 1) * num_drafts + branch  # [B, K]
            positions = (base + depth - 1)[:, None].expand(batch, num_drafts)  # [B, K]
            allowed = tree_attention(base, self._branch_visibility[depth], base_host_max + depth * num_drafts)
            logits = self.model.forward(tokens[:, :, depth - 1], positions, allowed, self.cache, slots)  # [B, K, V]
            probs[:, :, depth] = self.warp.probs(logits)
            tokens[:, :, depth] = sample_categorical(probs[:, :, depth], uniforms[:, :, depth])
        return DraftProposal(tokens=tokens, probs=probs)

    def commit(self, proposal: DraftProposal, draft_index: torch.Tensor, num_accepted: torch.Tensor,
               next_tokens: torch.Tensor, num_accepted_host: list[int]) -> None:
        """Keep the accepted path of draft `draft_index` in the draft cache.

        draft_index, num_accepted, next_tokens: [B] (next_tokens = the correction or bonus token).
        The accepted tokens of depth < L-1 are in the cache and are gathered to base + i; when all
        L were accepted, the last draft token and the bonus become the 2 pending tokens.
        """
        num_drafts, draft_length = self.num_drafts, self.draft_length
        base = self.cache.rows.lengths + self.num_pending  # [B]
        kept = num_accepted.clamp(max=draft_length - 1)  # [B]
        depth = torch.arange(draft_length - 1, device=base.device)  # [L-1]
        dest = base[:, None] + depth  # [B, L-1]
        source = base[:, None] + depth * num_drafts + draft_index[:, None]  # [B, L-1]
        self.cache.rows.keep_path(torch.where(depth < kept[:, None], source, dest), dest)
        self.cache.rows.lengths = base + kept

        all_accepted = num_accepted == draft_length  # [B]
        last_draft = proposal.tokens[:, :, -1].gather(1, draft_index[:, None]).squeeze(1)  # [B]
        self.pending[:, 0] = torch.where(all_accepted, last_draft, next_tokens)
        self.pending[:, 1] = torch.where(all_accepted, next_tokens, torch.zeros_like(next_tokens))
        self.num_pending = 1 + all_accepted.to(torch.int64)

        for row, accepted in enumerate(num_accepted_host):
            self.lengths_host[row] += self.num_pending_host[row] + min(accepted, draft_length - 1)
            self.num_pending_host[row] = 2 if accepted == draft_length else 1

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> None:
        """Keep only the given rows (device index [B'] and the same indices on the host)."""
        self.cache.rows.select_rows(rows)
        self.pending = self.pending.index_select(0, rows)
        self.num_pending = self.num_pending.index_select(0, rows)
        self.lengths_host = [self.lengths_host[r] for r in rows_host]
        self.num_pending_host = [self.num_pending_host[r] for r in rows_host]
