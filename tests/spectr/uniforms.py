"""Seeded uniforms for the selection tests: row n's block comes from its own `torch.Generator(seed n)`.

The library takes its randomness as uniforms (`spectr.sequence.select_sequences`,
`spectr.selection.select_tokens`); the engine draws them from counter-based streams
(`spectr.rng.counter_uniforms`). These tests draw them from one seeded generator per row, so that a
row's values never depend on the other rows and a batched call and the slow reference see the same ones.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def seeded_uniforms(seeds: Iterable[int], shape) -> torch.Tensor:
    """[N, *shape] float64 in [0, 1): row n from torch.Generator().manual_seed(seeds[n])."""
    rows = [torch.rand(tuple(shape), generator=torch.Generator().manual_seed(int(s)), dtype=torch.float64)
            for s in seeds]
    return torch.stack(rows) if rows else torch.empty((0, *shape), dtype=torch.float64)


def call_uniforms(draft_tokens: torch.Tensor, seeds: Iterable[int]) -> torch.Tensor:
    """The uniforms of one selection call on draft_tokens [B, K, L]: [B, L + 1, K + 1]."""
    num_drafts, draft_length = draft_tokens.shape[1:]
    return seeded_uniforms(seeds, (draft_length + 1, num_drafts + 1))
