"""Per-row random streams and inverse-CDF sampling (`spectr.rng`)."""

from __future__ import annotations

import torch

from spectr.rng import draw_uniforms, make_generators, sample_categorical


def test_rows_draw_from_their_own_generator_only():
    together = draw_uniforms(make_generators([3, 5, 7]), (4, 2))
    assert together.shape == (3, 4, 2) and together.dtype == torch.float64
    alone = draw_uniforms(make_generators([5]), (4, 2))
    assert torch.equal(together[1], alone[0])
    assert bool(((together >= 0) & (together < 1)).all())
    assert draw_uniforms([], (2,)).shape == (0, 2)


def test_inverse_cdf_boundaries():
    probs = torch.tensor([0.25, 0.0, 0.5, 0.25], dtype=torch.float64)
    uniforms = torch.tensor([0.0, 0.2499, 0.25, 0.7499, 0.75, 1 - 2**-53], dtype=torch.float64)
    tokens = sample_categorical(probs.expand(6, 4), uniforms)
    assert tokens.tolist() == [0, 0, 2, 2, 3, 3]


def test_unnormalised_weights_and_trailing_zeros():
    weights = torch.tensor([[2.0, 6.0, 0.0, 0.0], [0.0, 0.0, 1e-30, 0.0]], dtype=torch.float64)
    top = torch.full((2,), 1 - 2**-53, dtype=torch.float64)
    assert sample_categorical(weights, top).tolist() == [1, 2]  # never a zero-weight token
    assert sample_categorical(weights, torch.tensor([0.25, 0.0], dtype=torch.float64)).tolist() == [1, 2]
    # float32 weights: u * total can round up to the total; still a positive-weight token
    weights32 = torch.tensor([[0.1, 0.2, 0.7, 0.0, 0.0]], dtype=torch.float32)
    assert int(sample_categorical(weights32, torch.tensor([1 - 2**-53], dtype=torch.float64))) == 2


def test_sampling_frequencies_match_probabilities():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3], dtype=torch.float64)
    tokens = sample_categorical(
        probs.expand(200_000, 4), torch.rand(200_000, generator=g, dtype=torch.float64)
    )
    frequencies = torch.bincount(tokens, minlength=4).double() / 200_000
    assert frequencies[1] == 0
    assert torch.allclose(frequencies, probs, atol=5e-3)
