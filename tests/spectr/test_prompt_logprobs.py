"""vLLM's `prompt_logprobs` from the engine's prefill (`ContinuousBatcher.admit(prompt_logprobs=)`).

- Each prompt token's log-probability, rank and the top N at each position equal a plain HF forward's
  log_softmax over the whole prompt (first position None, as vLLM), for rows that ask, under every method,
  with rows admitted mid-run, copies of a prompt in the batch, a one-token prompt and a feature-free pair.
- Rows that do not ask pay nothing: their prefill keeps the last position's logits only (the forward that
  keeps every position holds only the rows that ask), and they come back with `prompt_logprobs` None.
- The law does not change: a row's tokens are the same with and without prompt_logprobs (same seed), so
  the exactness tests of the sampling law cover it unchanged.
"""

from __future__ import annotations

import pytest
import torch

from spectr import ContinuousBatcher
from spectr.rows import PromptLogprobs

PROMPTS = [[3, 17, 42, 8, 1], [9], [5, 6, 7, 8, 9, 10, 11, 12, 13], [60, 2], [3, 17, 42, 8, 1], [3, 17, 42, 8, 1]]
ASK = [2, 0, None, 5, 2, None]  # prompt 4 shares prompt 0's forward (same N); prompt 5 copies without asking
METHODS = ["autoregressive", "speculative", "spectr", "specinfer", "block", "traversal"]


def plain(target, prompt: list[int], top: int) -> tuple[list[float], list[int], list[torch.return_types.topk]]:
    """From one HF forward over the whole prompt: each token's log-probability and rank, and the top N."""
    with torch.no_grad():
        logp = target(input_ids=torch.tensor([prompt]), use_cache=False).logits[0].float().log_softmax(-1)
    chosen = [float(logp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    ranks = [int((logp[i] > logp[i, prompt[i + 1]]).sum()) + 1 for i in range(len(prompt) - 1)]
    tops = [logp[i].topk(top) for i in range(len(prompt) - 1)]
    return chosen, ranks, tops


def run(pair, method, batch_size, ask, seed=7):
    batcher = ContinuousBatcher(*pair, batch_size=batch_size, max_length=64, method=method, num_drafts=2,
                                draft_length=3, eos_token_id=[5])
    batcher.admit(PROMPTS, max_new_tokens=6, seed=seed, tags=list(range(len(PROMPTS))), prompt_logprobs=ask)
    return {row.tag: row for row in batcher.finished()}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("batch_size", [8, 2], ids=["all at once", "admitted mid-run"])
def test_prompt_logprobs_equal_a_plain_hf_forward(pair64, method, batch_size):
    rows = run(pair64, method, batch_size, ASK)
    for tag, (prompt, top) in enumerate(zip(PROMPTS, ASK)):
        got = rows[tag].prompt_logprobs
        if top is None:
            assert got is None
            continue
        assert isinstance(got, PromptLogprobs) and got.token_ids == prompt
        assert len(got.logprobs) == len(got.ranks) == len(got.top) == len(prompt)
        assert got.logprobs[0] is None and got.ranks[0] is None and got.top[0] == []  # vLLM's first position
        chosen, ranks, tops = plain(pair64[0], prompt, top)
        assert max((abs(a - b) for a, b in zip(got.logprobs[1:], chosen)), default=0.0) < 1e-4
        assert got.ranks[1:] == ranks
        for entries, expected in zip(got.top[1:], tops):
            assert [token for token, _ in entries] == expected.indices.tolist()
            torch.testing.assert_close(torch.tensor([value for _, value in entries]), expected.values, atol=1e-4,
                                       rtol=0)


def test_rows_that_do_not_ask_keep_only_the_last_logits(pair64, monkeypatch):
    """The forward that keeps every position's logits holds the asking rows only; the others' is last-only."""
    from spectr.hf import HFCausalLM

    calls = []
    forward = HFCausalLM.forward

    def spy(self, input_ids, *args, last_only=False, **kwargs):
        calls.append((self.role if hasattr(self, "role") else None, input_ids.shape[0], last_only))
        return forward(self, input_ids, *args, last_only=last_only, **kwargs)

    monkeypatch.setattr(HFCausalLM, "forward", spy)
    batcher = ContinuousBatcher(*pair64, batch_size=8, max_length=64, method="autoregressive", eos_token_id=[5])
    batcher.admit(PROMPTS, max_new_tokens=1, seed=1, prompt_logprobs=ASK)
    batcher.fill()
    full = [c for c in calls if not c[2]]
    assert [rows for _, rows, _ in full] == [3]  # prompts 0, 1 (one token: no position) and 3; 4 shares 0's
    calls.clear()
    plain_batcher = ContinuousBatcher(*pair64, batch_size=8, max_length=64, method="autoregressive", eos_token_id=[5])
    plain_batcher.admit(PROMPTS, max_new_tokens=1, seed=1)
    plain_batcher.fill()
    assert calls and all(last_only for _, _, last_only in calls)  # nobody asks: no full-prompt logits


@pytest.mark.parametrize("method", ["spectr", "block"])
def test_prompt_logprobs_do_not_change_the_tokens(pair64, method):
    asked = run(pair64, method, 3, ASK)
    unasked = run(pair64, method, 3, None)
    assert [asked[t].tokens for t in range(len(PROMPTS))] == [unasked[t].tokens for t in range(len(PROMPTS))]


def test_a_bad_prompt_logprobs_value_is_refused(pair64):
    batcher = ContinuousBatcher(*pair64, batch_size=2, max_length=64, method="autoregressive")
    with pytest.raises(ValueError, match="prompt_logprobs must be None or one int >= 0"):
        batcher.admit([[1, 2]], prompt_logprobs=[-1])
    with pytest.raises(ValueError, match="prompt_logprobs has 2 entries"):
        batcher.admit([[1, 2]], prompt_logprobs=[1, 1])


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_feature_draft_reads_the_prompts_of_both_prefill_forwards(e2e_pair, kind):
    """With a feature draft the asking rows' prefill and the others' are two target forwards, each giving the head
    its own features: the rows' tokens are the same as with one forward (nobody asking), copies included."""
    from test_feature_draft import make_head

    target = e2e_pair[0]
    head = make_head(target, kind)
    prompts = [[1, 2, 3, 4], [5, 6], [1, 2, 3, 4], [7, 1, 2, 3, 4, 5], [3]]
    ask = [1, None, None, 3, 0]

    def tokens(asked):
        batcher = ContinuousBatcher(target, head, batch_size=3, max_length=24, method="spectr", num_drafts=2,
                                    draft_length=2)
        batcher.admit(prompts, max_new_tokens=6, seed=5, tags=list(range(len(prompts))), prompt_logprobs=asked)
        rows = {row.tag: row for row in batcher.finished()}
        return [rows[t].tokens for t in range(len(prompts))], rows

    plain, _ = tokens(None)
    asked, rows = tokens(ask)
    assert asked == plain
    assert rows[0].prompt_logprobs is not None and rows[1].prompt_logprobs is None
