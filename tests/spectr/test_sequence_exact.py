"""Sequence-level exactness by enumeration, no sampling (V = 3).

For every draft set of K drafts of length L drawn from a context-dependent toy draft model,
`spectr.reference.sequence_output_distribution` gives the exact law of the tokens one call
produces (walking the algorithm's branches with their probabilities). Weighted by the draft
set's probability and completed with exact target sampling up to L + 1 tokens, it must
equal the target model's law of L + 1 tokens to 1e-9. A run that switches method, K and L
between iterations (each iteration from the tokens committed so far) is composed the same
way and must equal the target's law of its first 4 tokens; a broken rule inside the schedule
and a switch that starts from a stale context (the newest token dropped) are rejected. The toy pair mixes random, identical,
disjoint and zero-probability distributions across prefixes.
"""

from __future__ import annotations

import itertools
import math

import pytest

from spectr.reference import sequence_output_distribution, token_output_distribution

VOCAB_SIZE = 3
SHAPES = [(1, 2), (2, 2), (3, 2), (2, 3)]


def iteration_law(pair, method, num_drafts, draft_length):
    """{produced tokens: probability} of one call, summed over all draft sets."""
    single_drafts = list(itertools.product(range(VOCAB_SIZE), repeat=draft_length))
    single_weight = {d: pair.sequence_probability(d, "p") for d in single_drafts}
    single_drafts = [d for d in single_drafts if single_weight[d] > 0]
    law: dict[tuple[int, ...], float] = {}
    for drafts in itertools.product(single_drafts, repeat=num_drafts):
        weight = math.prod(single_weight[d] for d in drafts)
        draft_probs, target_probs = pair.draft_inputs([list(d) for d in drafts])
        for produced, mass in sequence_output_distribution(method, drafts, draft_probs, target_probs).items():
            law[produced] = law.get(produced, 0.0) + weight * mass
    return law


def completed_law(pair, law, total_length):
    """Continue each produced sequence with exact target sampling up to total_length tokens."""
    out: dict[tuple[int, ...], float] = {}
    for produced, mass in law.items():
        missing = total_length - len(produced)
        for tail in itertools.product(range(VOCAB_SIZE), repeat=missing):
            full = produced + tail
            tail_mass = math.prod(pair.q(full[:i])[full[i]] for i in range(len(produced), total_length))
            out[full] = out.get(full, 0.0) + mass * tail_mass
    return out


def max_error_to_target(pair, law, total_length):
    completed = completed_law(pair, law, total_length)
    return max(
        abs(completed.get(w, 0.0) - pair.sequence_probability(w, "q"))
        for w in itertools.product(range(VOCAB_SIZE), repeat=total_length)
    )


@pytest.mark.parametrize(("num_drafts", "draft_length"), SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_sequence_law_equals_target_exactly(toy_pair_factory, num_drafts, draft_length, seed):
    pair = toy_pair_factory(VOCAB_SIZE, draft_length, seed)
    methods = ["speculative", "spectr", "specinfer"] if num_drafts == 1 else ["spectr", "specinfer"]
    for method in methods:
        law = iteration_law(pair, method, num_drafts, draft_length)
        assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
        assert all(1 <= len(s) <= draft_length + 1 for s in law)
        assert max_error_to_target(pair, law, draft_length + 1) < 1e-9, method


def sorted_kseq(drafts, alive, p, q):
    order = sorted(range(len(drafts)), key=lambda j: drafts[j])
    return token_output_distribution("spectr", [drafts[j] for j in order], [alive[j] for j in order], p, q)


def distinct_count_kseq(drafts, alive, p, q):
    """Broken: k counts distinct alive tokens instead of alive drafts (duplicates dropped)."""
    seen, keep = set(), []
    for x, a in zip(drafts, alive):
        keep.append(bool(a) and x not in seen)
        if a:
            seen.add(x)
    return token_output_distribution("spectr", drafts, keep, p, q)


@pytest.mark.parametrize("broken", [sorted_kseq, distinct_count_kseq], ids=["sorted order", "distinct count"])
def test_sequence_enumeration_rejects_broken_rules(toy_pair_factory, broken):
    pair = toy_pair_factory(VOCAB_SIZE, 2, seed=0)
    law = iteration_law(pair, broken, 3, 2)
    assert max_error_to_target(pair, law, 3) > 1e-3


# --- per-iteration configurations: a run switches method, K and L between iterations ----------------


class AfterPrefix:
    """The toy pair seen after a committed `prefix`: p and q of prefix + x (what an iteration drafts from)."""

    def __init__(self, pair, prefix: tuple[int, ...]):
        self.pair, self.prefix = pair, tuple(prefix)

    def p(self, tokens):
        return self.pair.p(self.prefix + tuple(tokens))

    def q(self, tokens):
        return self.pair.q(self.prefix + tuple(tokens))

    def sequence_probability(self, tokens, which: str) -> float:
        law = self.p if which == "p" else self.q
        return math.prod(law(tokens[:i])[t] for i, t in enumerate(tokens))

    def draft_inputs(self, drafts):
        draft_length = len(drafts[0])
        return ([[self.p(d[:i]) for i in range(draft_length)] for d in drafts],
                [[self.q(d[:i]) for i in range(draft_length + 1)] for d in drafts])


def schedule_law(pair, schedule, total_length, context=lambda produced: produced):
    """{first total_length tokens: probability} of a run whose iteration i uses schedule[i] =
    (method or broken rule, K, L); "autoregressive" samples one token from q. Each iteration starts
    from `context(produced)` (the committed tokens; a broken switch passes something else)."""
    law = {(): 1.0}
    for method, num_drafts, draft_length in schedule:
        after: dict[tuple[int, ...], float] = {}
        for produced, mass in law.items():
            if len(produced) >= total_length:
                after[produced] = after.get(produced, 0.0) + mass
                continue
            view = AfterPrefix(pair, context(produced))
            if method == "autoregressive":
                step = {(t,): q for t, q in enumerate(view.q(())) if q > 0}
            else:
                step = iteration_law(view, method, num_drafts, draft_length)
            for tokens, probability in step.items():
                key = (produced + tokens)[:total_length]
                after[key] = after.get(key, 0.0) + mass * probability
        law = after
    return law


SCHEDULES = [
    [("autoregressive", 1, 1), ("spectr", 2, 2), ("speculative", 1, 1)],
    [("specinfer", 2, 1), ("autoregressive", 1, 1), ("spectr", 3, 1), ("speculative", 1, 2)],
    [("speculative", 1, 2), ("spectr", 2, 1), ("autoregressive", 1, 1)],
]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: " > ".join(m for m, _, _ in s))
def test_a_run_switching_configurations_between_iterations_samples_the_target_exactly(toy_pair_factory, schedule):
    total = 4
    pair = toy_pair_factory(VOCAB_SIZE, total - 1 + max(length for _, _, length in schedule), 0)
    law = schedule_law(pair, schedule, total)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    assert max_error_to_target(pair, law, total) < 1e-9


@pytest.mark.parametrize("broken", ["rule", "stale context"])
def test_switching_enumeration_rejects_a_broken_rule_or_a_stale_context(toy_pair_factory, broken):
    """A switch must start the next iteration from every committed token: dropping the newest one (what a
    draft or target cache that missed the last iteration's tokens would do) changes the law."""
    schedule = [("autoregressive", 1, 1), ("spectr", 2, 2), ("speculative", 1, 1)]
    pair = toy_pair_factory(VOCAB_SIZE, 5, 0)
    if broken == "rule":
        law = schedule_law(pair, [("autoregressive", 1, 1), (distinct_count_kseq, 3, 1), ("speculative", 1, 1)], 4)
    else:
        law = schedule_law(pair, schedule, 4, context=lambda produced: produced[:-1])
    assert max_error_to_target(pair, law, 4) > 1e-3


@pytest.mark.parametrize("draft_length", [1, 2, 4])
def test_expected_tokens_per_call_single_draft_closed_form(draft_length):
    """K = 1, context-free p and q: E[tokens per call] = (1 - a^(L+1)) / (1 - a), a = sum min(p, q)."""
    p, q = [0.5, 0.3, 0.2], [0.2, 0.3, 0.5]
    alpha = sum(min(a, b) for a, b in zip(p, q))
    expected = (1 - alpha ** (draft_length + 1)) / (1 - alpha)
    mean_tokens = 0.0
    for draft in itertools.product(range(VOCAB_SIZE), repeat=draft_length):
        weight = math.prod(p[x] for x in draft)
        law = sequence_output_distribution(
            "spectr", [draft], [[p] * draft_length], [[q] * (draft_length + 1)]
        )
        mean_tokens += weight * sum(len(s) * m for s, m in law.items())
    assert mean_tokens == pytest.approx(expected, abs=1e-12)
