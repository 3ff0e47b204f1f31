"""Block verification (`spectr.block`): exactness by enumeration for L in {1, 2, 3, 4}, expected
accepted tokens never below token verification's, negative controls, and the batched rule equal to
the slow reference under the same uniforms."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from spectr.block import block_rule
from spectr.reference import (
    block_output_distribution,
    block_weights_and_stops,
    reference_block_sequence,
    sequence_output_distribution,
)
from spectr.sequence import SEQUENCE_RULES, select_sequences

VOCAB_SIZE = 3


def single_draft_law(pair, draft_length, draft_law):
    """{produced tokens: probability} of one call, summed over every draft X ~ p; and E[accepted]."""
    law: dict[tuple[int, ...], float] = {}
    accepted = 0.0
    for draft in itertools.product(range(VOCAB_SIZE), repeat=draft_length):
        weight = pair.sequence_probability(draft, "p")
        if weight <= 0:
            continue
        p = [pair.p(draft[:i]) for i in range(draft_length)]
        q = [pair.q(draft[:i]) for i in range(draft_length + 1)]
        for produced, mass in draft_law(list(draft), p, q).items():
            law[produced] = law.get(produced, 0.0) + weight * mass
            accepted += weight * mass * (len(produced) - 1)
    return law, accepted


def token_verification_law(draft, p, q):
    return sequence_output_distribution("speculative", [draft], [p], [q])


def max_error_to_target(pair, law, total_length):
    """Continue each produced sequence with exact target sampling to total_length tokens; max |law - q|."""
    completed: dict[tuple[int, ...], float] = {}
    for produced, mass in law.items():
        for tail in itertools.product(range(VOCAB_SIZE), repeat=total_length - len(produced)):
            full = produced + tail
            tail_mass = math.prod(pair.q(full[:i])[full[i]] for i in range(len(produced), total_length))
            completed[full] = completed.get(full, 0.0) + mass * tail_mass
    return max(abs(completed.get(w, 0.0) - pair.sequence_probability(w, "q"))
               for w in itertools.product(range(VOCAB_SIZE), repeat=total_length))


@pytest.mark.parametrize("draft_length", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_law_equals_target_and_accepts_at_least_as_much_as_token_verification(
    toy_pair_factory, draft_length, seed
):
    pair = toy_pair_factory(VOCAB_SIZE, draft_length, seed)
    law, block_accepted = single_draft_law(pair, draft_length, block_output_distribution)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    assert all(1 <= len(s) <= draft_length + 1 for s in law)
    assert max_error_to_target(pair, law, draft_length + 1) < 1e-9
    _, token_accepted = single_draft_law(pair, draft_length, token_verification_law)
    assert block_accepted >= token_accepted - 1e-12


@pytest.mark.parametrize("draft_length", [2, 3, 4])
def test_block_accepts_strictly_more_on_some_pair_for_each_length(toy_pair_factory, draft_length):
    gains = []
    for seed in range(3):
        pair = toy_pair_factory(VOCAB_SIZE, draft_length, seed)
        gains.append(single_draft_law(pair, draft_length, block_output_distribution)[1]
                     - single_draft_law(pair, draft_length, token_verification_law)[1])
    assert max(gains) > 1e-3


def _token_stops(weights, excess):
    """Broken: h_i = w_i at every i (token verification's acceptance with block residuals)."""
    return list(weights)


def _no_weight_residual_law(draft, p, q):
    """Broken: the residual after X_<=tau drops the w_tau factor (norm(max(q - p, 0)))."""
    from spectr import reference

    original = reference._block_last_weights
    try:
        reference._block_last_weights = lambda w, p, q, tau, n: original([1.0] * len(w), p, q, tau, n)
        return block_output_distribution(draft, p, q)
    finally:
        reference._block_last_weights = original


@pytest.mark.parametrize("broken", ["token stops", "residual without w"])
def test_enumeration_rejects_broken_block_rules(toy_pair_factory, broken):
    pair = toy_pair_factory(VOCAB_SIZE, 3, seed=0)
    if broken == "token stops":
        law, _ = single_draft_law(pair, 3, lambda d, p, q: block_output_distribution(d, p, q, _token_stops))
    else:
        law, _ = single_draft_law(pair, 3, _no_weight_residual_law)
    assert max_error_to_target(pair, law, 4) > 1e-3


def test_context_free_single_position_is_speculative_sampling():
    """L = 1: h_1 = w_1 = min(1, q/p), the residual norm(max(q - p, 0)): the same law as token verification."""
    p, q = [[0.5, 0.3, 0.2]], [[0.2, 0.3, 0.5], [0.6, 0.2, 0.2]]
    for x in range(3):
        block = block_output_distribution([x], p, q)
        token = token_verification_law([x], p, q)
        assert block.keys() == token.keys()
        assert all(block[k] == pytest.approx(token[k], abs=1e-15) for k in block)
    weights, stops = block_weights_and_stops([0], p, q)
    assert weights == [1.0, 0.4] and stops == [0.4]


# --- batched == reference -------------------------------------------------------------------------


def reference_rows(draft_tokens, draft_probs, target_probs, uniforms):
    rows = []
    for b in range(draft_tokens.shape[0]):
        rows.append(reference_block_sequence(draft_tokens[b, 0].tolist(), draft_probs[b, 0].double().tolist(),
                                             target_probs[b, 0].double().tolist(), uniforms[b].tolist()))
    return rows


@pytest.mark.parametrize("draft_length,seed", [(1, 0), (2, 1), (3, 2), (4, 3), (6, 4)])
def test_batched_block_equals_reference_under_the_same_uniforms(toy_pair_factory, draft_length, seed):
    pair = toy_pair_factory(3, draft_length, seed)
    generator = torch.Generator().manual_seed(seed)
    inputs = pair.sample_draft_set(300, 1, draft_length, generator)
    uniforms = torch.rand(300, draft_length + 1, 2, generator=generator, dtype=torch.float64)
    batched = select_sequences(*inputs, uniforms, method="block")
    expected = reference_rows(*inputs, uniforms)
    for b, (produced, tau) in enumerate(expected):
        assert int(batched.num_accepted[b]) == tau
        assert batched.tokens[b, : tau + 1].tolist() == produced
        assert (batched.tokens[b, tau + 1 :] == -1).all()
    taus = batched.num_accepted
    assert int(taus.min()) == 0 and int(taus.max()) == draft_length  # both ends were reached
    assert batched.accepted_per_position.tolist() == [int((taus > i).sum()) for i in range(draft_length)]


def test_batched_block_on_float32_engine_like_inputs_and_the_generator_api():
    """Random float32 distributions with zeros (p = 0 where q likes a token, q = 0 on the last token)."""
    g = torch.Generator().manual_seed(11)
    batch, length, vocab = 200, 4, 7
    draft_logits = torch.randn(batch, 1, length, vocab, generator=g)
    target_logits = torch.cat([draft_logits, draft_logits[:, :, -1:]], 2) + 0.8 * torch.randn(
        batch, 1, length + 1, vocab, generator=g)
    draft_logits[..., 0] = -torch.inf
    target_logits[..., 0] += 2.0
    target_logits[..., -1] = -torch.inf
    draft_probs, target_probs = draft_logits.softmax(-1), target_logits.softmax(-1)
    draft_tokens = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=g).view(batch, 1, length)
    uniforms = torch.rand(batch, length + 1, 2, generator=g, dtype=torch.float64)
    batched = select_sequences(draft_tokens, draft_probs, target_probs, uniforms, method="block")
    for b, (produced, tau) in enumerate(reference_rows(draft_tokens, draft_probs, target_probs, uniforms)):
        assert batched.tokens[b, : tau + 1].tolist() == produced
    with pytest.raises(ValueError, match="method 'block' needs K = 1"):
        select_sequences(draft_tokens.expand(-1, 2, -1), draft_probs.expand(-1, 2, -1, -1),
                         target_probs.expand(-1, 2, -1, -1), torch.rand(batch, length + 1, 3, dtype=torch.float64),
                         method="block")


def test_the_negative_control_rule_is_registered_through_the_same_code(monkeypatch, toy_pair_factory):
    """`block_rule(h)` with h = w (the e2e negative control) differs from "block" on the same inputs."""
    pair = toy_pair_factory(3, 3, 5)
    generator = torch.Generator().manual_seed(5)
    inputs = pair.sample_draft_set(400, 1, 3, generator)
    uniforms = torch.rand(400, 4, 2, generator=generator, dtype=torch.float64)
    monkeypatch.setitem(SEQUENCE_RULES, "block_token_stops", block_rule(lambda w, s: w))
    good = select_sequences(*inputs, uniforms, method="block", validate=False)
    broken = select_sequences(*inputs, uniforms, method="block_token_stops", validate=False)
    assert not torch.equal(good.tokens, broken.tokens)
    for b in range(50):  # the broken variant is the reference with the same broken h, row for row
        produced, tau = reference_block_sequence(inputs[0][b, 0].tolist(), inputs[1][b, 0].tolist(),
                                                 inputs[2][b, 0].tolist(), uniforms[b].tolist(), _token_stops)
        assert broken.tokens[b, : tau + 1].tolist() == produced
