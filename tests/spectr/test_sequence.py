"""Batched sequence-level selection (`spectr.sequence.select_sequences`): agreement with the
slow reference under identical uniforms, the output invariants, per-row randomness, and
a Monte-Carlo chi-square test with a negative control on the real batched code."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare, norm
from uniforms import call_uniforms

from spectr import selection
from spectr.reference import (
    reference_select_sequences,
    sequence_output_distribution,
    token_output_distribution,
)
from spectr.rng import sample_categorical
from spectr.sequence import PAD_TOKEN, select_sequences

FIELDS = ("tokens", "num_tokens", "num_accepted", "draft_index", "accepted_per_position")


def assert_same_selection(batched, reference):
    for field in FIELDS:
        assert torch.equal(getattr(batched, field), getattr(reference, field)), field


def random_inputs(batch_size, num_drafts, draft_length, vocab_size, seed, zeros=False):
    """Unstructured inputs: random distributions per (row, draft, position), drafts from p."""
    g = torch.Generator().manual_seed(seed)
    draft_logits = torch.randn(
        batch_size, num_drafts, draft_length, vocab_size, generator=g, dtype=torch.float64
    )
    target_logits = draft_logits.repeat_interleave(1, 2)
    target_logits = torch.cat([target_logits, target_logits[:, :, -1:]], 2)
    target_logits = target_logits + 0.7 * torch.randn(target_logits.shape, generator=g, dtype=torch.float64)
    if zeros:
        draft_logits[..., 0] = -torch.inf  # p = 0 on token 0, which q likes
        target_logits[..., 0] += 2.0
        target_logits[..., -1] = -torch.inf  # q = 0 on the last token
    draft_probs = draft_logits.softmax(-1)
    target_probs = target_logits.softmax(-1)
    draft_tokens = sample_categorical(
        draft_probs, torch.rand(draft_probs.shape[:-1], generator=g, dtype=torch.float64)
    )
    if zeros:
        draft_tokens[:, -1, 0] = 0  # a draft token with p = 0
    return draft_tokens, draft_probs, target_probs


CONFIGS = [
    # (method, K, L, seed)
    ("speculative", 1, 3, 0),
    ("spectr", 1, 4, 1),
    ("spectr", 3, 2, 2),
    ("spectr", 4, 5, 3),
    ("specinfer", 3, 4, 4),
    ("specinfer", 1, 2, 5),
]


@pytest.mark.parametrize(("method", "num_drafts", "draft_length", "seed"), CONFIGS)
def test_batched_equals_reference_on_toy_pair(toy_pair_factory, method, num_drafts, draft_length, seed):
    """Drafts drawn from a context-dependent pair: shared prefixes, duplicates, deep accepts."""
    pair = toy_pair_factory(3, draft_length, seed)
    inputs = pair.sample_draft_set(64, num_drafts, draft_length, torch.Generator().manual_seed(seed))
    seeds = list(range(1000 * seed, 1000 * seed + 64))
    batched = select_sequences(*inputs, call_uniforms(inputs[0], seeds), method=method)
    reference = reference_select_sequences(*inputs, call_uniforms(inputs[0], seeds), method=method)
    assert_same_selection(batched, reference)
    assert int(batched.num_accepted.max()) >= 1  # the walk went past position 0


@pytest.mark.parametrize(("method", "num_drafts", "draft_length", "seed"), CONFIGS)
@pytest.mark.parametrize("zeros", [False, True])
def test_batched_equals_reference_on_random_inputs(method, num_drafts, draft_length, seed, zeros):
    inputs = random_inputs(48, num_drafts, draft_length, 7, seed, zeros)
    seeds = [seed * 100 + b for b in range(48)]
    batched = select_sequences(*inputs, call_uniforms(inputs[0], seeds), method=method)
    reference = reference_select_sequences(*inputs, call_uniforms(inputs[0], seeds), method=method)
    assert_same_selection(batched, reference)


def test_batched_token_selection_equals_reference():
    from spectr.reference import reference_select_token

    g = torch.Generator().manual_seed(7)
    num_nodes, num_drafts, vocab_size = 500, 4, 6
    p = torch.randn(num_nodes, vocab_size, generator=g, dtype=torch.float64).softmax(-1)
    q = torch.randn(num_nodes, vocab_size, generator=g, dtype=torch.float64).softmax(-1)
    p[::3, 0] = 0.0
    p = p / p.sum(-1, keepdim=True)
    drafts = torch.randint(0, vocab_size, (num_nodes, num_drafts), generator=g)
    alive = torch.rand(num_nodes, num_drafts, generator=g) < 0.7
    uniforms = torch.rand(num_nodes, num_drafts + 1, generator=g, dtype=torch.float64)
    for method in ("spectr", "specinfer"):
        token, accepted = selection.select_tokens(method, drafts, alive, p, q, uniforms)
        for n in range(num_nodes):
            expected = reference_select_token(
                method,
                drafts[n].tolist(),
                alive[n].tolist(),
                p[n].tolist(),
                q[n].tolist(),
                uniforms[n].tolist(),
            )
            assert (int(token[n]), bool(accepted[n])) == expected, (method, n)


def test_speculative_equals_single_draft_kseq():
    inputs = random_inputs(32, 1, 4, 5, seed=9)
    a = select_sequences(*inputs, call_uniforms(inputs[0], range(32)), method="speculative")
    b = select_sequences(*inputs, call_uniforms(inputs[0], range(32)), method="spectr")
    assert_same_selection(a, b)


@pytest.mark.parametrize("method", ["spectr", "specinfer"])
def test_output_invariants(toy_pair_factory, method):
    num_drafts, draft_length = 3, 4
    pair = toy_pair_factory(3, draft_length, 3)
    draft_tokens, draft_probs, target_probs = pair.sample_draft_set(
        200, num_drafts, draft_length, torch.Generator().manual_seed(3)
    )
    out = select_sequences(
        draft_tokens, draft_probs, target_probs, call_uniforms(draft_tokens, range(200)), method=method
    )
    assert out.tokens.shape == (200, draft_length + 1) and out.tokens.dtype == torch.int64
    assert bool(((out.num_tokens >= 1) & (out.num_tokens <= draft_length + 1)).all())
    assert torch.equal(out.num_accepted, out.num_tokens - 1)
    positions = torch.arange(draft_length + 1)
    produced = positions < out.num_tokens.unsqueeze(1)  # [B, L + 1]
    assert bool((out.tokens[~produced] == PAD_TOKEN).all())
    assert bool(((out.tokens[produced] >= 0) & (out.tokens[produced] < 3)).all())
    # the chosen draft carries the accepted prefix
    chosen = draft_tokens[torch.arange(200), out.draft_index]  # [B, L]
    accepted_mask = positions[:draft_length] < out.num_accepted.unsqueeze(1)  # [B, L]
    assert torch.equal(chosen[accepted_mask], out.tokens[:, :draft_length][accepted_mask])
    expected_counts = torch.stack([(out.num_accepted > i).sum() for i in range(draft_length)])
    assert torch.equal(out.accepted_per_position, expected_counts)
    # every produced token has positive target probability at its prefix
    for b in range(200):
        row = out.tokens[b, : out.num_tokens[b]].tolist()
        assert all(pair.q(row[:i])[t] > 0 for i, t in enumerate(row))


def test_row_randomness_does_not_depend_on_batch():
    inputs = random_inputs(16, 3, 4, 6, seed=11)
    seeds = [7 * b + 1 for b in range(16)]
    together = select_sequences(*inputs, call_uniforms(inputs[0], seeds))
    for b in (0, 5, 15):
        alone = select_sequences(*(x[b : b + 1] for x in inputs), call_uniforms(inputs[0], [seeds[b]]))
        assert torch.equal(alone.tokens[0], together.tokens[b])
        assert torch.equal(alone.draft_index[0], together.draft_index[b])


# ---------------------------------------------------------------------------------------
# Monte-Carlo on the batched code, with a negative control
# ---------------------------------------------------------------------------------------

MC_ROWS = 100_000
MC_VOCAB, MC_DRAFTS, MC_LENGTH = 3, 3, 2


def sorted_kseq_selector(drafts, alive, draft_probs, target_probs, uniforms):
    """Broken: K-SEQ with the drafts tested in token-id order (registered only by the test)."""
    ordered, order = drafts.sort(dim=1, stable=True)
    return selection.select_kseq(ordered, alive.gather(1, order), draft_probs, target_probs, uniforms)


def sorted_kseq_law(drafts, alive, p, q):
    order = sorted(range(len(drafts)), key=lambda j: drafts[j])
    return token_output_distribution("spectr", [drafts[j] for j in order], [alive[j] for j in order], p, q)


def completed_sample(pair, out, total_length, generator):
    """Continue each row's produced tokens with target sampling to total_length tokens [B, T]."""
    _, q_table = pair.tables(total_length - 1)
    tokens = out.tokens[:, :total_length].clone()  # [B, T]
    for position in range(total_length):
        missing = out.num_tokens <= position  # [B]
        prefix = pair.prefix_index(tokens.clamp(min=0), position)  # [B]
        draw = sample_categorical(
            q_table[prefix], torch.rand(tokens.shape[0], generator=generator, dtype=torch.float64)
        )
        tokens[:, position] = torch.where(missing, draw, tokens[:, position])
    return tokens


def exact_iteration_law(pair, token_law):
    single = [
        d
        for d in itertools.product(range(MC_VOCAB), repeat=MC_LENGTH)
        if pair.sequence_probability(d, "p") > 0
    ]
    law = {}
    for drafts in itertools.product(single, repeat=MC_DRAFTS):
        weight = 1.0
        for d in drafts:
            weight *= pair.sequence_probability(d, "p")
        draft_probs, target_probs = pair.draft_inputs([list(d) for d in drafts])
        for s, m in sequence_output_distribution(token_law, drafts, draft_probs, target_probs).items():
            law[s] = law.get(s, 0.0) + weight * m
    return law


def chi_square_over_sequences(pair, tokens):
    """p-value of the observed (L + 1)-token sequences against the target model's law."""
    cells = list(itertools.product(range(MC_VOCAB), repeat=MC_LENGTH + 1))
    expected = torch.tensor([pair.sequence_probability(c, "q") for c in cells], dtype=torch.float64)
    code = torch.zeros(tokens.shape[0], dtype=torch.int64)
    for i in range(MC_LENGTH + 1):
        code = code * MC_VOCAB + tokens[:, i]
    counts = torch.bincount(code, minlength=len(cells)).to(torch.float64)
    if float(counts[expected == 0].sum()) > 0:
        return 0.0
    expected_counts = expected * tokens.shape[0]
    small = (expected_counts < 5) & (expected > 0)  # pool rare cells into one
    big = expected_counts >= 5
    observed = torch.cat([counts[big], counts[small].sum().view(1)])
    expected_counts = torch.cat([expected_counts[big], expected_counts[small].sum().view(1)])
    keep = expected_counts > 0
    return float(chisquare(observed[keep].numpy(), expected_counts[keep].numpy()).pvalue)


def noncentrality(pair, law):
    """MC_ROWS * chi-square distance of an iteration law (completed with target sampling)."""
    total = MC_LENGTH + 1
    completed = {}
    for produced, mass in law.items():
        for tail in itertools.product(range(MC_VOCAB), repeat=total - len(produced)):
            full = produced + tail
            tail_mass = 1.0
            for i in range(len(produced), total):
                tail_mass *= pair.q(full[:i])[full[i]]
            completed[full] = completed.get(full, 0.0) + mass * tail_mass
    distance = 0.0
    for cell in itertools.product(range(MC_VOCAB), repeat=total):
        target = pair.sequence_probability(cell, "q")
        if target > 0:
            distance += (completed.get(cell, 0.0) - target) ** 2 / target
        elif completed.get(cell, 0.0) > 0:
            return float("inf")
    return MC_ROWS * distance


def run_mc(pair, method, seed):
    draft_set = pair.sample_draft_set(MC_ROWS, MC_DRAFTS, MC_LENGTH, torch.Generator().manual_seed(seed))
    out = select_sequences(
        *draft_set, call_uniforms(draft_set[0], range(seed, seed + MC_ROWS)), method=method, validate=False
    )
    return out, completed_sample(pair, out, MC_LENGTH + 1, torch.Generator().manual_seed(seed + 1))


def test_sequence_monte_carlo_follows_target_and_rejects_sorted_control(toy_pair_factory, monkeypatch):
    pair = toy_pair_factory(MC_VOCAB, MC_LENGTH, seed=1)
    # Precondition: the control's exact law is far from the target (noncentrality >> 100).
    control_law = exact_iteration_law(pair, sorted_kseq_law)
    exact_law = exact_iteration_law(pair, lambda d, a, p, q: token_output_distribution("spectr", d, a, p, q))
    mean_tokens = sum(len(s) * m for s, m in exact_law.items())

    out, tokens = run_mc(pair, "spectr", seed=40)
    assert chi_square_over_sequences(pair, tokens) > 1e-3
    # the number of tokens per call has the exact mean too (z-score of the sample mean)
    counts = out.num_tokens.to(torch.float64)
    z = (counts.mean() - mean_tokens) / (counts.std() / MC_ROWS**0.5)
    assert abs(float(z)) < norm.isf(1e-3 / 2)

    monkeypatch.setitem(selection.TOKEN_SELECTORS, "sorted_kseq", sorted_kseq_selector)
    _, control_tokens = run_mc(pair, "sorted_kseq", seed=40)
    assert chi_square_over_sequences(pair, control_tokens) < 1e-8
    assert noncentrality(pair, control_law) > 200
    assert noncentrality(pair, exact_law) < 1e-15


def test_sequence_monte_carlo_specinfer_follows_target(toy_pair_factory):
    pair = toy_pair_factory(MC_VOCAB, MC_LENGTH, seed=1)
    _, tokens = run_mc(pair, "specinfer", seed=41)
    assert chi_square_over_sequences(pair, tokens) > 1e-3


def test_uniforms_of_the_wrong_shape_or_dtype_are_refused():
    inputs = random_inputs(10, 3, 4, 6, seed=13)
    uniforms = call_uniforms(inputs[0], range(10))  # [B, L + 1, K + 1]
    with pytest.raises(ValueError, match=r"uniforms has shape \(10, 4, 4\), expected \[B, L \+ 1, K \+ 1\]"):
        select_sequences(*inputs, uniforms[:, :4])
    with pytest.raises(ValueError, match=r"uniforms must be float64"):
        select_sequences(*inputs, uniforms.float())


def test_float32_inputs_match_reference(toy_pair_factory):
    """The engine's float32 probabilities go through the same walk (float32-rounded values)."""
    pair = toy_pair_factory(3, 3, 7)
    draft_tokens, draft_probs, target_probs = pair.sample_draft_set(
        64, 3, 3, torch.Generator().manual_seed(7)
    )
    draft_probs, target_probs = draft_probs.float(), target_probs.float()
    for method in ("spectr", "specinfer"):
        batched = select_sequences(
            draft_tokens, draft_probs, target_probs, call_uniforms(draft_tokens, range(64)), method=method
        )
        reference = reference_select_sequences(
            draft_tokens, draft_probs, target_probs, call_uniforms(draft_tokens, range(64)), method=method
        )
        assert_same_selection(batched, reference)
