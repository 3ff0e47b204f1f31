"""vLLM's `bad_words` (`spectr.bad_words`), exact under every method (issue 51, section 2).

- The meaning (vLLM's `apply_bad_words`): a word's last token is refused where the output so far ends with the
  rest of it (a one-token word everywhere), counted on the output tokens (not the prompt); the strings are
  tokenized as vLLM's `update_from_tokenizer` does (plain, and with a leading space when that differs).
- Exactness by enumeration (V = 4, float64, the engine's own `RowBadWords` masks at every path, after a committed
  token too): the law of one call, completed with exact target sampling, equals the target law with the bad words
  removed within 1e-9, for speculative, block, spectr, specinfer and traversal. Negative control: the mask of the
  committed tokens only (not each node's path) is rejected by the same comparison.
- On tiny HF models, no row of any method ever contains a bad word, and greedy rows equal a slow reference.
"""

from __future__ import annotations

import pytest
import torch
from hf_tiny import tiny_model
from test_structured_exact import METHODS, call_law, completed, target_law, toy_law

from spectr.bad_words import RowBadWords, bad_words_token_ids
from spectr.generate import generate
from spectr.penalties import NodePaths

WORDS = ((1,), (0, 2), (2, 3, 0))  # "b" never; "a" then "ab"; "ab", EOS-like 3, "a"


def row_with(words, committed=()):
    rows = RowBadWords(1, 4)
    rows.set([0], [words])
    if committed:
        rows.commit(torch.tensor([0]), torch.tensor([list(committed)]), torch.tensor([len(committed)]))
    return rows


def allowed_at(rows, path):
    paths = NodePaths(torch.tensor([[list(path)]]), torch.tensor([[len(path)]]))
    return rows.allowed(paths, 1, "cpu")[0, 0].tolist()


def test_a_words_last_token_is_refused_where_the_output_ends_with_the_rest():
    rows = row_with(WORDS)
    assert allowed_at(rows, ()) == [True, False, True, True]  # only the one-token word at the start
    assert allowed_at(rows, (0,)) == [True, False, False, True]  # after "a": not "ab" (word (0, 2))
    assert allowed_at(rows, (2, 3)) == [False, False, True, True]  # after "ab", 3: not "a" (word (2, 3, 0))
    assert allowed_at(row_with(WORDS, committed=(2,)), (3,)) == [False, False, True, True]  # committed + path
    assert row_with(()).rows[0] is None


class Tokenizer:
    vocab = {"hello": 5, " hello": 6, "bad": 7, " bad": 7, "two words": 8, " two words": 9}

    def encode(self, text, add_special_tokens=False):
        assert add_special_tokens is False
        return [self.vocab[text]] if text in self.vocab else [1, 2]


def test_strings_are_tokenized_as_vllm_does():
    assert bad_words_token_ids(["hello", "  bad", "zz"], Tokenizer()) == ((5,), (6,), (7,), (1, 2))


class BadWordsPair:
    """p and q at every path (after `committed`), with the bad words' masks: each node's own path, or (negative
    control) the committed tokens only."""

    def __init__(self, committed=(), own_path=True):
        self.rows = row_with(WORDS, committed)
        self.committed, self.own_path = tuple(committed), own_path

    def _masked(self, law, path):
        mask = allowed_at(self.rows, path if self.own_path else ())
        kept = [x if m else 0.0 for x, m in zip(law, mask)]
        return [x / sum(kept) for x in kept] if sum(kept) else [float(m) / sum(mask) for m in mask]

    def p(self, path):
        return self._masked(toy_law(self.committed + tuple(path), "p"), path)

    def q(self, path):
        return self._masked(toy_law(self.committed + tuple(path), "q"), path)

    def true_q(self, path):
        own = BadWordsPair.__new__(BadWordsPair)
        own.rows, own.committed, own.own_path = self.rows, self.committed, True
        return own.q(path)


def max_error(pair, method, num_drafts, draft_length) -> float:
    produced = completed(pair, call_law(pair, method, num_drafts, draft_length), draft_length + 1)
    exact = target_law(pair, draft_length + 1)
    return max(abs(produced.get(k, 0.0) - exact.get(k, 0.0)) for k in set(produced) | set(exact))


@pytest.mark.parametrize(("method", "num_drafts", "draft_length"), METHODS)
@pytest.mark.parametrize("committed", [(), (2,)], ids=["start", "after_ab"])
def test_bad_words_are_exact_under_every_method(method, num_drafts, draft_length, committed):
    assert max_error(BadWordsPair(committed), method, num_drafts, draft_length) < 1e-9


@pytest.mark.parametrize(("method", "num_drafts", "draft_length"), METHODS)
def test_negative_control_bad_words_of_the_committed_tokens_only_are_rejected(method, num_drafts, draft_length):
    assert max_error(BadWordsPair(own_path=False), method, num_drafts, draft_length) > 1e-3


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(vocab_size=8, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, init_std=0.5,
                        seed=1)
    draft = tiny_model(vocab_size=8, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, init_std=0.5,
                       seed=2)
    return target, draft


BAD = [[3], [0, 4], [2, 7, 0]]
CASES = [("autoregressive", 1, 1), ("speculative", 1, 3), ("block", 1, 3), ("spectr", 3, 2), ("specinfer", 3, 2),
         ("traversal", 3, 2)]
# the default suite runs block and spectr on the tiny models; every method under `slow` (the enumeration tests
# cover every method in the default suite)
GRID = [case if case[0] in ("block", "spectr") else pytest.param(*case, marks=pytest.mark.slow) for case in CASES]


def contains(tokens, word):
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens)))


@pytest.mark.parametrize(("method", "num_drafts", "draft_length"), GRID)
def test_no_row_ever_holds_a_bad_word(pair, method, num_drafts, draft_length):
    prompts = [[0, 4, 3], [1], [2, 7]] * 8  # the prompt may hold them: only the output counts
    out = generate(pair[0], None if method == "autoregressive" else pair[1], prompts, method=method,
                   num_drafts=num_drafts, draft_length=draft_length, max_new_tokens=16, seed=2,
                   bad_words=[BAD if i % 2 == 0 else None for i in range(len(prompts))])
    for row, tokens in enumerate(out.tokens):
        if row % 2 == 0:
            assert not any(contains(tokens, word) for word in BAD), tokens
    assert any(contains(tokens, word) for tokens in out.tokens[1::2] for word in BAD)  # the others may (control)


@torch.inference_mode()
def test_greedy_rows_equal_a_slow_reference(pair):
    prompt = [1, 2, 3]
    out = generate(pair[0], pair[1], [prompt], method="spectr", num_drafts=2, draft_length=3, max_new_tokens=10,
                   temperature=0.0, bad_words=BAD)
    output: list[int] = []
    for _ in range(10):
        logits = pair[0](input_ids=torch.tensor([prompt + output]), use_cache=False).logits[0, -1].clone()
        for word in BAD:
            if len(word) == 1 or output[len(output) - len(word) + 1:] == word[:-1]:
                logits[word[-1]] = -float("inf")
        output.append(int(logits.argmax()))
    assert out.tokens[0] == output
