"""Cutting the tokenized prompts into fixed shards, and the per-row seed.

Shard i holds rows [i * shard_size, (i + 1) * shard_size) in file order, so the same data and
`shard_size` always give the same shards (which is what makes resume possible). Each row's seed is a
hash of `spectr.seed` and the row's id: it does not depend on the row's position, its shard, its batch
or the number of actors.

This module does not run anything; `pipeline.generate.worker` turns a shard into rows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Shard:
    index: int
    ids: list[Any]
    prompts: list[str]
    prompt_token_ids: list[list[int]]
    seeds: list[int]

    def __len__(self) -> int:
        return len(self.ids)


def row_seed(base_seed: int, row_id: Any) -> int:
    """A 63-bit seed for one row, from the job seed and the row id (int and str ids never collide)."""
    key = f"{int(base_seed)}\x00{type(row_id).__name__}\x00{row_id}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)


def num_shards(num_rows: int, shard_size: int) -> int:
    return (num_rows + shard_size - 1) // shard_size


def cut_shards(
    ids: list[Any],
    prompts: list[str],
    prompt_token_ids: list[list[int]],
    shard_size: int,
    base_seed: int,
) -> list[Shard]:
    if not (len(ids) == len(prompts) == len(prompt_token_ids)):
        raise ValueError(
            f"cut_shards: ids ({len(ids)}), prompts ({len(prompts)}) and token ids ({len(prompt_token_ids)}) "
            "must have the same length"
        )
    if shard_size < 1:
        raise ValueError(f"cut_shards: shard_size must be >= 1, got {shard_size}")
    shards = []
    for index in range(num_shards(len(ids), shard_size)):
        rows = slice(index * shard_size, (index + 1) * shard_size)
        shard_ids = ids[rows]
        shards.append(
            Shard(
                index=index,
                ids=list(shard_ids),
                prompts=list(prompts[rows]),
                prompt_token_ids=[list(t) for t in prompt_token_ids[rows]],
                seeds=[row_seed(base_seed, row_id) for row_id in shard_ids],
            )
        )
    return shards
