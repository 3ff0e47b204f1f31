"""Input checks for the public selection entry points.

Each check raises a `ValueError` that names the argument, the problem and the first place
where it occurs (an index into the argument), so that a caller can find a bad row at once.
The checks run a few passes over their tensors; hot loops that already checked their inputs
once call the selection functions with `validate=False`.

This module does not repair inputs (no renormalising, no clamping): bad numbers are refused.
"""

from __future__ import annotations

import torch

# How far a probability row may sum from 1, by dtype. Half precision rows that come out of
# a softmax can be off by a few units in the last place times the vocabulary size.
_SUM_TOLERANCE = {
    torch.float64: 1e-6,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 2e-2,
}


def _first_index(mask: torch.Tensor) -> tuple[int, ...]:
    """Index of the first True entry of `mask` (which must have one)."""
    flat = int(mask.reshape(-1).to(torch.int8).argmax())
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), mask.shape))


def _where(index: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(i) for i in index) + "]"


def check_probabilities(name: str, probs: torch.Tensor) -> None:
    """`probs` [..., V] must be finite, non-negative, and each row must sum to 1."""
    if not isinstance(probs, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(probs).__name__}")
    if not probs.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {probs.dtype}")
    if probs.dim() < 1 or probs.shape[-1] < 1:
        raise ValueError(
            f"{name} must have a non-empty last (vocabulary) dimension, got shape {tuple(probs.shape)}"
        )
    if probs.numel() == 0:
        return
    # Fast path: two reductions. NaN and inf propagate into the row sums.
    accumulate = torch.float32 if probs.dtype in (torch.float16, torch.bfloat16) else probs.dtype
    sums = probs.sum(-1, dtype=accumulate)  # [...]
    if not bool(torch.isfinite(sums).all()):
        not_finite = ~torch.isfinite(probs)
        if bool(not_finite.any()):
            idx = _first_index(not_finite)
            raise ValueError(f"{name}{_where(idx)} is {probs[idx].item()} (must be finite)")
        idx = _first_index(~torch.isfinite(sums))
        raise ValueError(f"{name}{_where(idx)} sums to {sums[idx].item()} (overflow)")
    if bool(probs.min() < 0):
        idx = _first_index(probs < 0)
        raise ValueError(f"{name}{_where(idx)} = {probs[idx].item()} is negative")
    tolerance = _SUM_TOLERANCE.get(probs.dtype, 1e-4)
    off = (sums - 1.0).abs() > tolerance
    if bool(off.any()):
        idx = _first_index(off)
        raise ValueError(
            f"{name}{_where(idx)} sums to {sums[idx].item():.9g}, expected 1 within {tolerance:g} "
            "(pass probabilities, not logits)"
        )


def check_token_ids(name: str, tokens: torch.Tensor, vocab_size: int) -> None:
    """`tokens` must be an integer tensor with every entry in [0, vocab_size)."""
    if not isinstance(tokens, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tokens).__name__}")
    if tokens.is_floating_point() or tokens.dtype == torch.bool or tokens.is_complex():
        raise ValueError(f"{name} must be an integer tensor of token ids, got dtype {tokens.dtype}")
    if tokens.numel() == 0:
        return
    out_of_range = (tokens < 0) | (tokens >= vocab_size)
    if bool(out_of_range.any()):
        idx = _first_index(out_of_range)
        raise ValueError(f"{name}{_where(idx)} = {int(tokens[idx])} is not a token id in [0, {vocab_size})")


def check_uniforms(name: str, uniforms: torch.Tensor) -> None:
    """`uniforms` must be float64 values in [0, 1)."""
    if not isinstance(uniforms, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(uniforms).__name__}")
    if uniforms.dtype != torch.float64:
        raise ValueError(f"{name} must be float64, got {uniforms.dtype}")
    if uniforms.numel() == 0:
        return
    bad = ~((uniforms >= 0) & (uniforms < 1))
    if bool(bad.any()):
        idx = _first_index(bad)
        raise ValueError(f"{name}{_where(idx)} = {uniforms[idx].item()} is not in [0, 1)")


def check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...], meaning: str) -> None:
    """`tensor.shape` must equal `expected`; `meaning` spells the dimensions, e.g. '[B, K, L]'."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {meaning} = {tuple(expected)}")
