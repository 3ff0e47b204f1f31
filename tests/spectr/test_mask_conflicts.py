"""Masks that together leave a row no token (#50): a grammar against allowed_token_ids, bad words, min_tokens.

A row whose grammar, allowed_token_ids, bad words and min_tokens' stop mask allow no token at a context it kept a
token from (a law of all zeros, which softmax makes NaN) ends with `finish_reason="error"` and `EMPTY_LAW` as its
error, under every method, whether the conflict is at the row's committed state (the root) or below it (a node of
the draft tree the selection accepts into); a row of the same batch without a conflict is untouched, and every
kept token is in the vocabulary. On the CPU live rows are packed into the slots of finished ones: a finished row's
grammar error stays behind with it (it once passed to the row moved into its slot: row 2 here). The laws of rows without a conflict do not change (the
structured and bad-words exactness tests cover them, unchanged).
"""

from __future__ import annotations

import pytest
from test_structured import EOS, PROMPT, VOCAB, TinyTokenizer  # noqa: F401 - the tiny vocabulary

from spectr.batching import ContinuousBatcher
from spectr.structured import StructuredCompiler, parse_structured
from spectr.warps import EMPTY_LAW, SamplingWarp

METHODS = [("autoregressive", 1, 1), ("speculative", 1, 3), ("spectr", 2, 2), ("specinfer", 2, 2), ("block", 1, 3),
           ("traversal", 2, 2)]
A, B, C, X = 0, 1, 2, 5  # tokens "a", "b", "c", "x"


@pytest.fixture(scope="module")
def compiler():
    return StructuredCompiler(TinyTokenizer(), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def pair():
    from hf_tiny import tiny_model

    target = tiny_model(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, init_std=0.5,
                        seed=1)
    draft = tiny_model(vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, init_std=0.5,
                       seed=2)
    return target, draft


def rows_of(pair, compiler, method, num_drafts, draft_length, warps, budget=5):
    batcher = ContinuousBatcher(*pair, batch_size=len(warps), max_length=len(PROMPT) + budget, method=method,
                                num_drafts=num_drafts, draft_length=draft_length, eos_token_id=[EOS])
    batcher.admit([PROMPT] * len(warps), max_new_tokens=budget, seed=list(range(len(warps))), warps=warps)
    return sorted(batcher.finished(), key=lambda row: row.request)


@pytest.mark.parametrize("method,num_drafts,draft_length", METHODS)
def test_conflicting_masks_are_the_rows_error(pair, compiler, method, num_drafts, draft_length):
    at_root = parse_structured({"regex": "cx"}).with_compiler(compiler)  # only "c" first: not an allowed token
    below = parse_structured({"regex": "c(a|x)"}).with_compiler(compiler)  # after "c": "a" is bad, "x" not allowed
    fine = parse_structured({"regex": "(a|b)*"}).with_compiler(compiler)
    warps = [SamplingWarp(1.0, structured=at_root, allowed_token_ids=(A, B, EOS)),
             SamplingWarp(1.0, structured=below, allowed_token_ids=(A, C, EOS), bad_words=((A,),)),
             SamplingWarp(1.0, structured=fine, allowed_token_ids=(A, B, EOS)),
             SamplingWarp(1.0, allowed_token_ids=(A, B), bad_words=((A,), (B,))),  # nothing left, no grammar
             SamplingWarp(1.0, allowed_token_ids=(EOS, A), min_tokens=2)]  # "a" allowed: no conflict
    rows = rows_of(pair, compiler, method, num_drafts, draft_length, warps)
    for row in rows:
        assert all(0 <= t < VOCAB for t in row.tokens)
    for row in (rows[0], rows[1], rows[3]):
        assert row.finish_reason == "error" and EMPTY_LAW in row.error, (row.tokens, row.error)
    assert rows[1].tokens[0] == C  # the conflict is below the root: the row kept "c" first
    for row in (rows[2], rows[4]):
        assert row.error is None and row.finish_reason in ("eos", "length")
        assert set(row.tokens) <= {A, B, EOS}
    assert EOS not in rows[4].tokens[:2]  # min_tokens held the stop token back


def test_min_tokens_against_a_grammar_that_only_stops(pair, compiler):
    """The grammar has completed (only a stop token left) while min_tokens still holds the stop tokens back."""
    done = parse_structured({"regex": "c"}).with_compiler(compiler)
    rows = rows_of(pair, compiler, "spectr", 2, 2, [SamplingWarp(1.0, structured=done, min_tokens=3)])
    assert rows[0].finish_reason == "error" and EMPTY_LAW in rows[0].error
    assert rows[0].tokens[0] == C
