"""Bad inputs to the public selection entry points raise a ValueError naming the argument."""

from __future__ import annotations

import pytest
import torch

from spectr.selection import kseq_acceptance, kseq_rho, optimal_acceptance, select_tokens
from spectr.sequence import select_sequences

B, K, L, V = 3, 2, 2, 5


def good_sequence_inputs():
    g = torch.Generator().manual_seed(0)
    draft_probs = torch.rand(B, K, L, V, generator=g, dtype=torch.float64)
    target_probs = torch.rand(B, K, L + 1, V, generator=g, dtype=torch.float64)
    return {
        "draft_tokens": torch.randint(0, V, (B, K, L), generator=g),
        "draft_probs": draft_probs / draft_probs.sum(-1, keepdim=True),
        "target_probs": target_probs / target_probs.sum(-1, keepdim=True),
        "uniforms": torch.rand(B, L + 1, K + 1, generator=g, dtype=torch.float64),
    }


def call_sequences(method="spectr", **changes):
    inputs = good_sequence_inputs()
    inputs.update(changes)
    return select_sequences(**inputs, method=method)


def test_good_inputs_pass():
    call_sequences()


def corrupt(name, index, value):
    tensor = good_sequence_inputs()[name].clone()
    tensor[index] = value
    return {name: tensor}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (corrupt("draft_probs", (1, 0, 1, 2), float("nan")), r"draft_probs\[1, 0, 1, 2\] is nan"),
        (corrupt("target_probs", (2, 1, 2, 0), float("inf")), r"target_probs\[2, 1, 2, 0\] is inf"),
        (corrupt("draft_probs", (0, 1, 0, 3), -0.1), r"draft_probs\[0, 1, 0, 3\] = -0.1 is negative"),
        (corrupt("target_probs", (1, 1, 0, 4), 0.9), r"target_probs\[1, 1, 0\] sums to"),
        (corrupt("draft_tokens", (2, 0, 1), V), r"draft_tokens\[2, 0, 1\] = 5 is not a token id in \[0, 5\)"),
        (corrupt("draft_tokens", (0, 0, 0), -3), r"draft_tokens\[0, 0, 0\] = -3"),
        (
            {"target_probs": torch.full((B, K, L, V), 1.0 / V, dtype=torch.float64)},
            r"target_probs has shape .*L \+ 1",
        ),
        (
            {"draft_probs": torch.full((B, K, L, V + 1), 1.0 / (V + 1), dtype=torch.float64)},
            r"target_probs has shape",
        ),
        ({"draft_tokens": torch.zeros(B, 0, L, dtype=torch.int64)}, r"K >= 1"),
        ({"draft_tokens": torch.zeros(B, K, 0, dtype=torch.int64)}, r"L >= 1"),
        (
            {"draft_tokens": torch.zeros(B, K, dtype=torch.int64)},
            r"draft_tokens must be a \[B, K, L\] tensor",
        ),
        ({"draft_tokens": torch.zeros(B, K, L)}, r"draft_tokens must be an integer tensor"),
        ({"uniforms": torch.rand(B + 1, L + 1, K + 1, dtype=torch.float64)}, r"uniforms has shape"),
    ],
)
def test_sequence_entry_point_rejects_bad_numbers(changes, message):
    with pytest.raises(ValueError, match=message):
        call_sequences(**changes)


def test_unknown_method_and_speculative_with_many_drafts():
    with pytest.raises(ValueError, match=r"unknown selection method 'kseq2'"):
        call_sequences(method="kseq2")
    with pytest.raises(ValueError, match=r"'speculative' needs K = 1"):
        call_sequences(method="speculative")


def test_logits_instead_of_probabilities_are_refused():
    logits = torch.randn(B, K, L, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"draft_probs\[.*(negative|sums to)"):
        call_sequences(draft_probs=logits)


def good_token_inputs():
    p = torch.full((4, V), 1.0 / V, dtype=torch.float64)
    return [
        torch.zeros(4, 2, dtype=torch.int64),
        torch.ones(4, 2, dtype=torch.bool),
        p,
        p.clone(),
        torch.zeros(4, 3, dtype=torch.float64),
    ]


@pytest.mark.parametrize(
    ("position", "value", "message"),
    [
        (1, torch.ones(4, 3, dtype=torch.bool), r"alive has shape"),
        (1, torch.ones(4, 2, dtype=torch.int64), r"alive must be a bool tensor"),
        (3, torch.full((4, V + 1), 1.0 / (V + 1), dtype=torch.float64), r"target_probs has shape"),
        (4, torch.zeros(4, 3, dtype=torch.float32), r"uniforms must be float64"),
        (4, torch.ones(4, 3, dtype=torch.float64), r"uniforms\[0, 0\] = 1.0 is not in \[0, 1\)"),
        (4, torch.zeros(4, 2, dtype=torch.float64), r"uniforms has shape \(4, 2\), expected \[N, K \+ 1\]"),
        (0, torch.zeros(4, 0, dtype=torch.int64), r"K >= 1"),
    ],
)
def test_token_entry_point_rejects_bad_inputs(position, value, message):
    args = good_token_inputs()
    args[position] = value
    with pytest.raises(ValueError, match=message):
        select_tokens("spectr", *args)


@pytest.mark.parametrize("fn", [kseq_rho, kseq_acceptance, optimal_acceptance])
def test_contract_functions_reject_bad_inputs(fn):
    p = torch.full((3, V), 1.0 / V, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"num_drafts must be >= 1"):
        fn(p, p, 0)
    with pytest.raises(ValueError, match=r"num_drafts must be integer"):
        fn(p, p, 1.5)
    with pytest.raises(ValueError, match=r"must match"):
        fn(p, p[:, :4] / p[:, :4].sum(-1, keepdim=True), 2)
    with pytest.raises(ValueError, match=r"does not broadcast"):
        fn(p, p, torch.tensor([1, 2]))
    bad = p.clone()
    bad[2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"target_probs\[2, 1\] is nan"):
        fn(p, bad, 2)
