"""How many positions one row may need on an actor's GPU: the memory budget rows are admitted against.

An actor's cache pool is `spectr.batch_size` slots x (capacity + the widest draft tree + 2) positions x the
pair's KV bytes per position, where the capacity is a row's prompt + max_tokens rounded up to a power of two
(at most the models' positions; `pipeline.generate.feed` sizes and grows it). So one row that needs many
positions sizes the whole pool. On CUDA the budget is the device memory free once the pair is loaded
(`torch.cuda.mem_get_info()`, measured once per actor, before any pool), less `HEADROOM` of the device's total
for activations (the verify forward's logits), compiled graphs and the allocator, as vLLM's
`gpu_memory_utilization=0.9` keeps. A row whose pool could never fit in it is an error row of its own (the
worker refuses it before it joins the batch: an input failure, charged to no shard and no actor), instead of
an out-of-memory error that fails the batch and restarts actors in a cascade.

On CPU nothing is measured: the cap is `spectr.max_row_tokens` when set (the feed's), none by default. A
target split over several GPUs (`model.device_map=auto`) is not measured either (its KV is spread over them).

Not here: the admission itself (`pipeline.generate.worker`), the pool (`pipeline.generate.feed`).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

HEADROOM = 0.1  # of the device's total memory, kept for everything but the cache pool


def kv_bytes_per_position(model: Any) -> int:
    """K and V bytes of one position of one row in `model`'s cache: layers x 2 x KV heads x head dim x the
    dtype's size (a feature draft head: one layer). ValueError when its config does not say."""
    config = model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        layers = int(getattr(config, "num_hidden_layers", None) or getattr(model, "num_layers", 1))
        heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    except (AttributeError, TypeError) as err:
        raise ValueError(f"cannot read the KV shape of {type(model).__name__}: {err}") from None
    dtype = getattr(model, "dtype", None)
    if dtype is None:
        dtype = next(model.parameters()).dtype
    return layers * 2 * heads * head_dim * dtype.itemsize


def memory_row_cap(
    free_bytes: int, total_bytes: int, kv_bytes: int, batch_size: int, tree_positions: int,
    model_positions: int | None = None, headroom: float = HEADROOM,
) -> int | None:
    """The most positions (prompt + max_tokens) a row may need so that the pool sized for it fits in
    `free_bytes - headroom x total_bytes`: a power of two (the pool's capacities). None when a pool of the
    models' every position fits (no row is over it); 0 when not even the smallest pool fits (every row is).

    kv_bytes: both models' KV bytes per position of one row (`kv_bytes_per_position`); tree_positions: the
    widest draft tree an iteration may write after a row's positions (max drafts x max length)."""
    budget = free_bytes - headroom * total_bytes

    def fits(capacity: int) -> bool:
        return batch_size * (capacity + tree_positions + 2) * kv_bytes <= budget

    if model_positions is not None and fits(model_positions):
        return None
    if not fits(2):
        return 0
    capacity = 2
    while fits(capacity * 2) and (model_positions is None or capacity * 2 < model_positions):
        capacity *= 2
    return capacity


def memory_message(needed: int, cap: int, free_bytes: int, total_bytes: int, batch_size: int) -> str:
    """A refused row's error: what it needs, what fits, and what to change."""
    room = "no row fits" if cap < 2 else f"rows of at most {cap} positions fit"
    return (f"MemoryError: the row needs {needed} positions (prompt + max_tokens); with {free_bytes / 2**30:.1f} of "
            f"{total_bytes / 2**30:.1f} GiB free on the actor's GPU after loading the pair, a pool of "
            f"spectr.batch_size={batch_size} rows fits {room}: lower the row's max_tokens or spectr.batch_size")


def device_memory(device: str) -> tuple[int, int] | None:
    """(free, total) bytes of a CUDA device (`torch.cuda.mem_get_info`); None elsewhere."""
    if not device.startswith("cuda"):
        return None
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    return int(free), int(total)
