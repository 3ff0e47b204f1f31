"""Monte-Carlo tests of the batched token-level selection (`spectr.selection.select_tokens`).

Drafts are sampled from p, the batched code selects one token per node, and a chi-square
test compares the counts with q. Each test also runs a deliberately broken rule through the
same code path and the same test, which must reject it: drafts tested in token-id order
instead of sampling order, or every draft tested with the single-draft rule (rho = 1).
Seeds are fixed, so the outcomes are deterministic.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare, norm

from spectr.reference import token_output_distribution
from spectr.rng import sample_categorical
from spectr.selection import _test_in_order_then_correct, kseq_acceptance, kseq_rho, select_tokens

NUM_SAMPLES = 200_000
PASS_P_VALUE = 1e-3  # the exact rule must not be rejected at this level
REJECT_P_VALUE = 1e-8  # a broken rule must be rejected at least this strongly

# A generic pair on which testing order matters a lot (checked exactly below).
DRAFT_PROBS = [0.4, 0.1, 0.3, 0.2]
TARGET_PROBS = [0.15, 0.3, 0.35, 0.2]


def chi_square_p_value(counts: torch.Tensor, expected_probs: list[float]) -> float:
    """p-value of counts [V] against expected_probs; 0 if a zero-probability token was produced."""
    expected = torch.tensor(expected_probs, dtype=torch.float64)
    if int(counts[expected == 0].sum()) > 0:
        return 0.0
    support = expected > 0
    if int(support.sum()) == 1:
        return 1.0  # a point mass, and every count is on it
    observed = counts[support].to(torch.float64)
    return float(chisquare(observed.numpy(), (expected[support] * observed.sum()).numpy()).pvalue)


def sample_nodes(p: list[float], q: list[float], num_drafts: int, seed: int, fixed_drafts=None):
    """N nodes with i.i.d. drafts from p (or the same fixed drafts), and selection uniforms."""
    g = torch.Generator().manual_seed(seed)
    vocab_size = len(p)
    draft_probs = torch.tensor(p, dtype=torch.float64).expand(NUM_SAMPLES, vocab_size)  # [N, V]
    target_probs = torch.tensor(q, dtype=torch.float64).expand(NUM_SAMPLES, vocab_size)  # [N, V]
    if fixed_drafts is None:
        draft_uniforms = torch.rand(NUM_SAMPLES, num_drafts, generator=g, dtype=torch.float64)  # [N, K]
        drafts = sample_categorical(
            draft_probs.unsqueeze(1).expand(-1, num_drafts, -1), draft_uniforms
        )  # [N, K]
    else:
        drafts = torch.tensor(fixed_drafts).expand(NUM_SAMPLES, num_drafts)  # [N, K]
    alive = torch.ones(NUM_SAMPLES, num_drafts, dtype=torch.bool)  # [N, K]
    uniforms = torch.rand(NUM_SAMPLES, num_drafts + 1, generator=g, dtype=torch.float64)  # [N, K + 1]
    return drafts, alive, draft_probs, target_probs, uniforms


def run_selector(selector, p, q, num_drafts, seed, fixed_drafts=None):
    drafts, alive, draft_probs, target_probs, uniforms = sample_nodes(p, q, num_drafts, seed, fixed_drafts)
    token, accepted = selector(drafts, alive, draft_probs, target_probs, uniforms)
    assert token.shape == (NUM_SAMPLES,) and accepted.dtype == torch.bool
    return torch.bincount(token, minlength=len(p)), accepted


def named(method):
    return lambda *args: select_tokens(method, *args)


def sorted_order(method):
    """Broken: the same batched method, with the drafts sorted by token id first."""

    def selector(drafts, alive, draft_probs, target_probs, uniforms):
        ordered, order = drafts.sort(dim=1, stable=True)
        return select_tokens(method, ordered, alive.gather(1, order), draft_probs, target_probs, uniforms)

    return selector


def single_draft_rule(drafts, alive, draft_probs, target_probs, uniforms):
    """Broken: each of the K drafts tested with min(1, q/p), residual norm(max(0, q - p))."""
    rho = torch.ones(drafts.shape[0], dtype=torch.float64)
    return _test_in_order_then_correct(drafts, alive, draft_probs, target_probs, uniforms, rho)


@pytest.mark.parametrize(
    ("method", "num_drafts", "seed"),
    [("speculative", 1, 11), ("spectr", 1, 12), ("spectr", 3, 13), ("spectr", 5, 14), ("specinfer", 3, 15)],
)
def test_batched_output_follows_target(method, num_drafts, seed):
    counts, accepted = run_selector(named(method), DRAFT_PROBS, TARGET_PROBS, num_drafts, seed)
    assert chi_square_p_value(counts, TARGET_PROBS) > PASS_P_VALUE
    if method != "specinfer":
        # the acceptance rate is K-SEQ's 1 - (1 - beta(rho*))^K (binomial z-score)
        rate = float(
            kseq_acceptance(
                torch.tensor(DRAFT_PROBS, dtype=torch.float64),
                torch.tensor(TARGET_PROBS, dtype=torch.float64),
                num_drafts,
            )
        )
        z = (accepted.double().mean().item() - rate) / (rate * (1 - rate) / NUM_SAMPLES) ** 0.5
        assert abs(z) < norm.isf(PASS_P_VALUE / 2)


@pytest.mark.parametrize(
    ("name", "selector", "num_drafts"),
    [
        ("spectr sorted", sorted_order("spectr"), 3),
        ("specinfer sorted", sorted_order("specinfer"), 3),
        ("single-draft rule", single_draft_rule, 3),
    ],
)
def test_same_test_rejects_broken_rules(name, selector, num_drafts):
    # The broken rule's exact law is far from q here, so rejection is not luck.
    counts, _ = run_selector(selector, DRAFT_PROBS, TARGET_PROBS, num_drafts, seed=21)
    assert chi_square_p_value(counts, TARGET_PROBS) < REJECT_P_VALUE, name


@pytest.mark.parametrize("method", ["spectr", "specinfer"])
@pytest.mark.parametrize("drafts", [[2, 0, 2], [0, 0, 0], [3, 0, 1]])
def test_conditional_law_given_drafts_matches_branch_probabilities(method, drafts):
    """For a fixed draft tuple (duplicates included), the batched output follows the exact
    branch-probability law of the algorithm; drafts in sorted order must be rejected when
    sorting changes the tuple."""
    expected, accept_probability = token_output_distribution(
        method, drafts, [True] * 3, DRAFT_PROBS, TARGET_PROBS
    )
    counts, accepted = run_selector(named(method), DRAFT_PROBS, TARGET_PROBS, 3, seed=31, fixed_drafts=drafts)
    assert chi_square_p_value(counts, expected) > PASS_P_VALUE
    z = (accepted.double().mean().item() - accept_probability) / max(
        (accept_probability * (1 - accept_probability) / NUM_SAMPLES) ** 0.5, 1e-12
    )
    assert abs(z) < norm.isf(PASS_P_VALUE / 2)
    if sorted(drafts) != drafts:
        counts, _ = run_selector(
            sorted_order(method), DRAFT_PROBS, TARGET_PROBS, 3, seed=31, fixed_drafts=drafts
        )
        assert chi_square_p_value(counts, expected) < REJECT_P_VALUE


def test_zero_probability_drafts_never_give_nan():
    """Drafts with p = 0: accepted when q > 0, rejected when q = 0, no NaN anywhere."""
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0]] * 4, dtype=torch.float64)  # [N, V]
    q = torch.tensor([[0.0, 0.2, 0.3, 0.5]] * 4, dtype=torch.float64)  # [N, V]
    drafts = torch.tensor([[3, 0], [0, 0], [0, 3], [0, 1]])  # token 3: p = 0 < q; token 0: p = q = 0
    alive = torch.ones(4, 2, dtype=torch.bool)
    uniforms = torch.full((4, 3), 0.999, dtype=torch.float64)
    for method in ("spectr", "specinfer"):
        token, accepted = select_tokens(method, drafts, alive, p, q, uniforms)
        assert int(token[0]) == 3 and int(token[2]) == 3
        assert accepted.tolist()[:3] == [True, False, True]
        assert bool((q.gather(1, token.unsqueeze(1)) > 0).all())  # never a zero-probability token
    for num_drafts in (1, 2, 4):
        rho = kseq_rho(p, q, num_drafts)
        assert bool(torch.isfinite(rho).all())
