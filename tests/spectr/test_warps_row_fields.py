"""vLLM's row fields that touch the sampling law (issue 51, section 2), in the engine's warps.

- `allowed_token_ids`: exact under every method by enumeration (V = 4, float64, the engine's own `RowWarps.probs`
  on a toy pair's logits at every path; the reference oracle's law of one call, completed with exact target
  sampling, equals the restricted target law within 1e-9); negative control: the draft's law restricted but the
  target's left whole is rejected by the same comparison. On tiny HF models, sampled rows of every method hold
  allowed ids only and greedy rows equal the argmax over the allowed ids.
- `logit_bias`: clamped to [-100, 100] as vLLM's; an infinite bias is refused with its token named (it made every
  law NaN and a token was still sampled).
- `top_k=-1` is off, as vLLM's: the same tokens as `top_k=0`.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hf_tiny import tiny_model
from test_structured_exact import METHODS, call_law, completed, target_law

from spectr.generate import generate
from spectr.warps import RowWarps, SamplingWarp

VOCAB = 4
ALLOWED = (0, 2, 3)


def toy_logits(path, salt: str) -> torch.Tensor:
    rng = random.Random(f"{salt}:{path}")
    return torch.tensor([[rng.gauss(0.0, 1.5) for _ in range(VOCAB)]])  # [1, V]


class WarpedPair:
    """p and q at every path: the engine's `RowWarps.probs` of a toy pair's logits, for a row with `draft_warp` /
    `target_warp` (the true law: `target_warp`, the row's own)."""

    def __init__(self, draft_warp: SamplingWarp, target_warp: SamplingWarp):
        self.draft_warps, self.target_warps = RowWarps(1, SamplingWarp(), "cpu"), RowWarps(1, SamplingWarp(), "cpu")
        self.draft_warps.set(torch.tensor([0]), [draft_warp], [0])
        self.target_warps.set(torch.tensor([0]), [target_warp], [0])

    def p(self, path):
        return self._law(self.draft_warps, path, "p")

    def q(self, path):
        return self._law(self.target_warps, path, "q")

    @staticmethod
    def _law(warps, path, salt):
        """The warp's float32 law, renormalised in float64 (the oracle sums in float64)."""
        probs = warps.probs(toy_logits(tuple(path), salt))[0].double()
        return (probs / probs.sum()).tolist()

    true_q = q


def max_error(pair, method, num_drafts, draft_length) -> float:
    produced = completed(pair, call_law(pair, method, num_drafts, draft_length), draft_length + 1)
    exact = target_law(pair, draft_length + 1)
    return max(abs(produced.get(k, 0.0) - exact.get(k, 0.0)) for k in set(produced) | set(exact))


@pytest.mark.parametrize(("method", "num_drafts", "draft_length"), METHODS)
def test_allowed_token_ids_are_exact_under_every_method(method, num_drafts, draft_length):
    warp = SamplingWarp(0.9, allowed_token_ids=ALLOWED)
    pair = WarpedPair(warp, warp)
    assert max_error(pair, method, num_drafts, draft_length) < 1e-9
    assert all(pair.q(path)[1] == 0 for path in [(), (0,), (2, 3)])  # the refused token has no mass


@pytest.mark.parametrize(("method", "num_drafts", "draft_length"), METHODS)
def test_negative_control_a_target_left_unrestricted_is_rejected(method, num_drafts, draft_length):
    pair = WarpedPair(SamplingWarp(0.9, allowed_token_ids=ALLOWED), SamplingWarp(0.9))
    pair.true_q = WarpedPair(SamplingWarp(), SamplingWarp(0.9, allowed_token_ids=ALLOWED)).q
    assert max_error(pair, method, num_drafts, draft_length) > 1e-3


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(vocab_size=16, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, init_std=0.5,
                        seed=1)
    draft = tiny_model(vocab_size=16, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, init_std=0.5,
                       seed=2)
    return target, draft


CASES = [("autoregressive", 1, 1), ("speculative", 1, 3), ("block", 1, 3), ("spectr", 3, 2), ("specinfer", 3, 2),
         ("traversal", 3, 2)]
# the default suite runs block and spectr on the tiny models; every method under `slow` (the enumeration tests
# cover every method in the default suite)
GRID = [case if case[0] in ("block", "spectr") else pytest.param(*case, marks=pytest.mark.slow) for case in CASES]


@pytest.mark.parametrize(("method", "num_drafts", "draft_length"), GRID)
def test_rows_sample_only_their_allowed_tokens(pair, method, num_drafts, draft_length):
    allowed = [[1, 4, 9], None, [2, 3]]
    out = generate(pair[0], None if method == "autoregressive" else pair[1], [[1, 2], [3], [5, 6, 7]] * 4,
                   method=method, num_drafts=num_drafts, draft_length=draft_length, max_new_tokens=6, seed=5,
                   allowed_token_ids=allowed * 4)
    for row, tokens in enumerate(out.tokens):
        if allowed[row % 3] is not None:
            assert set(tokens) <= set(allowed[row % 3])
    assert any(set(tokens) - {1, 4, 9, 2, 3} for tokens in out.tokens[1::3])  # the unrestricted row is not


@torch.inference_mode()
def test_greedy_rows_take_the_argmax_over_the_allowed_tokens(pair):
    prompt, allowed = [1, 2, 3], [0, 5, 7, 11]
    out = generate(pair[0], pair[1], [prompt], method="spectr", num_drafts=2, draft_length=3, max_new_tokens=6,
                   temperature=0.0, allowed_token_ids=allowed)
    sequence = list(prompt)
    for _ in range(6):
        logits = pair[0](input_ids=torch.tensor([sequence]), use_cache=False).logits[0, -1]
        sequence.append(allowed[int(logits[allowed].argmax())])
    assert out.tokens[0] == sequence[len(prompt):]


def test_logit_bias_is_clamped_to_100_as_vllms():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    clamped = SamplingWarp(1.0, logit_bias=((0, 500.0), (1, -1e6))).probs(logits)
    assert torch.equal(clamped, SamplingWarp(1.0, logit_bias=((0, 100.0), (1, -100.0))).probs(logits))
    assert not torch.equal(clamped, SamplingWarp(1.0, logit_bias=((0, 99.0), (1, -100.0))).probs(logits))


def test_an_infinite_logit_bias_is_refused_naming_the_token(pair):
    for value in (math.inf, -math.inf):
        with pytest.raises(ValueError, match=r"logit_bias must be finite .* for token 3"):
            SamplingWarp(1.0, logit_bias=((3, value),))
        with pytest.raises(ValueError, match=r"prompt 0: logit_bias must be finite"):
            generate(pair[0], pair[1], [[1, 2]], max_new_tokens=2, logit_bias={3: value})


def test_top_k_minus_one_is_off(pair):
    runs = [generate(pair[0], pair[1], [[1, 2], [4]], method="spectr", num_drafts=2, draft_length=2,
                     max_new_tokens=6, seed=9, top_k=k).tokens for k in (-1, 0)]
    assert runs[0] == runs[1]
    assert generate(pair[0], pair[1], [[1, 2], [4]], method="spectr", num_drafts=2, draft_length=2,
                    max_new_tokens=6, seed=9, top_k=2).tokens != runs[0]  # top-k does change them (control)
    with pytest.raises(ValueError, match="top_k must be an int >= 0, or -1"):
        SamplingWarp(1.0, top_k=-2)
