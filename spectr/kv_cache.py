"""Per-row KV cache with left-aligned committed slots: the one place that moves cached keys.

Invariant (every layer, every row b):
- slots `[0, lengths[b])` hold the keys/values of row b's committed tokens, in order: slot s
  holds the token at position s. Nothing else is ever attended as "the past".
- slots `>= lengths[b]` are scratch: zeros, or speculative entries of the current
  iteration (draft-tree tokens), or stale entries of rejected drafts. They are only
  attended when the caller's mask for the current forward says so (the tree of this
  iteration) and are overwritten later.

A forward writes its T new tokens at explicit per-row slots (`begin_forward(write_slots)`),
normally `lengths[b] + t`, so nothing is appended and nothing is copied K times: the K
drafts of a row share the row's committed prefix and sit side by side as a tree after it.
After selection, `keep_path` gathers the accepted path (a few slots per row) down to
`lengths[b] + i` and `advance` moves the boundary; rows advance by different amounts.

Storage is ONE buffer `[layers, 2 (keys, values), B, H, capacity, D]`, allocated on the first
write, so committing the accepted path of every layer is one gather and one scatter, and
dropping finished rows (`select_rows`) is one index_select; the engine calls the latter
rarely (finished rows stay in place, masked, until the batch is compacted). Every attention
layer must therefore share one (KV heads, head dim, dtype); a model whose layers differ is
refused with a ValueError naming the layer. A forward attends a view `[..., :view_length, :]`
with view_length = max committed length + new tokens: one host int per forward, known
without a device sync.

This module knows nothing about Hugging Face: `spectr.hf` adapts it to HF's cache API.
"""

from __future__ import annotations

import torch


class RowKVCache:
    """Left-aligned per-row KV slots for `num_layers` attention layers, in one stacked buffer."""

    def __init__(self, num_layers: int, batch_size: int, capacity: int, device: torch.device | str):
        self.num_layers = int(num_layers)
        self.capacity = int(capacity)
        self.device = torch.device(device)
        self.buffer: torch.Tensor | None = None  # [layers, 2, B, H, capacity, D]
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=self.device)  # [B]
        self._write_slots: torch.Tensor | None = None  # [B, T]
        self._write_index: torch.Tensor | None = None  # [B, H, T, D]
        self._view_length = 0

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def keys(self) -> list[torch.Tensor | None]:
        """Per-layer views [B, H, capacity, D] of the keys (None before the first write)."""
        return [None if self.buffer is None else self.buffer[i, 0] for i in range(self.num_layers)]

    @property
    def values(self) -> list[torch.Tensor | None]:
        """Per-layer views [B, H, capacity, D] of the values (None before the first write)."""
        return [None if self.buffer is None else self.buffer[i, 1] for i in range(self.num_layers)]

    # --- one forward -------------------------------------------------------------------
    def begin_forward(self, write_slots: torch.Tensor, view_length: int) -> None:
        """Declare where the next forward's tokens go and how many slots it may attend.

        write_slots: [B, T] int64, per-row slot of each new token (all >= lengths[b], distinct
        within a row, < view_length). view_length: host int, the attended prefix of the buffers.
        """
        if view_length > self.capacity:
            raise RuntimeError(f"KV cache capacity {self.capacity} exceeded (need {view_length} slots)")
        self._write_slots = write_slots
        self._write_index = None
        self._view_length = int(view_length)

    def _allocate(self, keys: torch.Tensor) -> None:
        batch, heads, _, head_dim = keys.shape
        shape = (self.num_layers, 2, batch, heads, self.capacity, head_dim)
        self.buffer = torch.zeros(shape, dtype=keys.dtype, device=keys.device)

    def write(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's new keys/values [B, H, T, D]; return the attended views [B, H, view_length, D]."""
        if self._write_slots is None:
            raise RuntimeError("RowKVCache.write called outside a forward (begin_forward first)")
        if self.buffer is None:
            self._allocate(keys)
        _, _, batch, heads, _, head_dim = self.buffer.shape
        if keys.shape[1] != heads or keys.shape[3] != head_dim or values.shape[1:2] != keys.shape[1:2] \
                or values.shape[3] != head_dim:
            raise ValueError(
                f"attention layer {layer_idx} stores keys {tuple(keys.shape[1::2])} / values "
                f"{tuple(values.shape[1::2])} (heads, head dim), but the cache holds ({heads}, {head_dim}) for "
                "every layer; models whose attention layers differ in KV shape are not supported"
            )
        if self._write_index is None:
            new = self._write_slots.shape[1]
            self._write_index = self._write_slots[:, None, :, None].expand(batch, heads, new, head_dim)
        layer = self.buffer[layer_idx]  # [2, B, H, capacity, D]
        layer[0].scatter_(2, self._write_index, keys.to(layer.dtype))
        layer[1].scatter_(2, self._write_index, values.to(layer.dtype))
        return layer[0, :, :, : self._view_length], layer[1, :, :, : self._view_length]

    # --- commit --------------------------------------------------------------------------
    def keep_path(self, source_slots: torch.Tensor, dest_slots: torch.Tensor) -> None:
        """Copy slots `source_slots[b, i]` to `dest_slots[b, i]` in every layer: one gather, one scatter.

        source_slots, dest_slots: [B, M] int64. Destinations must be distinct within a row; an
        entry with source == dest is a no-op, which is how rows that keep fewer than M tokens pad.
        """
        if source_slots.shape[1] == 0 or self.buffer is None:
            return
        layers, _, batch, heads, capacity, head_dim = self.buffer.shape
        stacked = self.buffer.view(layers * 2, batch, heads, capacity, head_dim)  # [2N, B, H, S, D]
        width = source_slots.shape[1]
        shape = (layers * 2, batch, heads, width, head_dim)
        source = source_slots[None, :, None, :, None].expand(shape)  # [2N, B, H, M, D]
        dest = dest_slots[None, :, None, :, None].expand(shape)
        # The gather completes before the scatter writes, so overlapping paths are safe.
        stacked.scatter_(3, dest, stacked.gather(3, source))

    def advance(self, counts: torch.Tensor) -> None:
        """Extend each row's committed prefix by counts[b] slots ([B] int64, on the cache's device)."""
        self.lengths += counts

    def select_rows(self, row_indices: torch.Tensor) -> None:
        """Keep only rows `row_indices` ([B'] int64), in that order: one copy of the whole buffer."""
        if self.buffer is not None:
            self.buffer = self.buffer.index_select(2, row_indices)
        self.lengths = self.lengths.index_select(0, row_indices)
        self._write_slots = None
        self._write_index = None

    def committed(self, layer_idx: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s committed keys and values of one layer, [H, lengths[row], D] each (for tests)."""
        length = int(self.lengths[row])
        return self.buffer[layer_idx, 0, row, :, :length], self.buffer[layer_idx, 1, row, :, :length]


def tree_attention(prefix_lengths: torch.Tensor, visible: torch.Tensor, view_length: int) -> torch.Tensor:
    """Boolean attention pattern of T new tokens over the first `view_length` cache slots.

    Row b's new token t may attend every slot s < prefix_lengths[b] (the row's committed
    prefix) and the slots prefix_lengths[b] + r with visible[t, r] True (the new tokens, laid
    out right after the prefix: a causal chain, a tree of drafts, ...).

    prefix_lengths: [B] int64; visible: [T, R] bool (one pattern for every row) or [B, T, R]
    (per row); returns [B, T, view_length] bool.
    """
    per_row = visible if visible.dim() == 3 else visible.unsqueeze(0).expand(prefix_lengths.shape[0], -1, -1)
    batch, num_new, width = per_row.shape
    relative = torch.arange(view_length, device=prefix_lengths.device)[None, :] - prefix_lengths[:, None]  # [B, S]
    # column `width` of the padded pattern is all False: slots past the new tokens
    padded = torch.cat([per_row, per_row.new_zeros(batch, num_new, 1)], dim=2)  # [B, T, R+1]
    index = relative.clamp(0, width)[:, None, :].expand(batch, num_new, view_length)  # [B, T, S]
    return padded.gather(2, index) | (relative < 0)[:, None, :]  # [B, T, S]
