"""vLLM's min_p and logit_bias as sampling warps (`spectr.warps`), exact under speculative methods.

- The warps' definitions: min_p removes tokens whose probability (after temperature) is below min_p x the top
  token's (vLLM's `min_p`), logit_bias adds to the chosen logits before everything (greedy included); the per-row
  batched warp equals the single warp row by row.
- Exactness: rows of a batch with a min_p warp, and rows with a logit bias, each follow their own warped target law
  (chi-square of the first 3 tokens against enumeration, as test_exactness_e2e) under speculative, block and spectr.
  Negative control: the same runs with the warp applied to the draft only (the verify reads the unwarped target) are
  rejected by the same test, under each of the three methods.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hf_tiny import exact_joint_distribution
from test_exactness_e2e import LENGTH, PROMPT, VOCAB, chi_square_pvalue

from spectr.batching import ContinuousBatcher
from spectr.warps import SamplingWarp, row_warp_probs, warp_probs

ACCEPT_P = 1e-3
REJECT_P = 1e-6
SAMPLES = 3000
WARPS = {
    "min_p": SamplingWarp(1.0, 0, 1.0, min_p=0.3),
    "logit_bias": SamplingWarp(0.9, 0, 1.0, logit_bias=((2, 1.5), (5, -2.0), (7, 0.8))),
}
CASES = [("speculative", 1, 2), ("block", 1, 3), ("spectr", 3, 2)]


@pytest.fixture(scope="module")
def pair(e2e_pair):
    """The e2e pair (conftest)."""
    assert e2e_pair[0].config.vocab_size == VOCAB
    return e2e_pair


@pytest.fixture(scope="module")
def laws(pair):
    return {name: exact_joint_distribution(pair[0], PROMPT, LENGTH, warp).reshape(-1) for name, warp in WARPS.items()}


def test_min_p_is_vllms_rule_and_the_bias_comes_first():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]])
    probs = logits.softmax(-1)
    kept = warp_probs(logits, 1.0, 0, 1.0, min_p=0.3) > 0
    assert kept.tolist() == (probs >= 0.3 * probs.max()).tolist() == [[True, False, False, False, True]]
    assert warp_probs(logits, 1.0, 0, 1.0, min_p=1.0).argmax().item() == 4  # only the top token
    biased = SamplingWarp(0.0, logit_bias=((1, 5.0),)).probs(logits)  # greedy follows the biased logits
    assert biased.argmax().item() == 1
    with pytest.raises(ValueError, match="min_p must be in"):
        SamplingWarp(min_p=1.5)
    with pytest.raises(ValueError, match="logit_bias must map token ids"):
        SamplingWarp(logit_bias=(("a", 1.0),))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingWarp(logit_bias=((9, 1.0),)).probs(logits)


def test_row_warp_probs_with_min_p_and_bias_equal_the_single_warp_row_by_row():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 3, 20, generator=generator) * 3  # [R, T, V]
    warps = [SamplingWarp(1.0, 0, 1.0, 0.2), SamplingWarp(0.7, 5, 0.9, 0.05, ((3, 2.0),)), SamplingWarp(0.0),
             SamplingWarp(1.3, 0, 1.0, 0.0, ((0, -1.0), (19, 3.0)))]
    bias = torch.stack([torch.zeros(20) if not w.logit_bias else torch.zeros(20).index_put_(
        (torch.tensor([t for t, _ in w.logit_bias]),), torch.tensor([b for _, b in w.logit_bias])) for w in warps])
    batched = row_warp_probs(logits, torch.tensor([w.temperature for w in warps]), torch.tensor([w.top_k for w in warps]),
                             torch.tensor([w.top_p for w in warps]), min_p=torch.tensor([w.min_p for w in warps]),
                             bias=bias)
    for row, warp in enumerate(warps):
        torch.testing.assert_close(batched[row], warp.probs(logits[row]), rtol=1e-5, atol=1e-6)


def sample(pair, method, num_drafts, draft_length, warp, target_ignores_warp=False):
    """SAMPLES rows of PROMPT in one batcher, each with `warp` (per-row warps); their first LENGTH tokens."""
    batcher = ContinuousBatcher(*pair, batch_size=SAMPLES, max_length=len(PROMPT) + LENGTH, method=method,
                                num_drafts=num_drafts, draft_length=draft_length)
    batcher.admit([PROMPT] * SAMPLES, max_new_tokens=LENGTH, seed=list(range(SAMPLES)), warps=[warp] * SAMPLES)
    if target_ignores_warp:  # the negative control: the verify's law drops min_p and the bias; the draft keeps them
        batcher.fill()
        plain = copy.copy(batcher.row_warps)
        plain.uses_min_p, plain.bias, plain._pending_bias = False, None, {}
        batcher.loop.warp = plain
    rows = sorted(batcher.finished(), key=lambda row: row.request)
    return [row.tokens for row in rows]


@pytest.mark.parametrize("name", list(WARPS))
@pytest.mark.parametrize("method,num_drafts,draft_length", CASES)
def test_rows_with_min_p_or_a_logit_bias_follow_their_warped_target_law(pair, laws, name, method, num_drafts,
                                                                      draft_length):
    tokens = sample(pair, method, num_drafts, draft_length, WARPS[name])
    assert chi_square_pvalue(tokens, laws[name]) > ACCEPT_P


@pytest.mark.parametrize("name", list(WARPS))
@pytest.mark.parametrize("method,num_drafts,draft_length", CASES)
def test_negative_control_a_warp_on_the_draft_only_is_rejected(pair, laws, name, method, num_drafts, draft_length):
    tokens = sample(pair, method, num_drafts, draft_length, WARPS[name], target_ignores_warp=True)
    assert chi_square_pvalue(tokens, laws[name]) < REJECT_P


# --- raw log-probabilities and per-row stop tokens -------------------------------------------------------------


def raw_logprobs(target, prompt, tokens) -> list[float]:
    """log-softmax of the target's own logits at each generated token (one plain full forward)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = target(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1]  # [T, V]
    return logits.float().log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


@pytest.mark.parametrize("method", ["autoregressive", "speculative", "spectr", "block"])
@pytest.mark.parametrize("temperature,top_k", [(0.0, 0), (0.7, 5)])
def test_raw_logprobs_are_the_targets_log_softmax_whatever_the_warp(pair64, method, temperature, top_k):
    """logprobs="raw" (vLLM's default): the target's log-softmax at each token, not the warped law's (which reads
    0.0 for every greedy token); the same within 2e-3 as a plain full forward."""
    import spectr

    prompts = [[3, 17, 42, 8, 1], [9], [5, 6, 7, 8, 9, 10, 11]]
    out = spectr.generate(*pair64, prompts, method=method, num_drafts=2, draft_length=3, max_new_tokens=8,
                          temperature=temperature, top_k=top_k, logprobs="raw", seed=[1, 2, 3])
    for prompt, tokens, got in zip(prompts, out.tokens, out.logprobs):
        assert len(got) == len(tokens)
        assert max(abs(a - b) for a, b in zip(got, raw_logprobs(pair64[0], prompt, tokens))) < 2e-3
    if temperature == 0:
        warped = spectr.generate(*pair64, prompts, method=method, num_drafts=2, draft_length=3, max_new_tokens=8,
                                 temperature=0.0, logprobs=True, seed=[1, 2, 3])
        assert all(v == 0.0 for row in warped.logprobs for v in row)  # the processed law: one-hot
        assert any(v < -1e-3 for row in out.logprobs for v in row)


def test_rows_end_on_their_own_stop_tokens_or_run_their_budget(pair64):
    """stop_token_ids per row: None (the run's EOS), [] (none: vLLM's ignore_eos without stop tokens: the whole
    budget), or the row's own ids (it ends at the first one, the token included); the same tokens as the run
    without stops up to there."""
    target, draft = pair64
    free = ContinuousBatcher(target, draft, batch_size=1, max_length=40, method="spectr", num_drafts=2,
                             draft_length=3, temperature=0.0)
    free.admit([[3, 17, 42]], max_new_tokens=20, seed=0)
    path = next(iter(free.finished())).tokens
    eos, stop = path[4], path[9]
    batcher = ContinuousBatcher(target, draft, batch_size=3, max_length=40, method="spectr", num_drafts=2,
                                draft_length=3, temperature=0.0, eos_token_id=eos)
    batcher.admit([[3, 17, 42]] * 3, max_new_tokens=20, seed=0, stop_token_ids=[None, [], [stop]])
    rows = sorted(batcher.finished(), key=lambda row: row.request)
    assert rows[0].tokens == path[: path.index(eos) + 1] and rows[0].finish_reason == "eos"
    assert rows[1].tokens == path and rows[1].finish_reason == "length"
    assert rows[2].tokens == path[: path.index(stop) + 1] and rows[2].finish_reason == "eos"


@pytest.mark.parametrize("method", ["autoregressive", "speculative", "spectr"])
def test_top_logprobs_are_the_most_likely_tokens_of_the_law_each_token_followed(pair64, method):
    """top_logprobs=N: per token, the N most likely tokens of the raw target law at that position, equal (ids, and
    values within 2e-3) to a plain full forward's, most likely first; the token's own log-probability agrees."""
    import spectr

    prompts = [[3, 17, 42, 8, 1], [9]]
    out = spectr.generate(*pair64, prompts, method=method, num_drafts=2, draft_length=3, max_new_tokens=6,
                          temperature=0.8, logprobs="raw", top_logprobs=3, seed=[5, 6])
    target = pair64[0]
    for prompt, tokens, own, top in zip(prompts, out.tokens, out.logprobs, out.top_logprobs):
        with torch.no_grad():
            logits = target(input_ids=torch.tensor([prompt + tokens]), use_cache=False).logits[0]
        law = logits[len(prompt) - 1 : -1].float().log_softmax(-1)  # [T, V]
        assert len(top) == len(tokens)
        for t, entries in enumerate(top):
            values, ids = law[t].topk(3)
            assert [i for i, _ in entries] == ids.tolist()
            assert max(abs(v - w) for (_, v), w in zip(entries, values.tolist())) < 2e-3
            assert abs(own[t] - float(law[t, tokens[t]])) < 2e-3
