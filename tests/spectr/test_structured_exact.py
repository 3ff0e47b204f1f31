"""Structured outputs are exact under every method, by enumeration (no sampling; V = 4, float64).

The masks are the engine's own (`spectr.structured.RowGrammars` over llguidance, on a 4-token vocabulary `a`, `b`,
`ab`, EOS): at each node, the grammar's state after the row's committed tokens plus that node's path. A toy pair
gives a context-dependent draft law p and target law q at every path; both are masked at every node and renormalised.
For every draft set of K drafts of L tokens (drawn from the masked draft law along each draft's own path) the
reference oracle (`spectr.reference`) gives the exact law of one call's tokens; weighted by the draft set's
probability and completed with exact masked target sampling up to L + 1 tokens, it must equal the masked target's
law of L + 1 tokens within 1e-9, for speculative, block, spectr, specinfer and traversal, with a regex and a choice,
from the start and after a committed token (`RowGrammars.commit`).

Negative controls that the same comparison rejects: the mask computed from the committed tokens only (every node
gets the root's mask, not its own path's), and the target's law left unmasked where the draft's was masked.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from spectr.reference import (
    block_output_distribution,
    sequence_output_distribution,
    traversal_output_distribution,
)
from spectr.structured import RowGrammars, StructuredCompiler, parse_structured

EOS = 3
TOLERANCE = 1e-9
METHODS = [("speculative", 1, 2), ("block", 1, 2), ("spectr", 2, 2), ("specinfer", 2, 2), ("traversal", 2, 2)]
GRAMMARS = {"regex": {"regex": "(ab|b)+"}, "choice": {"choice": ["ab", "abb", "ba"]}}


class TinyTokenizer:
    """Four tokens: `a`, `b`, `ab` and EOS (llguidance's tokenizer wrapper protocol)."""

    eos_token_id = EOS
    bos_token_id = None
    tokens = [b"a", b"b", b"ab", b"<eos>"]
    special_token_ids = [EOS]

    def __call__(self, text):
        data = text if isinstance(text, bytes) else text.encode()
        return [self.tokens.index(bytes([c])) for c in data]


VOCAB = len(TinyTokenizer.tokens)


@pytest.fixture(scope="module")
def compiler():
    return StructuredCompiler(TinyTokenizer(), vocab_size=VOCAB)


def toy_law(path: tuple[int, ...], salt: str) -> list[float]:
    """A context-dependent law over the 4 tokens, fixed per (path, salt); some paths' laws have zeros."""
    rng = random.Random(f"{salt}:{path}")
    weights = [rng.random() ** 2 for _ in range(VOCAB)]
    if rng.random() < 0.2:
        weights[rng.randrange(VOCAB)] = 0.0
    if sum(weights) == 0:
        weights[0] = 1.0
    total = sum(weights)
    return [w / total for w in weights]


class MaskedPair:
    """p and q at every path (relative to the row's committed tokens), masked as the engine masks them.

    mask: "own" (each node's own path: the engine), "committed" (the root's mask everywhere: negative control);
    target_masked: False leaves q unmasked (negative control)."""

    def __init__(self, compiler, spec, committed=(), mask="own", target_masked=True):
        self.grammars = RowGrammars(1, VOCAB)
        self.grammars.set([0], [spec.with_compiler(compiler)], [[EOS]])
        if committed:  # the iteration's commit: the matcher advances by the kept tokens
            emitted = torch.tensor([list(committed)])
            self.grammars.commit(torch.tensor([0]), emitted, torch.tensor([len(committed)]))
        self.committed = tuple(committed)
        self.mask = mask
        self.target_masked = target_masked

    def _mask(self, path):
        node = () if self.mask == "committed" else tuple(path)
        mask = self.grammars._node_mask(0, node)
        return None if mask is None else mask.tolist()

    def _masked(self, law, path):
        mask = self._mask(path)
        if mask is None:
            return law
        kept = [x if m else 0.0 for x, m in zip(law, mask)]
        total = sum(kept)
        if total == 0:  # the toy law has no mass on the allowed tokens: the allowed tokens, uniformly
            kept = [1.0 if m else 0.0 for m in mask]
            total = sum(kept)
        return [x / total for x in kept]

    def p(self, path):
        return self._masked(toy_law(self.committed + tuple(path), "p"), path)

    def q(self, path, masked=None):
        law = toy_law(self.committed + tuple(path), "q")
        return self._masked(law, path) if (self.target_masked if masked is None else masked) else law

    def true_q(self, path):
        """The masked target law with each node's own mask: the law every method must reproduce."""
        law = toy_law(self.committed + tuple(path), "q")
        mask = self.grammars._node_mask(0, tuple(path))
        if mask is None:
            return law
        kept = [x if m else 0.0 for x, m in zip(law, mask.tolist())]
        total = sum(kept)
        if total == 0:
            kept = [1.0 if m else 0.0 for m in mask.tolist()]
            total = sum(kept)
        return [x / total for x in kept]


def call_law(pair: MaskedPair, method: str, num_drafts: int, draft_length: int) -> dict[tuple[int, ...], float]:
    """{tokens one call produces: probability}, summed over every draft set drawn from the masked draft law."""
    singles = {}
    for draft in itertools.product(range(VOCAB), repeat=draft_length):
        weight = math.prod(pair.p(draft[:i])[draft[i]] for i in range(draft_length))
        if weight > 0:
            singles[draft] = weight
    law: dict[tuple[int, ...], float] = {}
    for drafts in itertools.product(list(singles), repeat=num_drafts):
        weight = math.prod(singles[d] for d in drafts)
        draft_probs = [[pair.p(d[:i]) for i in range(draft_length)] for d in drafts]
        target_probs = [[pair.q(d[:i]) for i in range(draft_length + 1)] for d in drafts]
        if method == "block":
            outcomes = block_output_distribution(drafts[0], draft_probs[0], target_probs[0])
        elif method == "traversal":
            outcomes = traversal_output_distribution(drafts, draft_probs, target_probs)
        else:
            outcomes = sequence_output_distribution(method, drafts, draft_probs, target_probs)
        for produced, mass in outcomes.items():
            law[produced] = law.get(produced, 0.0) + weight * mass
    return law


def completed(pair: MaskedPair, law, total_length: int) -> dict[tuple[int, ...], float]:
    """Each produced sequence continued with exact masked target sampling up to `total_length` tokens."""
    out: dict[tuple[int, ...], float] = {}
    for produced, mass in law.items():
        for tail in itertools.product(range(VOCAB), repeat=total_length - len(produced)):
            full = produced + tail
            tail_mass = math.prod(pair.true_q(full[:i])[full[i]] for i in range(len(produced), total_length))
            if tail_mass > 0:
                out[full] = out.get(full, 0.0) + mass * tail_mass
    return out


def target_law(pair: MaskedPair, total_length: int) -> dict[tuple[int, ...], float]:
    out = {}
    for full in itertools.product(range(VOCAB), repeat=total_length):
        mass = math.prod(pair.true_q(full[:i])[full[i]] for i in range(total_length))
        if mass > 0:
            out[full] = mass
    return out


def max_error(pair: MaskedPair, method, num_drafts, draft_length) -> float:
    produced = completed(pair, call_law(pair, method, num_drafts, draft_length), draft_length + 1)
    exact = target_law(pair, draft_length + 1)
    return max(abs(produced.get(k, 0.0) - exact.get(k, 0.0)) for k in set(produced) | set(exact))


@pytest.mark.parametrize("grammar", sorted(GRAMMARS))
@pytest.mark.parametrize(("method", "num_drafts", "draft_length"), METHODS)
@pytest.mark.parametrize("committed", [(), (2,)], ids=["start", "after_ab"])
def test_every_method_reproduces_the_masked_target_law(compiler, grammar, method, num_drafts, draft_length,
                                                       committed):
    pair = MaskedPair(compiler, parse_structured(GRAMMARS[grammar]), committed)
    assert max_error(pair, method, num_drafts, draft_length) < TOLERANCE


def test_the_masks_matter_here(compiler):
    """The grammars refuse tokens at the root and deeper, allow EOS only where they accept, and the masks differ
    between nodes (so that the negative controls can fail)."""
    pair = MaskedPair(compiler, parse_structured(GRAMMARS["regex"]))
    root, after_b, after_a = (pair.grammars._node_mask(0, p).tolist() for p in ((), (1,), (0,)))
    assert root == [True, True, True, False]  # EOS refused: (ab|b)+ needs one "ab" or "b" ("a" then "b")
    assert after_b == [True, True, True, True]  # after "b": more, or the end
    assert after_a == [False, True, False, False]  # after "a": only "b"
    choice = MaskedPair(compiler, parse_structured(GRAMMARS["choice"]))
    assert choice.grammars._node_mask(0, (2,)).tolist() == [False, True, False, True]  # "ab": "abb", or the end
    assert choice.grammars._node_mask(0, (2, 1)).tolist() == [False, False, False, True]  # "abb": completed


@pytest.mark.parametrize(("method", "num_drafts", "draft_length"), METHODS)
@pytest.mark.parametrize("grammar", sorted(GRAMMARS))
def test_negative_control_a_mask_from_the_committed_tokens_only_is_rejected(compiler, grammar, method, num_drafts,
                                                                           draft_length):
    pair = MaskedPair(compiler, parse_structured(GRAMMARS[grammar]), mask="committed")
    assert max_error(pair, method, num_drafts, draft_length) > 1e-3


@pytest.mark.parametrize(("method", "num_drafts", "draft_length"), METHODS)
@pytest.mark.parametrize("grammar", sorted(GRAMMARS))
def test_negative_control_an_unmasked_target_law_is_rejected(compiler, grammar, method, num_drafts, draft_length):
    pair = MaskedPair(compiler, parse_structured(GRAMMARS[grammar]), target_masked=False)
    assert max_error(pair, method, num_drafts, draft_length) > 1e-3
