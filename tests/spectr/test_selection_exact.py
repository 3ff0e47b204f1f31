"""Token-level exactness without sampling, and the closed forms of the contract functions.

The output law of each method is computed by walking its branches with their probabilities
(`spectr.reference.token_output_distribution`) and summing over every draft tuple, weighted
by its probability under p. It must equal q to 1e-9. Broken rules (drafts tested in sorted
order, every draft tested with the single-draft rule) must fail the same comparison.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy.optimize import linprog

from spectr.reference import token_output_distribution
from spectr.selection import (
    _beta,
    kseq_acceptance,
    kseq_rho,
    optimal_acceptance,
)


def dirichlet(generator: torch.Generator, vocab_size: int, concentration: float = 1.0) -> list[float]:
    """A random distribution (float64 list) from a seeded generator, no global RNG."""
    gamma = torch._standard_gamma(torch.full((vocab_size,), concentration, dtype=torch.float64), generator)
    return (gamma / gamma.sum()).tolist()


def token_cases(seed: int = 0) -> list[tuple[str, list[float], list[float]]]:
    """(name, p, q) pairs with V <= 5 covering the edge cases the issue names."""
    g = torch.Generator().manual_seed(seed)
    cases = [
        ("disjoint supports", [0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.3, 0.7]),
        ("identical", [0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4]),
        ("p zero where q positive", [0.6, 0.4, 0.0, 0.0, 0.0], [0.1, 0.2, 0.3, 0.2, 0.2]),
        ("q zero where p positive", [0.2, 0.2, 0.2, 0.2, 0.2], [0.0, 0.5, 0.0, 0.25, 0.25]),
        ("point masses", [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]),
        ("same point mass", [0.0, 1.0, 0.0], [0.0, 1.0, 0.0]),
    ]
    for i in range(6):
        vocab_size = 3 + i % 3
        cases.append((f"random {i}", dirichlet(g, vocab_size, 0.8), dirichlet(g, vocab_size, 0.8)))
    # Sparse random: zeros in both, overlapping supports.
    p = dirichlet(g, 5)
    q = dirichlet(g, 5)
    p[1] = p[4] = 0.0
    q[0] = q[4] = 0.0
    cases.append(("sparse random", [x / sum(p) for x in p], [x / sum(q) for x in q]))
    return cases


def enumerate_drafts(p: list[float], num_drafts: int):
    """Yield (draft tokens, probability) over all K-tuples of i.i.d. draws from p."""
    for drafts in itertools.product(range(len(p)), repeat=num_drafts):
        weight = math.prod(p[x] for x in drafts)
        if weight > 0:
            yield list(drafts), weight


METHODS_BY_K = {
    1: ["speculative", "spectr", "specinfer"],
    2: ["spectr", "specinfer"],
    3: ["spectr", "specinfer"],
}


def output_law(token_law, p, q, num_drafts, alive=None):
    """Sum over all draft tuples of P(drafts) * law(output | drafts); also P(accepted)."""
    alive = [True] * num_drafts if alive is None else alive
    law = [0.0] * len(p)
    acceptance = 0.0
    for drafts, weight in enumerate_drafts(p, num_drafts):
        conditional, accepted = token_law(drafts, alive, p, q)
        for token, mass in enumerate(conditional):
            law[token] += weight * mass
        acceptance += weight * accepted
    return law, acceptance


def method_law(method):
    return lambda drafts, alive, p, q: token_output_distribution(method, drafts, alive, p, q)


def sorted_kseq_law(drafts, alive, p, q):
    """Negative control: K-SEQ testing the drafts in token-id order instead of sampling order."""
    order = sorted(range(len(drafts)), key=lambda j: drafts[j])
    return token_output_distribution("spectr", [drafts[j] for j in order], [alive[j] for j in order], p, q)


def single_draft_rule_law(drafts, alive, p, q):
    """Negative control: each draft tested with min(1, q/p) (rho = 1) whatever K is."""
    vocab_size = len(p)
    law, reach = [0.0] * vocab_size, 1.0
    for x, is_alive in zip(drafts, alive):
        if is_alive:
            passes = 1.0 if p[x] == 0 else min(1.0, q[x] / p[x])
            law[x] += reach * passes
            reach *= 1.0 - passes
    residual = [max(0.0, b - a) for a, b in zip(p, q)]
    total = sum(residual) or 1.0
    return [w + reach * r / total for w, r in zip(law, residual)], 1.0 - reach


CASES = token_cases()


@pytest.mark.parametrize("num_drafts", [1, 2, 3])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_output_law_equals_target_exactly(case, num_drafts):
    _, p, q = case
    for method in METHODS_BY_K[num_drafts]:
        law, acceptance = output_law(method_law(method), p, q, num_drafts)
        assert max(abs(a - b) for a, b in zip(law, q)) < 1e-9, (method, law, q)
        if method in ("spectr", "speculative"):
            expected = kseq_acceptance(
                torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64), num_drafts
            )
            assert acceptance == pytest.approx(float(expected), abs=1e-9)


@pytest.mark.parametrize(
    "alive", [[True, False, True], [False, True, True], [False, False, True], [True, True, False]]
)
def test_output_law_with_dead_drafts_is_exact(alive):
    """Dead drafts are skipped and the alive count k (not K) sets rho*."""
    for name, p, q in CASES:
        for method in ("spectr", "specinfer"):
            law, _ = output_law(method_law(method), p, q, len(alive), alive=alive)
            assert max(abs(a - b) for a, b in zip(law, q)) < 1e-9, (name, method)


def test_no_alive_draft_samples_target():
    for _, p, q in CASES:
        for method in ("spectr", "specinfer"):
            law, accepted = token_output_distribution(method, [0, 0], [False, False], p, q)
            assert accepted == 0.0
            assert max(abs(a - b) for a, b in zip(law, q)) < 1e-15


@pytest.mark.parametrize(
    "broken", [sorted_kseq_law, single_draft_rule_law], ids=["sorted order", "single-draft rule"]
)
def test_enumeration_rejects_broken_rules(broken):
    """The same comparison fails for a broken rule on a generic case (so it can fail)."""
    p, q = [0.4, 0.1, 0.3, 0.2], [0.15, 0.3, 0.35, 0.2]
    law, _ = output_law(broken, p, q, 3)
    assert max(abs(a - b) for a, b in zip(law, q)) > 1e-2


# ---------------------------------------------------------------------------------------
# Closed forms of the contract functions
# ---------------------------------------------------------------------------------------


def random_pairs(count: int, vocab_size: int, seed: int, concentration: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    p = torch.tensor([dirichlet(g, vocab_size, concentration) for _ in range(count)], dtype=torch.float64)
    q = torch.tensor([dirichlet(g, vocab_size, concentration) for _ in range(count)], dtype=torch.float64)
    return p, q


def test_rho_is_one_for_a_single_draft():
    p, q = random_pairs(50, 7, seed=1)
    assert torch.equal(kseq_rho(p, q, 1), torch.ones(50, dtype=torch.float64))
    # and K-SEQ's acceptance is then speculative sampling's sum min(p, q)
    assert torch.allclose(kseq_acceptance(p, q, 1), torch.minimum(p, q).sum(-1), atol=1e-12, rtol=0)
    assert torch.allclose(optimal_acceptance(p, q, 1), torch.minimum(p, q).sum(-1), atol=1e-12, rtol=0)


@pytest.mark.parametrize("ratio", [1, 2, 3, 4, 6])
def test_uniform_on_subset_closed_form(ratio):
    """p uniform on d tokens, q uniform on d/r of them: acceptance 1 - (1 - 1/r)^K."""
    d = 12
    p = torch.full((d,), 1.0 / d, dtype=torch.float64)
    q = torch.zeros(d, dtype=torch.float64)
    q[: d // ratio] = ratio / d
    for num_drafts in range(1, 9):
        expected = 1.0 - (1.0 - 1.0 / ratio) ** num_drafts
        assert float(kseq_acceptance(p, q, num_drafts)) == pytest.approx(expected, abs=1e-12)
        assert float(optimal_acceptance(p, q, num_drafts)) == pytest.approx(expected, abs=1e-12)


def test_acceptance_at_rho_star_equals_sum_min_rho_p_q():
    p, q = random_pairs(200, 9, seed=2)
    num_drafts = torch.randint(2, 9, (200,), generator=torch.Generator().manual_seed(3))
    rho = kseq_rho(p, q, num_drafts)
    assert bool(((rho >= 1) & (rho <= num_drafts)).all())
    lhs = kseq_acceptance(p, q, num_drafts)
    rhs = torch.minimum(rho.unsqueeze(-1) * p, q).sum(-1)
    assert torch.allclose(lhs, rhs, atol=1e-12, rtol=0)
    # rho* sits on the valid side: 1 - (1 - beta)^k <= rho * beta.
    beta = _beta(p, q, rho)
    assert bool((1 - (1 - beta) ** num_drafts <= rho * beta + 1e-15).all())


def test_tensor_draft_counts_match_int_counts():
    p, q = random_pairs(30, 6, seed=4)
    counts = torch.arange(30) % 5 + 1
    for fn in (kseq_rho, kseq_acceptance, optimal_acceptance):
        batched = fn(p, q, counts)
        one_by_one = torch.stack([fn(p[i], q[i], int(counts[i])) for i in range(30)])
        assert torch.allclose(batched, one_by_one, atol=1e-15, rtol=0)
    # broadcasting over leading dims: [2, 15, V] with counts [15]
    assert fn(p.view(2, 15, 6), q.view(2, 15, 6), counts[:15]).shape == (2, 15)


def brute_force_optimal_acceptance(p, q, num_drafts):
    vocab_size = len(p)
    best = 1.0
    for size in range(vocab_size + 1):
        for subset in itertools.combinations(range(vocab_size), size):
            best = min(best, sum(q[x] for x in subset) + 1 - sum(p[x] for x in subset) ** num_drafts)
    return best


def transport_lp_acceptance(p, q, num_drafts):
    """max P(Y in {X_1..X_K}) over couplings of (X_1..X_K) i.i.d. p and Y ~ q, by scipy linprog."""
    vocab_size = len(p)
    tuples = list(itertools.product(range(vocab_size), repeat=num_drafts))
    num_vars = len(tuples) * vocab_size  # pi(x_tuple, y), index t * V + y
    gain = [-(1.0 if y in xs else 0.0) for xs in tuples for y in range(vocab_size)]
    rows, rhs = [], []
    for t, xs in enumerate(tuples):
        row = [0.0] * num_vars
        for y in range(vocab_size):
            row[t * vocab_size + y] = 1.0
        rows.append(row)
        rhs.append(math.prod(p[x] for x in xs))
    for y in range(vocab_size):
        row = [0.0] * num_vars
        for t in range(len(tuples)):
            row[t * vocab_size + y] = 1.0
        rows.append(row)
        rhs.append(q[y])
    result = linprog(gain, A_eq=rows, b_eq=rhs, bounds=(0, None), method="highs")
    assert result.status == 0
    return -result.fun


def test_optimal_acceptance_matches_brute_force_subsets():
    g = torch.Generator().manual_seed(5)
    cases = [(p, q) for _, p, q in CASES] + [(dirichlet(g, 6, 0.5), dirichlet(g, 6, 0.5)) for _ in range(20)]
    for p, q in cases:
        for num_drafts in (1, 2, 3, 5):
            got = float(
                optimal_acceptance(
                    torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64), num_drafts
                )
            )
            assert got == pytest.approx(brute_force_optimal_acceptance(p, q, num_drafts), abs=1e-12)


@pytest.mark.parametrize(("vocab_size", "num_drafts"), [(3, 2), (4, 2), (3, 3), (4, 3)])
def test_optimal_acceptance_matches_transport_lp(vocab_size, num_drafts):
    g = torch.Generator().manual_seed(6 + vocab_size * 10 + num_drafts)
    for _ in range(3):
        p, q = dirichlet(g, vocab_size, 0.6), dirichlet(g, vocab_size, 0.6)
        got = float(
            optimal_acceptance(
                torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64), num_drafts
            )
        )
        assert got == pytest.approx(transport_lp_acceptance(p, q, num_drafts), abs=1e-7)


def test_kseq_acceptance_within_one_minus_inverse_e_of_optimal():
    for seed, vocab_size, concentration in [(7, 5, 0.3), (8, 10, 1.0), (9, 50, 0.2)]:
        p, q = random_pairs(300, vocab_size, seed, concentration)
        for num_drafts in (2, 3, 4, 8, 16):
            kseq = kseq_acceptance(p, q, num_drafts)
            optimal = optimal_acceptance(p, q, num_drafts)
            assert bool((kseq >= (1 - 1 / math.e) * optimal - 1e-12).all())
            assert bool((kseq <= optimal + 1e-12).all())
            # more drafts never hurt
            assert bool((kseq_acceptance(p, q, num_drafts - 1) <= kseq + 1e-12).all())


def test_optimal_acceptance_is_one_iff_q_dominates_p_power():
    """alpha_K = 1 exactly when q(S) >= p(S)^K for every subset S."""
    g = torch.Generator().manual_seed(10)
    seen = set()
    for _ in range(60):
        p, q = dirichlet(g, 4, 1.0), dirichlet(g, 4, 3.0)
        for num_drafts in (2, 4, 8):
            dominated = all(
                sum(q[x] for x in s) >= sum(p[x] for x in s) ** num_drafts - 1e-12
                for size in range(5)
                for s in itertools.combinations(range(4), size)
            )
            alpha = float(
                optimal_acceptance(
                    torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64), num_drafts
                )
            )
            assert (alpha > 1 - 1e-12) == dominated
            seen.add(dominated)
    assert seen == {True, False}


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_batched_rho_matches_reference_bisection(dtype, tolerance):
    """The batched rho* (fused beta, dtype-aware stop) agrees with the plain-Python bisection.

    Compared through what rho* decides, the acceptance 1 - (1 - beta)^k: near p == q, f is
    flat to below float precision over a small interval, and any rho* there is as good.
    """
    from spectr.reference import reference_beta, reference_rho

    p, q = random_pairs(40, 7, seed=11)
    p[::4] = q[::4]  # identical rows
    p[1::8, :3] = 0.0  # p = 0 where q > 0
    p = p / p.sum(-1, keepdim=True)
    q[2::8] = torch.tensor([0, 0, 0, 0.25, 0.25, 0.25, 0.25], dtype=torch.float64)  # disjoint supports
    p[2::8] = torch.tensor([1 / 3, 1 / 3, 1 / 3, 0, 0, 0, 0], dtype=torch.float64)
    counts = torch.arange(40) % 7 + 1
    batched = kseq_rho(p.to(dtype), q.to(dtype), counts)
    for i in range(40):
        pi, qi, k = p[i].tolist(), q[i].tolist(), int(counts[i])
        expected_rho = reference_rho(pi, qi, k)
        beta_batched, beta_reference = (
            reference_beta(pi, qi, float(batched[i])),
            reference_beta(pi, qi, expected_rho),
        )
        acceptance = 1 - (1 - beta_batched) ** k
        assert acceptance == pytest.approx(1 - (1 - beta_reference) ** k, abs=tolerance)
        assert acceptance <= float(batched[i]) * beta_batched + tolerance  # the valid side
        assert 1.0 <= float(batched[i]) <= k
