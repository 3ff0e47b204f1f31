"""Per-row random streams: counter-based uniforms, and inverse-CDF sampling with given uniforms.

The engine's randomness is *counter-based*: a uniform is a pure function of three integers,
so a row's numbers depend only on its own seed and its own iteration count, never on which
other rows share the batch, on the device, or on when the row joined. All rows of an
iteration are computed in one vectorised op (`counter_uniforms`), with no generator state
and no Python loop over rows.

Stream layout
-------------
A row with seed ``s`` draws, at its iteration ``t`` (0 for the first iteration after its
prefill, +1 per iteration it takes part in), the uniforms ``u(s, t, j)`` for the slots
``j = 0 .. S-1`` of that iteration:

    key_s    = mix(s)                                  (once per row)
    key_st   = mix(key_s + t * ITERATION_STRIDE)
    u(s,t,j) = top53(mix(key_st + j * SLOT_STRIDE)) * 2**-53      (float64 in [0, 1))

``mix`` is SplitMix64's finaliser (Steele, Lea, Flood 2014; Stafford's "variant 13"), a
bijection on 64-bit words with full avalanche; every addition and multiplication wraps
modulo 2**64 (int64 tensors, two's complement), and ``>>`` is a logical shift. A seed is
any Python int, reduced modulo 2**64.

The slots of one iteration (`IterationSlots`), for K drafts of L tokens:

- ``[0, K*L)``: drafting; slot ``i*K + k`` draws draft k's token at depth i;
- ``[K*L, K*L + (L+1)*(K+1))``: selection; position i (row i of the ``[L+1, K+1]`` block,
  row L for the bonus token) uses column j < K for the test of draft j and column K for the
  correction (or bonus) token. Block verification (K = 1) reads its eta_i from column 0 of
  row i and the uniform of its last token from column 1 of row L; traversal verification tests
  the tree node (leader k, depth i + 1) with column k of row i and draws its last token with
  column K of row L (K = 1: block verification's slots);
- autoregressive decoding uses slot 0 only (S = 1).

Also here: `sample_categorical` / `sample_categorical_many` (inverse CDF with given uniforms).
This module does not warp or hold model outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def _as_int64(value: int) -> int:
    """A Python int modulo 2**64, as the signed int64 with the same bits."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _as_int64(0x9E3779B97F4A7C15)
_MIX1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX2 = _as_int64(0x94D049BB133111EB)
ITERATION_STRIDE = _as_int64(0xD1B54A32D192ED03)
SLOT_STRIDE = _as_int64(0xAEF17502108EF2D9)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's >> is arithmetic: mask the sign extension)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's step and finaliser on int64 words (wrapping arithmetic) -> int64 of the same shape."""
    x = x + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def row_keys(seeds: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """key_s = mix(s) per row: [B] int64 (computed once per row, when it joins)."""
    words = torch.tensor([_as_int64(int(s)) for s in seeds], dtype=torch.int64, device=device)  # [B]
    return mix64(words)


def counter_uniforms(keys: torch.Tensor, iterations: torch.Tensor, num_slots: int) -> torch.Tensor:
    """u(s, t, j) for every row and slot of one iteration: [B, num_slots] float64 in [0, 1).

    keys: [B] int64 from `row_keys`; iterations: [B] int64, each row's own iteration count t.
    """
    iteration_key = mix64(keys + iterations * ITERATION_STRIDE)  # [B]
    slots = torch.arange(num_slots, dtype=torch.int64, device=keys.device) * SLOT_STRIDE  # [S]
    words = mix64(iteration_key[:, None] + slots)  # [B, S]
    return _shift_right(words, 11).to(torch.float64) * 2.0**-53


@dataclass(frozen=True)
class IterationSlots:
    """Where each use of randomness sits in one iteration's slots (see the module docstring)."""

    num_drafts: int
    draft_length: int

    @property
    def num_draft_slots(self) -> int:
        return self.num_drafts * self.draft_length

    @property
    def num_slots(self) -> int:
        return self.num_draft_slots + (self.draft_length + 1) * (self.num_drafts + 1)

    def split(self, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, S] -> (drafting [B, L, K], selection [B, L + 1, K + 1])."""
        batch = uniforms.shape[0]
        k, length = self.num_drafts, self.draft_length
        drafting = uniforms[:, : self.num_draft_slots].reshape(batch, length, k)
        selection = uniforms[:, self.num_draft_slots :].reshape(batch, length + 1, k + 1)
        return drafting, selection


# ---------------------------------------------------------------------------------------
# inverse-CDF sampling
# ---------------------------------------------------------------------------------------


def sample_categorical_many(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """M inverse-CDF draws from each distribution: the smallest index whose cumulative mass exceeds u.

    probs:    [..., V] non-negative with positive total (rows need not be normalised)
    uniforms: [..., M] in [0, 1), M draws from the same row
    returns:  [..., M] int64 token ids; a token with zero probability is never returned

    No host sync: the threshold u * total is clamped below the total, so the first index whose
    cumulative mass exceeds it is one where the mass jumps, i.e. a positive-probability token.
    """
    cdf = probs.to(torch.float64).cumsum(-1)  # [..., V]
    total = cdf[..., -1:]  # [..., 1]
    below_total = torch.nextafter(total, torch.zeros_like(total))  # [..., 1]
    target = torch.minimum(uniforms.to(torch.float64) * total, below_total)  # [..., M]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)


def sample_categorical(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One inverse-CDF draw per distribution: probs [..., V], uniforms [...] -> [...] int64."""
    return sample_categorical_many(probs, uniforms.unsqueeze(-1)).squeeze(-1)
