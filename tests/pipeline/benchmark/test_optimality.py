"""Token-level optimality numbers: exact SpecInfer acceptance against the real selector, and the orderings.

- `specinfer_acceptance_curve` is checked against Monte Carlo of `spectr.selection`'s own SpecInfer
  rule (the code the engine runs), with a negative control: the naive formula that forgets the
  residual update, 1 - (1 - Σ min(p, q))^K, must be rejected by the same test.
- K-SEQ <= optimum, SpecInfer <= optimum, and all three equal at K = 1, on random distributions.
"""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.benchmark.optimality import acceptance_table
from spectr.planner.acceptance import specinfer_acceptance, specinfer_acceptance_curve
from spectr.rng import sample_categorical
from spectr.selection import kseq_acceptance, optimal_acceptance, select_tokens


def random_pairs(n: int, vocab: int, seed: int, sharpness: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(sharpness * torch.randn(n, vocab, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(sharpness * torch.randn(n, vocab, generator=g, dtype=torch.float64), -1)
    return p, q


def monte_carlo_specinfer(p: torch.Tensor, q: torch.Tensor, num_drafts: int, samples: int, seed: int) -> float:
    """Fraction of nodes where the engine's SpecInfer rule accepts one of K i.i.d. drafts from p."""
    g = torch.Generator().manual_seed(seed)
    draft_p = p.expand(samples, -1).contiguous()  # [N, V]
    target_q = q.expand(samples, -1).contiguous()  # [N, V]
    draws = torch.rand(samples, num_drafts, generator=g, dtype=torch.float64)  # [N, K]
    drafts = sample_categorical(draft_p.unsqueeze(1).expand(-1, num_drafts, -1), draws)  # [N, K]
    uniforms = torch.rand(samples, num_drafts + 1, generator=g, dtype=torch.float64)  # [N, K + 1]
    alive = torch.ones(samples, num_drafts, dtype=torch.bool)
    _, accepted = select_tokens("specinfer", drafts, alive, draft_p, target_q, uniforms)
    return accepted.double().mean().item()


def z_score(observed: float, expected: float, samples: int) -> float:
    return (observed - expected) / math.sqrt(max(expected * (1 - expected), 1e-12) / samples)


@pytest.mark.parametrize("num_drafts", [2, 3])
def test_exact_specinfer_matches_the_engine_rule_and_the_naive_formula_does_not(num_drafts):
    p = torch.tensor([0.45, 0.30, 0.15, 0.05, 0.05], dtype=torch.float64)
    q = torch.tensor([0.05, 0.10, 0.15, 0.30, 0.40], dtype=torch.float64)
    samples = 40_000
    observed = monte_carlo_specinfer(p, q, num_drafts, samples, seed=num_drafts)
    exact = specinfer_acceptance(p, q, num_drafts).item()
    naive = 1 - (1 - torch.minimum(p, q).sum().item()) ** num_drafts  # negative control: no residual update
    assert abs(z_score(observed, exact, samples)) < 4.5, (observed, exact)
    assert abs(z_score(observed, naive, samples)) > 6, (observed, naive)


def test_specinfer_curve_edge_cases():
    p = torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float64)
    # q == p: accepted at once, for every K
    assert torch.allclose(specinfer_acceptance_curve(p, p.clone(), 4), torch.ones(1, 4, dtype=torch.float64))
    # disjoint supports: never accepted
    q = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    assert torch.equal(specinfer_acceptance_curve(p, q, 3), torch.zeros(1, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="max_drafts"):
        specinfer_acceptance_curve(p, q, 0)
    with pytest.raises(ValueError, match="shape"):
        specinfer_acceptance_curve(p, q[:, :2], 2)


def test_orderings_on_random_distributions():
    p, q = random_pairs(200, 12, seed=0)
    specinfer = specinfer_acceptance_curve(p, q, 6)  # [N, 6]
    for k in range(1, 7):
        kseq = kseq_acceptance(p, q, k)
        optimum = optimal_acceptance(p, q, k)
        assert bool((kseq <= optimum + 1e-9).all()), k
        assert bool((specinfer[:, k - 1] <= optimum + 1e-9).all()), k
        if k == 1:
            overlap = torch.minimum(p, q).sum(-1)
            assert torch.allclose(kseq, overlap, atol=1e-9)
            assert torch.allclose(specinfer[:, 0], overlap, atol=1e-12)
            assert torch.allclose(optimum, overlap, atol=1e-9)
    # more drafts never hurt either rule
    assert bool((specinfer[:, 1:] >= specinfer[:, :-1] - 1e-12).all())


def test_acceptance_table_means():
    p, q = random_pairs(50, 8, seed=1)
    rows = acceptance_table(p, q, 4)
    assert [row.num_drafts for row in rows] == [1, 2, 3, 4]
    assert rows[0].kseq == pytest.approx(rows[0].optimum) and rows[0].specinfer == pytest.approx(rows[0].optimum)
    for row in rows:
        assert row.kseq <= row.optimum + 1e-9 and row.specinfer <= row.optimum + 1e-9
        assert row.kseq == pytest.approx(kseq_acceptance(p, q, row.num_drafts).mean().item())
        assert row.kseq_stderr > 0


def test_float32_rows_are_renormalised_for_the_strict_checks():
    """Regression: float32 warped probabilities over 8192 tokens sum to 1 only within ~1e-6."""
    from spectr.planner.acceptance import as_float64_distribution

    off = torch.full((1, 8192), (1 - 3e-6) / 8192, dtype=torch.float32)  # sums to 1 - 3e-6
    with pytest.raises(ValueError, match="sums to"):
        kseq_acceptance(off.to(torch.float64), off.to(torch.float64), 2)  # the raw cast is refused
    fixed = as_float64_distribution(off)
    assert kseq_acceptance(fixed, fixed, 2).item() == pytest.approx(1.0)


def test_run_optimality_on_models_with_a_large_vocabulary():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "spectr"))
    from hf_tiny import tiny_model

    from pipeline.benchmark.optimality import run_optimality
    from spectr.planner.acceptance import collect_distributions
    from spectr.warps import SamplingWarp

    target = tiny_model(vocab_size=8192, hidden_size=16, num_layers=1, init_std=0.5, seed=1)
    draft = tiny_model(vocab_size=8192, hidden_size=16, num_layers=1, init_std=0.5, seed=2)
    prompts = [[5, 6, 7], [9, 10]]
    p, q = collect_distributions(target, draft, prompts, 4, SamplingWarp(1.0, 0, 1.0), seed=0)
    assert p.shape == q.shape == (8, 8192) and p.dtype == torch.float64
    assert torch.allclose(q.sum(-1), torch.ones(8, dtype=torch.float64), atol=1e-12)
    result = run_optimality(target, draft, prompts, 4, SamplingWarp(1.0, 0, 1.0), 0, max_drafts=3)
    assert result.num_positions == 8 and len(result.rows) == 3
