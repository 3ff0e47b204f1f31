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
Finished rows leave the batch with `select_rows`.

Buffers are preallocated per layer as `[B, H, capacity, D]` on the first write, so a
forward attends a view `[:, :, :view_length]` with view_length = max committed length +
new tokens: one host int per forward, known without a device sync.

This module knows nothing about Hugging Face: `spectr.hf` adapts it to HF's cache API.
"""

from __future__ import annotations

import torch


class RowKVCache:
    """Left-aligned per-row KV slots for `num_layers` attention layers."""

    def __init__(self, num_layers: int, batch_size: int, capacity: int, device: torch.device | str):
        self.num_layers = int(num_layers)
        self.capacity = int(capacity)
        self.device = torch.device(device)
        self.keys: list[torch.Tensor | None] = [None] * self.num_layers  # each [B, H, capacity, D]
        self.values: list[torch.Tensor | None] = [None] * self.num_layers  # each [B, H, capacity, D]
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=self.device)  # [B]
        self._write_slots: torch.Tensor | None = None  # [B, T]
        self._write_index: dict[tuple[int, int], torch.Tensor] = {}
        self._view_length = 0

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    # --- one forward -------------------------------------------------------------------
    def begin_forward(self, write_slots: torch.Tensor, view_length: int) -> None:
        """Declare where the next forward's tokens go and how many slots it may attend.

        write_slots: [B, T] int64, per-row slot of each new token (all >= lengths[b], distinct
        within a row, < view_length). view_length: host int, the attended prefix of the buffers.
        """
        if view_length > self.capacity:
            raise RuntimeError(f"KV cache capacity {self.capacity} exceeded (need {view_length} slots)")
        self._write_slots = write_slots
        self._write_index = {}
        self._view_length = int(view_length)

    def write(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's new keys/values [B, H, T, D]; return the attended views [B, H, view_length, D]."""
        if self._write_slots is None:
            raise RuntimeError("RowKVCache.write called outside a forward (begin_forward first)")
        if self.keys[layer_idx] is None:
            shape = (keys.shape[0], keys.shape[1], self.capacity, keys.shape[3])
            self.keys[layer_idx] = torch.zeros(shape, dtype=keys.dtype, device=keys.device)
            self.values[layer_idx] = torch.zeros(shape, dtype=values.dtype, device=values.device)
        num_heads, head_dim = keys.shape[1], keys.shape[3]
        index = self._write_index.get((num_heads, head_dim))
        if index is None:
            batch, new = self._write_slots.shape
            index = self._write_slots[:, None, :, None].expand(batch, num_heads, new, head_dim)  # [B, H, T, D]
            self._write_index[(num_heads, head_dim)] = index
        key_buffer, value_buffer = self.keys[layer_idx], self.values[layer_idx]
        key_buffer.scatter_(2, index, keys.to(key_buffer.dtype))
        value_buffer.scatter_(2, index, values.to(value_buffer.dtype))
        return key_buffer[:, :, : self._view_length], value_buffer[:, :, : self._view_length]

    # --- commit --------------------------------------------------------------------------
    def keep_path(self, source_slots: torch.Tensor, dest_slots: torch.Tensor) -> None:
        """Copy slots `source_slots[b, i]` to `dest_slots[b, i]` in every layer (gather, then scatter).

        source_slots, dest_slots: [B, M] int64. Destinations must be distinct within a row; an
        entry with source == dest is a no-op, which is how rows that keep fewer than M tokens pad.
        """
        if source_slots.shape[1] == 0:
            return
        for layer_idx in range(self.num_layers):
            for buffers in (self.keys, self.values):
                buffer = buffers[layer_idx]
                if buffer is None:
                    continue
                batch, num_heads, _, head_dim = buffer.shape
                width = source_slots.shape[1]
                src = source_slots[:, None, :, None].expand(batch, num_heads, width, head_dim)
                dst = dest_slots[:, None, :, None].expand(batch, num_heads, width, head_dim)
                buffer.scatter_(2, dst, buffer.gather(2, src))

    def advance(self, counts: torch.Tensor) -> None:
        """Extend each row's committed prefix by counts[b] slots ([B] int64, on the cache's device)."""
        self.lengths += counts

    def select_rows(self, row_indices: torch.Tensor) -> None:
        """Keep only rows `row_indices` ([B'] int64), in that order (drops finished rows)."""
        for buffers in (self.keys, self.values):
            for layer_idx, buffer in enumerate(buffers):
                if buffer is not None:
                    buffers[layer_idx] = buffer.index_select(0, row_indices)
        self.lengths = self.lengths.index_select(0, row_indices)
        self._write_slots = None
        self._write_index = {}

    def committed(self, layer_idx: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s committed keys and values of one layer, [H, lengths[row], D] each (for tests)."""
        length = int(self.lengths[row])
        return self.keys[layer_idx][row, :, :length], self.values[layer_idx][row, :, :length]


def tree_attention(prefix_lengths: torch.Tensor, visible: torch.Tensor, view_length: int) -> torch.Tensor:
    """Boolean attention pattern of T new tokens over the first `view_length` cache slots.

    Row b's new token t may attend every slot s < prefix_lengths[b] (the row's committed
    prefix) and the slots prefix_lengths[b] + r with visible[t, r] True (the new tokens, laid
    out right after the prefix: a causal chain, a tree of drafts, ...).

    prefix_lengths: [B] int64; visible: [T, R] bool; returns [B, T, view_length] bool.
    """
    num_new, width = visible.shape
    relative = torch.arange(view_length, device=prefix_lengths.device)[None, :] - prefix_lengths[:, None]  # [B, S]
    # column `width` of the padded pattern is all False: slots past the new tokens
    padded = torch.cat([visible, visible.new_zeros(num_new, 1)], dim=1)  # [T, R+1]
    in_tree = padded[:, relative.clamp(0, width)]  # [T, B, S]
    return in_tree.permute(1, 0, 2) | (relative < 0)[:, None, :]  # [B, T, S]
