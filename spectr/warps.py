"""Sampling warps: temperature, then top-k, then top-p, turning logits into probabilities.

The same `SamplingWarp` is applied to the draft's and the target's logits, so the draft
distribution p and the target distribution q are warped identically; speculative methods
then reproduce the *warped* target distribution exactly. The semantics follow Hugging
Face's `TemperatureLogitsWarper`, `TopKLogitsWarper` and `TopPLogitsWarper` (min_tokens_to_keep=1):

- temperature: logits / temperature; `temperature == 0` means greedy, a one-hot on the argmax
  (the first index among ties, as `torch.argmax` and HF's greedy search pick it);
- top-k (`top_k > 0`): keep every token whose logit is >= the k-th largest (ties are kept);
- top-p (`top_p < 1`): keep the smallest set of most likely tokens whose mass reaches top_p
  (tokens whose ascending cumulative mass is <= 1 - top_p are removed; the top token is always kept).

This module is not a sampler: it only maps logits to probabilities. Sampling with per-row
uniforms is `spectr.rng.sample_categorical`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingWarp:
    """Temperature / top-k / top-p settings; `top_k=0` and `top_p=1.0` mean no truncation."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        validate_sampling(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped probabilities, float32, same shape as `logits` ([..., V])."""
        return warp_probs(logits, self.temperature, self.top_k, self.top_p)


def validate_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Raise ValueError naming the argument that is out of range."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = no top-k truncation), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not (0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (1.0 = no top-p truncation), got {top_p!r}")


def warp_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature-scaled, truncated logits (removed tokens are -inf), float32. temperature > 0.

    logits: [..., V]; returns [..., V].
    """
    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    vocab_size = scores.shape[-1]
    if 0 < top_k < vocab_size:
        kth_largest = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth_largest, -math.inf)
    if top_p < 1.0:
        sorted_scores, sorted_indices = torch.sort(scores, dim=-1, descending=False)  # [..., V]
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # [..., V]
        sorted_remove = cumulative <= (1 - top_p)
        sorted_remove[..., -1] = False  # keep at least the most likely token
        remove = sorted_remove.scatter(-1, sorted_indices, sorted_remove)
        scores = scores.masked_fill(remove, -math.inf)
    return scores


def warp_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Warped probabilities (float32) from logits [..., V]; temperature 0 gives a one-hot argmax."""
    if temperature == 0:
        greedy = logits.argmax(dim=-1, keepdim=True)  # [..., 1]
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, greedy, 1.0)
    return warp_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
