"""Fixtures for the selection tests: a toy context-dependent draft/target pair over a tiny
vocabulary (`toy_pair_factory`)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch


def dirichlet(generator: torch.Generator, vocab_size: int, concentration: float = 1.0) -> list[float]:
    """A random distribution (float64 list) from a seeded generator, no global RNG."""
    gamma = torch._standard_gamma(torch.full((vocab_size,), concentration, dtype=torch.float64), generator)
    return (gamma / gamma.sum()).tolist()


class ToyPair:
    """A draft/target pair whose next-token distributions depend on the whole prefix.

    Every prefix (a tuple of token ids, up to `max_length`) gets its own p and q, cycling
    through kinds: close, identical, disjoint supports, p = 0 where q > 0, sparse, independent.
    """

    def __init__(self, vocab_size: int, max_length: int, seed: int):
        self.vocab_size = vocab_size
        g = torch.Generator().manual_seed(seed)
        self._p: dict[tuple[int, ...], list[float]] = {}
        self._q: dict[tuple[int, ...], list[float]] = {}
        prefixes = [()]
        for length in range(1, max_length + 1):
            prefixes += list(itertools.product(range(vocab_size), repeat=length))
        for index, prefix in enumerate(prefixes):
            p = dirichlet(g, vocab_size, 0.7)
            q = dirichlet(g, vocab_size, 0.7)
            kind = index % 6
            if kind in (0, 3):  # close to p: drafts are often accepted
                q = [0.7 * a + 0.3 * b for a, b in zip(p, q)]
            if kind == 1:
                q = list(p)
            elif kind == 2:  # disjoint: p on the low half, q on the rest
                half = vocab_size // 2
                p = [x if t < half else 0.0 for t, x in enumerate(p)]
                q = [x if t >= half else 0.0 for t, x in enumerate(q)]
            elif kind == 3:  # p misses a token q likes
                p[prefix[-1] if prefix else 0] = 0.0
            elif kind == 4:  # both sparse
                p[(index + 1) % vocab_size] = 0.0
                q[index % vocab_size] = 0.0
            self._p[prefix] = [x / sum(p) for x in p]
            self._q[prefix] = [x / sum(q) for x in q]

    def p(self, prefix) -> list[float]:
        return self._p[tuple(prefix)]

    def q(self, prefix) -> list[float]:
        return self._q[tuple(prefix)]

    def sequence_probability(self, tokens, which: str) -> float:
        law = self.p if which == "p" else self.q
        return math.prod(law(tokens[:i])[t] for i, t in enumerate(tokens))

    def draft_inputs(self, drafts):
        """Per-draft distributions for a draft set: draft_probs [K][L][V], target_probs [K][L+1][V]."""
        draft_length = len(drafts[0])
        draft_probs = [[self.p(d[:i]) for i in range(draft_length)] for d in drafts]
        target_probs = [[self.q(d[:i]) for i in range(draft_length + 1)] for d in drafts]
        return draft_probs, target_probs

    def tables(self, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """p and q for every prefix up to max_length as [num_prefixes, V], by `prefix_index`."""
        prefixes = [()]
        for length in range(1, max_length + 1):
            prefixes += list(itertools.product(range(self.vocab_size), repeat=length))
        p = torch.tensor([self.p(x) for x in prefixes], dtype=torch.float64)
        q = torch.tensor([self.q(x) for x in prefixes], dtype=torch.float64)
        return p, q

    def prefix_index(self, tokens: torch.Tensor, length: int) -> torch.Tensor:
        """Row index into `tables` of the first `length` tokens of each row of tokens [N, >= length]."""
        offset = sum(self.vocab_size**i for i in range(length))
        code = torch.zeros(tokens.shape[0], dtype=torch.int64)
        for i in range(length):
            code = code * self.vocab_size + tokens[:, i]
        return code + offset

    def sample_draft_set(
        self, batch_size: int, num_drafts: int, draft_length: int, generator: torch.Generator
    ):
        """Batched draft sets drawn from p, with their distributions.

        Returns draft_tokens [B, K, L], draft_probs [B, K, L, V], target_probs [B, K, L + 1, V].
        """
        from spectr.rng import sample_categorical

        p_table, q_table = self.tables(draft_length)
        rows = batch_size * num_drafts
        drafts = torch.zeros(rows, draft_length, dtype=torch.int64)  # [B * K, L]
        for i in range(draft_length):
            node_p = p_table[self.prefix_index(drafts, i)]  # [B * K, V]
            drafts[:, i] = sample_categorical(
                node_p, torch.rand(rows, generator=generator, dtype=torch.float64)
            )
        draft_probs = torch.stack([p_table[self.prefix_index(drafts, i)] for i in range(draft_length)], 1)
        target_probs = torch.stack(
            [q_table[self.prefix_index(drafts, i)] for i in range(draft_length + 1)], 1
        )
        return (
            drafts.view(batch_size, num_drafts, draft_length),
            draft_probs.view(batch_size, num_drafts, draft_length, self.vocab_size),
            target_probs.view(batch_size, num_drafts, draft_length + 1, self.vocab_size),
        )


@pytest.fixture
def toy_pair_factory():
    """The ToyPair class (tests build pairs with their own vocabulary size and seed)."""
    return ToyPair


@pytest.fixture(scope="session")
def e2e_pair():
    """The end-to-end exactness tests' pair over 8 tokens: peaked, context-dependent random Llamas, so
    acceptance is far from 0 and from 1 (built once per session; no test changes their weights)."""
    from hf_tiny import tiny_model

    target = tiny_model(vocab_size=8, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, init_std=0.5, seed=1)
    draft = tiny_model(vocab_size=8, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, init_std=0.5, seed=2)
    return target, draft


@pytest.fixture(scope="session")
def pair64():
    """A 64-token random Llama and a noisy copy of it as the draft (the logprobs, warps and stop tests)."""
    from hf_tiny import noisy_copy, tiny_model

    target = tiny_model(vocab_size=64, init_std=0.2, seed=3, max_positions=128)
    return target, noisy_copy(target, noise_std=0.08, seed=4)
