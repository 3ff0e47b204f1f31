"""The rows of the batch: per-slot device state over the cache pool, admission, live-row subsets.

A *slot* is one row of every per-row tensor, of both KV caches and of `spectr.records`, all
allocated once for the batcher's life (the cache pool). A prompt occupies a slot from its
admission to its last token; then the slot is reset and the next prompt takes it:

- `prefill` writes the new prompts (every token but the last) into their slots only: a
  forward over the N new rows, through a `RowView` of the cache, with the same right-padded
  causal layout whatever else runs;
- `RowState.admit` sets the slots' device state: the last prompt token pending, the row's
  random-stream key, iteration 0, running.

`RowState` is also what one iteration works on: the whole pool (`slots` = 0..B-1), or
`prefix(R)`, the slots [0, R) when those above are empty, as views of the same state and
caches (no copy), written back with `put_prefix`. `move` (with `RowKVCache.move_rows` and
`Records.move`) packs live rows into empty lower slots, so that the prefix covers them.

This module does not select tokens, hold outputs or decide when rows are admitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spectr.drafting import TreeDrafter
from spectr.hf import HFCausalLM, HFRowCache
from spectr.kv_cache import tree_attention


def prefill(model: HFCausalLM, cache: HFRowCache, prompts: list[list[int]], device,
            rows: torch.Tensor | None = None) -> None:
    """Write every prompt but its last token into `cache` (right-padded batch, causal mask). No host sync.

    rows: [N] int64, the cache rows of the N prompts (None: rows 0..N-1 of a cache of N rows);
    their previous lengths are ignored (the rows start empty).
    """
    if rows is not None:
        cache = cache.view(rows)
    width = max(len(p) for p in prompts) - 1
    lengths = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.int64, device=device)  # [N]
    if width > 0:
        padded = torch.tensor([p[:-1] + [0] * (width + 1 - len(p)) for p in prompts], dtype=torch.int64,
                              device=device)  # [N, P]
        positions = torch.arange(width, device=device).expand(len(prompts), width)  # [N, P]
        causal = positions[0][:, None] >= positions[0][None, :]  # [P, P]
        # Padded queries see only real keys before them (or themselves); real keys never see padding.
        allowed = tree_attention(torch.zeros_like(lengths), causal, width)  # [N, P, P]
        model.forward(padded, positions, allowed, cache, positions, last_only=True)
    cache.rows.lengths = lengths


@dataclass
class RowState:
    """Device state of a set of rows (all [R]); see the module docstring."""

    slots: torch.Tensor  # [R] int64, the pool slot (records row) of each row
    running: torch.Tensor  # [R] bool, generating (False: an empty or finished slot, masked)
    pending: torch.Tensor  # [R] int64, the last committed token, not yet in the target cache
    keys: torch.Tensor  # [R] int64, random-stream key of the row's seed (spectr.rng.row_keys)
    iteration: torch.Tensor  # [R] int64, the row's own iteration count
    target_cache: HFRowCache
    drafter: TreeDrafter | None
    prefixes: dict = field(default_factory=dict)  # count -> (target, draft) HF caches over rows [0, count)

    @classmethod
    def pool(cls, num_slots: int, target_cache: HFRowCache, drafter: TreeDrafter | None, device) -> RowState:
        """Every slot of the pool, all empty."""
        def zeros(dtype=torch.int64):
            return torch.zeros(num_slots, dtype=dtype, device=device)

        return cls(slots=torch.arange(num_slots, device=device), running=zeros(torch.bool), pending=zeros(),
                   keys=zeros(), iteration=zeros(), target_cache=target_cache, drafter=drafter)

    @property
    def nbytes(self) -> int:
        tensors = [self.slots, self.running, self.pending, self.keys, self.iteration]
        if self.drafter is not None:
            tensors += self.drafter.row_tensors()
        return sum(t.untyped_storage().nbytes() for t in tensors)

    def admit(self, slots: torch.Tensor, last_tokens: torch.Tensor, keys: torch.Tensor) -> None:
        """Start rows in `slots` ([N] int64): last prompt tokens [N] pending, stream keys [N], iteration 0."""
        self.running.index_fill_(0, slots, True)
        self.pending.index_copy_(0, slots, last_tokens)
        self.keys.index_copy_(0, slots, keys)
        self.iteration.index_fill_(0, slots, 0)
        if self.drafter is not None:
            self.drafter.reset(slots, last_tokens)

    def prefix(self, count: int) -> RowState:
        """Rows [0, count) of the pool: views of its state and caches (no copy); `put_prefix` after."""
        if count not in self.prefixes:  # built once per count: an HF cache has one object per layer
            draft = None if self.drafter is None else self.drafter.cache.prefix(count)
            self.prefixes[count] = (self.target_cache.prefix(count), draft)
        target_cache, draft_cache = self.prefixes[count]
        drafter = None if self.drafter is None else self.drafter.prefix(count, draft_cache)
        return RowState(slots=self.slots[:count], running=self.running[:count], pending=self.pending[:count],
                        keys=self.keys[:count], iteration=self.iteration[:count], target_cache=target_cache,
                        drafter=drafter)

    def put_prefix(self, count: int, part: RowState) -> None:
        """Write back what an iteration rebound in `part = prefix(count)` (the caches are shared)."""
        self.running[:count] = part.running
        self.pending[:count] = part.pending
        self.iteration[:count] = part.iteration
        if self.drafter is not None:
            self.drafter.put_prefix(count, part.drafter)

    def move(self, source: torch.Tensor, dest: torch.Tensor) -> None:
        """Rows `source` take the empty slots `dest` ([M] int64 each); the sources are left empty (the
        caches move with `RowKVCache.move_rows`, the records with `Records.move`)."""
        tensors = [self.running, self.pending, self.keys, self.iteration]
        if self.drafter is not None:
            tensors += self.drafter.row_tensors()
        for tensor in tensors:
            tensor.index_copy_(0, dest, tensor.index_select(0, source))
        self.running.index_fill_(0, source, False)
