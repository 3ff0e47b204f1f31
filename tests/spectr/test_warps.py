"""Sampling warps against Hugging Face's own warpers, greedy, and argument checks."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from spectr.warps import SamplingWarp, validate_sampling, warp_probs


def hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """HF's chain as GenerationMixin builds it for sampling: temperature, top-k, top-p."""
    scores = logits.float()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.9), (0.5, 10, 0.8), (2.0, 3, 0.5), (1.0, 1, 1.0),
     (1.0, 0, 0.01), (0.9, 100, 0.95)],
)
def test_matches_hugging_face_warpers(temperature, top_k, top_p):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=generator) * 3  # [N, V]
    logits[0, :10] = 1.5  # ties at the top-k boundary are kept, as in HF
    ours = warp_probs(logits, temperature, top_k, top_p)
    assert torch.allclose(ours, hf_probs(logits, temperature, top_k, top_p), atol=1e-6)
    assert torch.allclose(ours.sum(-1), torch.ones(64), atol=1e-5)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]])
    assert warp_probs(logits, 1.0, 0, 0.8).nonzero()[:, 1].tolist() == [0, 1]  # 0.5 + 0.3 reaches 0.8
    assert warp_probs(logits, 1.0, 0, 0.81).nonzero()[:, 1].tolist() == [0, 1, 2]
    assert warp_probs(logits, 1.0, 0, 0.1).nonzero()[:, 1].tolist() == [0]  # the top token always stays


def test_same_warp_on_any_leading_shape_and_dtype():
    logits = torch.randn(2, 3, 4, 17, generator=torch.Generator().manual_seed(1))
    flat = warp_probs(logits.reshape(-1, 17), 0.8, 4, 0.9).reshape(2, 3, 4, 17)
    assert torch.equal(warp_probs(logits, 0.8, 4, 0.9), flat)
    half = warp_probs(logits.to(torch.bfloat16), 0.8, 4, 0.9)
    assert half.dtype == torch.float32 and torch.allclose(half.sum(-1), torch.ones(2, 3, 4))


def test_temperature_zero_is_a_one_hot_argmax_with_first_index_on_ties():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 0.0, 5.0]])
    probs = warp_probs(logits, 0.0, 3, 0.5)
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    assert SamplingWarp(0.0).greedy and not SamplingWarp(0.5).greedy


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-0.2), "top_p"),
    ],
)
def test_bad_settings_raise_value_error_naming_the_argument(kwargs, needle):
    settings = dict(temperature=1.0, top_k=0, top_p=1.0) | kwargs
    with pytest.raises(ValueError, match=needle):
        validate_sampling(**settings)
    with pytest.raises(ValueError, match=needle):
        SamplingWarp(**settings)
