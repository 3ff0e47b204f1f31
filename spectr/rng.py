"""Per-row random streams.

Every stochastic step in `spectr` takes one `torch.Generator` per row (per prompt), so a
row's randomness depends only on its own seed and on how many numbers that row consumed,
never on which other rows share the batch. This module is the one place that turns a list
of generators into batched uniforms; the per-row loop here is the only Python loop over
rows that the sampling code needs (each call is one small `torch.rand`).

It is not a sampler of model outputs: see `sample_categorical` for inverse-CDF sampling
from given probabilities with given uniforms.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def make_generators(seeds: Sequence[int], device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One seeded generator per row, on `device`."""
    generators = []
    for seed in seeds:
        g = torch.Generator(device=device)
        g.manual_seed(int(seed))
        generators.append(g)
    return generators


def draw_uniforms(
    generators: Sequence[torch.Generator],
    shape: Sequence[int],
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Uniforms in [0, 1), float64, one independent block per row.

    Returns `[N, *shape]` where N = len(generators). Row n is drawn from `generators[n]`
    only, so it is the same whatever the other rows are.
    """
    shape = tuple(int(s) for s in shape)
    if len(generators) == 0:
        return torch.empty((0, *shape), dtype=torch.float64, device=device)
    rows = [torch.rand(shape, generator=g, dtype=torch.float64, device=g.device) for g in generators]
    out = torch.stack(rows)  # [N, *shape]
    if device is not None:
        out = out.to(device)
    return out


def sample_categorical(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: the smallest index whose cumulative mass exceeds u.

    probs:    [..., V] non-negative, rows need not be normalised (they are scaled by their sum)
    uniforms: [...]    in [0, 1)
    returns:  [...]    int64 token ids; a token with zero probability is never returned
    """
    cdf = probs.to(torch.float64).cumsum(-1)  # [..., V]
    total = cdf[..., -1:]  # [..., 1]
    target = uniforms.to(torch.float64).unsqueeze(-1) * total  # [..., 1]
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)  # [..., 1]
    # The first index whose cdf exceeds u * total has positive mass; only the clamp (u * total
    # rounding up to total) can land on a trailing zero-mass token: step those back.
    landed_on_zero = probs.gather(-1, idx) <= 0  # [..., 1]
    if bool(landed_on_zero.any()):
        positions = torch.arange(probs.shape[-1], device=probs.device)  # [V]
        last_positive = torch.where(probs > 0, positions, -1).amax(-1, keepdim=True)  # [..., 1]
        idx = torch.where(landed_on_zero, last_positive, idx)
    return idx.squeeze(-1)
