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

Storage is one buffer per *group* of layers: a group is a contiguous run of layers on one device
(`groups`, from `spectr.split.layer_groups`; a model on one device is one group, so ONE buffer
`[layers, 2 (keys, values), B, H, capacity, D]`, exactly as before the split). Group g's buffer is
`buffers[g]` `[layers in g, 2, B, H, capacity, D]` on g's device. Buffers are allocated on the first
write and then reused for the cache's whole life (the engine's *cache pool*: a row of the
buffer is a slot that prompt after prompt occupies), so committing the accepted path of every
layer is one gather and one scatter per group (per device, never per layer). `lengths` and the
caller's index tensors live on `device` (the engine's device, the first group's); a group on
another device gets its own copy of the index tensors (one `.to` per group, a no-op on one device). A finished row's slot is reset (`reset_rows`: its length
goes to 0, and its entries are zeroed only on request), never compacted by copying the
buffer. A cache may instead borrow a larger, longer-lived pool (`adopt`: the compiled engine's static pool, one
per model for the process): its buffers are then views of the pool's first rows and slots. Every attention layer
must share one (KV heads, head dim, dtype); a model whose
layers differ is refused with a ValueError naming the layer. A forward attends a view
`[..., :view_length, :]` with view_length = max committed length + new tokens: one host int
per forward, known without a device sync.

Row subsets: `view(rows)` is the same cache seen through a `[R]` index of its rows
(`RowView`): forwards write into those rows only and attend a gathered copy of their slots,
`keep_path` and `advance` touch only them; the engine prefills newly admitted rows that way.
`prefix(R)` is rows [0, R) as a cache of its own over the same storage (views, no copy): an
iteration runs on it when the slots above R are empty. `move_rows` copies a few rows' used
slots into empty rows, which is how the engine packs the live rows into [0, R) when slots
empty at the tail of a run. Rows are never compacted by copying the buffer.

This module knows nothing about Hugging Face: `spectr.hf` adapts it to HF's cache API.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spectr.split import moved


class RowKVCache:
    """Left-aligned per-row KV slots for `num_layers` attention layers, in one stacked buffer."""

    def __init__(self, num_layers: int, batch_size: int, capacity: int, device: torch.device | str,
                 groups: Sequence[tuple[int, int, torch.device | str]] | None = None):
        """groups: (start, stop, device) per contiguous run of layers (None: one group, every layer on `device`)."""
        self.num_layers = int(num_layers)
        self.capacity = int(capacity)
        self.device = torch.device(device)
        groups = [(0, self.num_layers, self.device)] if groups is None else groups
        self.groups = tuple((int(a), int(b), torch.device(d)) for a, b, d in groups)
        if [a for a, _, _ in self.groups] != [0] + [b for _, b, _ in self.groups[:-1]] \
                or self.groups[-1][1] != self.num_layers or any(a >= b for a, b, _ in self.groups):
            raise ValueError(f"layer groups {groups} do not cover layers [0, {self.num_layers}) in order")
        # layer i -> (its group, its index in the group's buffer)
        self._layer_at = [(g, i - a) for g, (a, b, _) in enumerate(self.groups) for i in range(a, b)]
        self.buffers: list[torch.Tensor | None] = [None] * len(self.groups)  # per group [layers in g, 2, B, H, C, D]
        self.pool: tuple[torch.Tensor, ...] | None = None  # the whole buffers `buffers` are views of (`adopt`)
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=self.device)  # [B]
        self._write_slots: torch.Tensor | None = None  # [B, T]
        self._write_index: torch.Tensor | None = None  # [B, H, T, D]
        self._write_rows: torch.Tensor | None = None  # [R] or None (all rows)
        self._view_length = 0
        self._parent: RowKVCache | None = None  # `prefix`: the cache whose buffer this one's rows are

    @property
    def root(self) -> RowKVCache:
        """The cache whose buffer this one's rows are: itself, or a prefix's parent (no self-reference: a dropped
        cache is freed at once, not by the cycle collector, so its pool is free for the next batcher)."""
        return self if self._parent is None else self._parent

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def buffer(self) -> torch.Tensor | None:
        """The one buffer [layers, 2, B, H, capacity, D] of a one-group cache (None before the first write)."""
        if len(self.groups) != 1:
            raise RuntimeError(f"the cache is split in {len(self.groups)} groups of layers: use `buffers`")
        return self.buffers[0]

    def layer(self, layer_idx: int) -> torch.Tensor | None:
        """Layer `layer_idx`'s view [2, B, H, capacity, D] (keys, values) in its group's buffer."""
        group, local = self._layer_at[layer_idx]
        return None if self.buffers[group] is None else self.buffers[group][local]

    @property
    def keys(self) -> list[torch.Tensor | None]:
        """Per-layer views [B, H, capacity, D] of the keys (None before the first write)."""
        return [None if (v := self.layer(i)) is None else v[0] for i in range(self.num_layers)]

    @property
    def values(self) -> list[torch.Tensor | None]:
        """Per-layer views [B, H, capacity, D] of the values (None before the first write)."""
        return [None if (v := self.layer(i)) is None else v[1] for i in range(self.num_layers)]

    def _on(self, group: int, index: torch.Tensor) -> torch.Tensor:
        """An index tensor of the engine's device, on group `group`'s device (itself when already there: no
        `.to` call at all on one device)."""
        return moved(index, self.groups[group][2])

    # --- one forward -------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers and the lengths (their storages)."""
        held = self.lengths.untyped_storage().nbytes()
        return held + sum(b.untyped_storage().nbytes() for b in self.buffers if b is not None)

    def begin_forward(self, write_slots: torch.Tensor, view_length: int, rows: torch.Tensor | None = None) -> None:
        """Declare where the next forward's tokens go and how many slots it may attend.

        write_slots: [R, T] int64, per-row slot of each new token (all >= lengths[b], distinct
        within a row, < view_length). view_length: host int, the attended prefix of the buffers.
        rows: [R] int64, the buffer rows the forward's batch rows are (None: all B, in order).
        """
        if view_length > self.capacity:
            raise RuntimeError(f"KV cache capacity {self.capacity} exceeded (need {view_length} slots)")
        self._write_slots = write_slots
        self._write_index = [None] * len(self.groups)
        self._write_rows = rows
        self._view_length = int(view_length)

    def _allocate(self, keys: torch.Tensor) -> None:
        """Every group's buffer, shaped after `keys` [B, H, T, D] (heads, head dim, dtype)."""
        _, heads, _, head_dim = keys.shape
        for g, (start, stop, device) in enumerate(self.groups):
            shape = (stop - start, 2, self.batch_size, heads, self.capacity, head_dim)
            self.buffers[g] = torch.zeros(shape, dtype=keys.dtype, device=device)
        self.pool = tuple(self.buffers)

    def adopt(self, pool: Sequence[torch.Tensor]) -> None:
        """Take storage from a larger pool (per group [layers in g, 2, P >= B, H, C' >= capacity, D]): the buffers
        become views of its first B rows and `capacity` slots, zeroed; `pool` keeps the whole tensors (what a
        compiled core reads, so that every cache lent the same pool calls it with the same tensors)."""
        for (start, stop, _), buffer in zip(self.groups, pool):
            if buffer.shape[0] != stop - start or buffer.shape[2] < self.batch_size or buffer.shape[4] < self.capacity:
                raise ValueError(f"a pool buffer of shape {tuple(buffer.shape)} cannot hold layers [{start}, {stop}) "
                                 f"of {self.batch_size} rows x {self.capacity} slots")
        self.pool = tuple(pool)
        self.buffers = [b[:, :, : self.batch_size, :, : self.capacity] for b in self.pool]
        for buffer in self.buffers:
            buffer.zero_()

    def write(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's new keys/values [B, H, T, D]; return the attended views [B, H, view_length, D]."""
        if self._write_slots is None:
            raise RuntimeError("RowKVCache.write called outside a forward (begin_forward first)")
        if self.buffers[0] is None:
            self._allocate(keys)
        group, local = self._layer_at[layer_idx]
        _, _, batch, heads, _, head_dim = self.buffers[group].shape
        if keys.shape[1] != heads or keys.shape[3] != head_dim or values.shape[1:2] != keys.shape[1:2] \
                or values.shape[3] != head_dim:
            raise ValueError(
                f"attention layer {layer_idx} stores keys {tuple(keys.shape[1::2])} / values "
                f"{tuple(values.shape[1::2])} (heads, head dim), but the cache holds ({heads}, {head_dim}) for "
                "every layer; models whose attention layers differ in KV shape are not supported"
            )
        layer = self.buffers[group][local]  # [2, B, H, capacity, D]
        if self._write_rows is not None:
            return self._write_rows_subset(group, layer, keys, values)
        if self._write_index[group] is None:  # once per group and forward
            new = self._write_slots.shape[1]
            slots = self._on(group, self._write_slots)  # [B, T]
            self._write_index[group] = slots[:, None, :, None].expand(batch, heads, new, head_dim)
        index = self._write_index[group]  # [B, H, T, D]
        layer[0].scatter_(2, index, keys.to(layer.dtype))
        layer[1].scatter_(2, index, values.to(layer.dtype))
        return layer[0, :, :, : self._view_length], layer[1, :, :, : self._view_length]

    def _write_rows_subset(self, group: int, layer: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        """`write` for a forward over rows `_write_rows` [R]: scatter there, return gathered views [R, H, view, D]."""
        if self._write_index[group] is None:  # once per group and forward
            rows = self._on(group, self._write_rows)  # [R]
            heads = torch.arange(keys.shape[1], device=rows.device)
            slots = self._on(group, self._write_slots)  # [R, T]
            self._write_index[group] = (rows[:, None, None], heads[None, :, None], slots[:, None, :])  # [R, H, T]
        index = self._write_index[group]
        layer[0].index_put_(index, keys.to(layer.dtype))
        layer[1].index_put_(index, values.to(layer.dtype))
        view = layer[:, :, :, : self._view_length].index_select(1, index[0][:, 0, 0])  # [2, R, H, view, D], a copy
        return view[0], view[1]

    # --- commit --------------------------------------------------------------------------
    def keep_path(self, source_slots: torch.Tensor, dest_slots: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Copy slots `source_slots[b, i]` to `dest_slots[b, i]` in every layer: one gather, one scatter
        per group of layers (one in all on one device).

        source_slots, dest_slots: [B, M] int64 ([R, M] for the buffer rows `rows` [R]). Destinations
        must be distinct within a row; an entry with source == dest is a no-op, which is how rows
        that keep fewer than M tokens pad.
        """
        if source_slots.shape[1] == 0 or self.buffers[0] is None:
            return
        for group, buffer in enumerate(self.buffers):  # one pass per device, not per layer
            source, dest = self._on(group, source_slots), self._on(group, dest_slots)  # [B, M] ([R, M])
            _keep_path(buffer, source, dest, None if rows is None else self._on(group, rows))

    def advance(self, counts: torch.Tensor) -> None:
        """Extend each row's committed prefix by counts[b] slots ([B] int64, on the cache's device)."""
        self.lengths += counts

    def reset_rows(self, rows: torch.Tensor, zero: bool = False) -> None:
        """Empty the slots of rows `rows` ([N] int64): length 0; with `zero`, their entries are zeroed too.

        Stale entries past a row's length are never attended (the mask excludes them, and finite
        values behind a mask contribute exactly 0), so a plain reset is enough for the next
        occupant; `zero` is for rows that may have left non-finite entries behind.
        """
        self.lengths.index_fill_(0, rows, 0)
        if zero and self.buffers[0] is not None:
            for group, buffer in enumerate(self.buffers):
                buffer.index_fill_(2, self._on(group, rows), 0)

    def view(self, rows: torch.Tensor) -> RowView:
        """The rows `rows` ([R] int64) of this cache, as a cache of R rows (no copy)."""
        return RowView(self, rows)

    def prefix(self, count: int) -> RowKVCache:
        """Rows [0, count) as a cache of their own that shares this one's storage (views, no copy):
        every in-place write (forwards, keep_path, advance) lands in this cache. Needs the buffer."""
        part = object.__new__(RowKVCache)
        part.__dict__.update(self.__dict__)
        part._parent = self.root
        part.buffers = [b[:, :, :count] for b in self.buffers]  # per group [layers in g, 2, count, H, capacity, D]
        part.lengths = self.lengths[:count]  # [count]
        part._write_slots = part._write_index = part._write_rows = None
        return part

    def move_rows(self, source: torch.Tensor, dest: torch.Tensor, used_slots: int) -> None:
        """Copy rows `source` to rows `dest` ([M] int64 each, disjoint): their lengths and their first
        `used_slots` slots (a bound of every row's used slots; the rest is scratch), then empty the sources."""
        self.copy_rows(source, dest, used_slots)
        self.lengths.index_fill_(0, source, 0)

    def copy_rows(self, source: torch.Tensor, dest: torch.Tensor, used_slots: int) -> None:
        """Rows `dest` ([M] int64) become copies of rows `source` ([M] int64, none of them in `dest`;
        a source may repeat): lengths and the first `used_slots` slots. The sources keep their rows
        (admission shares one prefill among the copies of a prompt this way)."""
        self.lengths.index_copy_(0, dest, self.lengths.index_select(0, source))
        for group, buffer in enumerate(self.buffers):
            if buffer is not None:
                used = buffer[:, :, :, :, :used_slots]  # [layers in g, 2, B, H, used, D] a view
                used.index_copy_(2, self._on(group, dest), used.index_select(2, self._on(group, source)))

    def committed(self, layer_idx: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s committed keys and values of one layer, [H, lengths[row], D] each (for tests)."""
        length = int(self.lengths[row])
        layer = self.layer(layer_idx)  # [2, B, H, capacity, D]
        return layer[0, row, :, :length], layer[1, row, :, :length]


def _keep_path(buffer: torch.Tensor, source_slots: torch.Tensor, dest_slots: torch.Tensor,
               rows: torch.Tensor | None) -> None:
    """`RowKVCache.keep_path` in one group's buffer [N, 2, B, H, S, D] (indices on its device): one gather,
    one scatter for all of its layers."""
    layers, _, batch, heads, capacity, head_dim = buffer.shape
    stacked = buffer.view(layers * 2, batch, heads, capacity, head_dim)  # [2N, B, H, S, D]
    if rows is not None:
        picked = rows[:, None]  # [R, 1]
        # advanced indices on dims 1 and 3 (split by a slice): the values come out [R, M, 2N, H, D]
        stacked[:, picked, :, dest_slots] = stacked[:, picked, :, source_slots]
        return
    width = source_slots.shape[1]
    shape = (layers * 2, batch, heads, width, head_dim)
    source = source_slots[None, :, None, :, None].expand(shape)  # [2N, B, H, M, D]
    dest = dest_slots[None, :, None, :, None].expand(shape)
    # The gather completes before the scatter writes, so overlapping paths are safe.
    stacked.scatter_(3, dest, stacked.gather(3, source))


class RowView:
    """Rows `rows` [R] of a `RowKVCache`, with the cache's interface: lengths [R], forwards, commits.

    Lengths are read from and written to the underlying cache (nothing to write back);
    forwards scatter into those rows and attend a gathered copy of their attended slots.
    """

    def __init__(self, cache: RowKVCache, rows: torch.Tensor):
        self.cache = cache
        self.rows = rows  # [R] int64
        self.num_layers = cache.num_layers
        self.capacity = cache.capacity
        self.device = cache.device

    @property
    def batch_size(self) -> int:
        return int(self.rows.shape[0])

    @property
    def lengths(self) -> torch.Tensor:
        return self.cache.lengths.index_select(0, self.rows)  # [R]

    @lengths.setter
    def lengths(self, value: torch.Tensor) -> None:
        self.cache.lengths.index_copy_(0, self.rows, value)

    @property
    def _view_length(self) -> int:
        return self.cache._view_length

    def begin_forward(self, write_slots: torch.Tensor, view_length: int) -> None:
        self.cache.begin_forward(write_slots, view_length, self.rows)

    def write(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.write(layer_idx, keys, values)

    def keep_path(self, source_slots: torch.Tensor, dest_slots: torch.Tensor) -> None:
        self.cache.keep_path(source_slots, dest_slots, self.rows)

    def advance(self, counts: torch.Tensor) -> None:
        self.cache.lengths.index_add_(0, self.rows, counts)


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
