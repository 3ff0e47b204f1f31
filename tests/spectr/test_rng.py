"""Per-row random streams and inverse-CDF sampling (`spectr.rng`)."""

from __future__ import annotations

import torch

from spectr.rng import sample_categorical


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


# --- the counter-based stream ------------------------------------------------------------------

_MASK = (1 << 64) - 1


def _mix_reference(x: int) -> int:
    """SplitMix64's step and finaliser on unsigned 64-bit Python ints (the textbook form)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _uniform_reference(seed: int, iteration: int, slot: int) -> float:
    from spectr.rng import ITERATION_STRIDE, SLOT_STRIDE

    key = _mix_reference(seed & _MASK)
    key = _mix_reference((key + iteration * (ITERATION_STRIDE & _MASK)) & _MASK)
    word = _mix_reference((key + slot * (SLOT_STRIDE & _MASK)) & _MASK)
    return (word >> 11) * 2.0**-53


def test_counter_stream_equals_the_documented_formula_bit_for_bit():
    """Wrapping int64 tensor arithmetic reproduces the unsigned 64-bit formula of the docstring."""
    from spectr.rng import counter_uniforms, row_keys

    seeds = [0, 1, 7, -3, 2**63 - 1, 2**64 + 5, 123456789123]
    iterations = torch.tensor([0, 1, 5, 1000, 2**40, 3, 17])
    got = counter_uniforms(row_keys(seeds), iterations, 9)  # [7, 9]
    expected = [[_uniform_reference(s, int(t), j) for j in range(9)] for s, t in zip(seeds, iterations)]
    assert got.tolist() == expected
    # vectorised paths (long tensors) wrap the same way
    many = counter_uniforms(row_keys(range(4000)), torch.arange(4000), 3)
    assert many[1234].tolist() == [_uniform_reference(1234, 1234, j) for j in range(3)]


def test_a_rows_uniforms_depend_only_on_its_seed_and_iteration():
    from spectr.rng import counter_uniforms, row_keys

    together = counter_uniforms(row_keys([5, 9, 11]), torch.tensor([3, 0, 8]), 6)
    alone = counter_uniforms(row_keys([9]), torch.tensor([0]), 6)
    assert torch.equal(together[1], alone[0])
    assert together.dtype == torch.float64 and bool(((together >= 0) & (together < 1)).all())
    # another seed, iteration or slot gives other numbers
    assert not torch.equal(counter_uniforms(row_keys([9]), torch.tensor([1]), 6), alone)
    assert not torch.equal(counter_uniforms(row_keys([10]), torch.tensor([0]), 6), alone)
    assert len(set(alone[0].tolist())) == 6


def test_counter_stream_is_uniform_and_uncorrelated_along_each_counter():
    """Chi-square of the marginal on 64 bins, and of pairs along seeds, iterations and slots on 8 x 8 bins."""
    from scipy.stats import chisquare

    from spectr.rng import counter_uniforms, row_keys

    grid = counter_uniforms(row_keys(range(400)).repeat_interleave(50), torch.arange(50).repeat(400), 20)
    u = grid.view(400, 50, 20)  # [seed, iteration, slot]
    counts = torch.bincount((u.reshape(-1) * 64).long(), minlength=64)
    assert chisquare(counts.numpy()).pvalue > 1e-3
    for a, b in ((u[:-1], u[1:]), (u[:, :-1], u[:, 1:]), (u[:, :, :-1], u[:, :, 1:])):
        cells = (a.reshape(-1) * 8).long() * 8 + (b.reshape(-1) * 8).long()
        assert chisquare(torch.bincount(cells, minlength=64).numpy()).pvalue > 1e-3
    # the same test rejects a stream with a real dependence (a copy shifted by a tiny amount)
    shifted = ((u[:, :, :-1] + 0.01) % 1.0 * 8).long() * 8 + (u[:, :, :-1] * 8).long()
    assert chisquare(torch.bincount(shifted.reshape(-1), minlength=64).numpy()).pvalue < 1e-8


def test_iteration_slots_split_into_drafting_and_selection_blocks():
    from spectr.rng import IterationSlots

    slots = IterationSlots(num_drafts=3, draft_length=2)
    assert slots.num_slots == 3 * 2 + 3 * 4
    uniforms = torch.arange(2 * slots.num_slots, dtype=torch.float64).view(2, -1)
    drafting, selection = slots.split(uniforms)
    assert drafting.shape == (2, 2, 3) and selection.shape == (2, 3, 4)
    assert drafting[1, 1, 2] == slots.num_slots + 1 * 3 + 2  # slot depth*K + k
    assert selection[0, 2, 3] == 6 + 2 * 4 + 3  # after the drafting block, row-major [L+1, K+1]


def test_many_draws_from_one_row_share_its_cdf():
    from spectr.rng import sample_categorical_many

    probs = torch.tensor([[0.5, 0.0, 0.5], [0.0, 0.0, 1.0]], dtype=torch.float32)
    uniforms = torch.tensor([[0.1, 0.6, 1 - 2**-53], [0.0, 0.5, 0.99]], dtype=torch.float64)
    assert sample_categorical_many(probs, uniforms).tolist() == [[0, 2, 2], [2, 2, 2]]
