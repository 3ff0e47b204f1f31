"""Per-row engine features: per-row warps, target log-probabilities, shared prefill of identical prompts.

- Per-row warps: `row_warp_probs` equals `warp_probs` row by row (temperature, greedy, top-k with
  ties, top-p); rows of three warps (plain, truncated, greedy) share ONE batch and each group's
  first 3 tokens follow its own warped target law (chi-square against enumeration, as
  test_exactness_e2e); negative control: a pool warp that applies the first row's warp to every
  row is rejected by the same test.
- logprobs: per generated token, log q of the warped target law it was drawn from, equal to a
  plain full target forward within 2e-3 (every method, rows admitted mid-run and packed), and
  riding the retirement read-back (the host-sync counts do not change).
- Shared prefill: copies of a prompt admitted together run one prefill; their tokens are the
  same as when each is admitted alone.
"""

from __future__ import annotations

import pytest
import torch
from hf_tiny import exact_joint_distribution
from test_exactness_e2e import LENGTH, PROMPT, VOCAB, chi_square_pvalue

import spectr
from spectr.diagnostics import HostSyncCounter
from spectr.generate import Generation
from spectr.warps import RowWarps, SamplingWarp, row_warp_probs, warp_probs

ACCEPT_P = 1e-3
REJECT_P = 1e-6
GROUP_WARPS = [SamplingWarp(1.0, 0, 1.0), SamplingWarp(0.7, 4, 0.8), SamplingWarp(0.0, 0, 1.0)]
METHODS = ["autoregressive", "speculative", "spectr", "specinfer", "block"]


@pytest.fixture(scope="module")
def tiny_pair(e2e_pair):
    """The e2e pair (conftest)."""
    assert e2e_pair[0].config.vocab_size == VOCAB
    return e2e_pair



# --- per-row warps ------------------------------------------------------------------------------


def test_row_warp_probs_equal_the_scalar_warp_row_by_row():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 3, 50, generator=generator) * 3  # [R, T, V]
    logits[4, :, :5] = 2.5  # ties at the k-th value
    warps = [(1.0, 0, 1.0), (0.5, 5, 1.0), (1.3, 0, 0.9), (0.0, 0, 1.0), (0.8, 7, 0.7), (2.0, 50, 0.99)]
    temperature = torch.tensor([w[0] for w in warps])
    top_k = torch.tensor([w[1] for w in warps])
    top_p = torch.tensor([w[2] for w in warps])
    batched = row_warp_probs(logits, temperature, top_k, top_p)  # [R, T, V]
    for row, warp in enumerate(warps):
        torch.testing.assert_close(batched[row], warp_probs(logits[row], *warp), rtol=0, atol=1e-6)
    no_truncation = row_warp_probs(logits[:1], temperature[:1], top_k[:1], top_p[:1], truncate=(False, False))
    torch.testing.assert_close(no_truncation[0], warp_probs(logits[0], 1.0, 0, 1.0), rtol=0, atol=1e-6)


def test_a_bad_per_row_warp_names_the_row(tiny_pair):
    with pytest.raises(ValueError, match="prompt 1: top_p must be in"):
        spectr.generate(*tiny_pair, [PROMPT, PROMPT], top_p=[0.9, 1.5], max_new_tokens=2)
    with pytest.raises(ValueError, match="temperature has 1 entries but there are 2 prompts"):
        spectr.generate(*tiny_pair, [PROMPT, PROMPT], temperature=[0.5], max_new_tokens=2)


def mixed_batch(pair, method, num_drafts, draft_length, per_group, batch_size=None):
    """One batch whose rows cycle through GROUP_WARPS; returns each group's first-3-token samples."""
    count = per_group * len(GROUP_WARPS)
    warps = [GROUP_WARPS[i % len(GROUP_WARPS)] for i in range(count)]
    out = spectr.generate(*pair, [PROMPT] * count, method=method, num_drafts=num_drafts, draft_length=draft_length,
                          max_new_tokens=LENGTH, temperature=[w.temperature for w in warps],
                          top_k=[w.top_k for w in warps], top_p=[w.top_p for w in warps], seed=list(range(count)),
                          batch_size=batch_size)
    return [out.tokens[group::len(GROUP_WARPS)] for group in range(len(GROUP_WARPS))]


def follows(tokens: list[list[int]], law: torch.Tensor) -> float:
    """p-value of the chi-square test; a one-hot law (greedy) needs every sample on its one path."""
    if law.max() == 1:
        path = torch.tensor(tokens) @ torch.tensor([VOCAB * VOCAB, VOCAB, 1])  # [N] codes
        return 1.0 if bool((path == int(law.argmax())).all()) else 0.0
    return chi_square_pvalue(tokens, law)


@pytest.fixture(scope="module")
def group_laws(tiny_pair):
    return [exact_joint_distribution(tiny_pair[0], PROMPT, LENGTH, w).reshape(-1) for w in GROUP_WARPS]


@pytest.mark.parametrize("method,num_drafts,draft_length,batch_size", [
    ("spectr", 3, 2, None), ("autoregressive", 1, 1, None), ("block", 1, 3, 500), ("specinfer", 2, 2, None),
])
def test_rows_of_several_warps_in_one_batch_each_follow_their_own_law(tiny_pair, group_laws, method, num_drafts,
                                                                      draft_length, batch_size):
    groups = mixed_batch(tiny_pair, method, num_drafts, draft_length, 4000, batch_size)
    for tokens, law in zip(groups, group_laws):
        assert follows(tokens, law) > ACCEPT_P


def test_negative_control_one_warp_for_every_row_is_rejected(tiny_pair, group_laws, monkeypatch):
    """A pool warp that ignores the rows' own settings (every row gets the first row's warp)."""
    def first_rows_warp(self, logits, paths=None):
        rows = logits.shape[0]
        return row_warp_probs(logits, self.temperature[:1].expand(rows), self.top_k[:1].expand(rows),
                              self.top_p[:1].expand(rows), self.truncate)

    monkeypatch.setattr(RowWarps, "probs", first_rows_warp)
    groups = mixed_batch(tiny_pair, "spectr", 3, 2, 4000)
    assert follows(groups[0], group_laws[0]) > ACCEPT_P  # the first group's warp is the one applied
    assert follows(groups[1], group_laws[1]) < REJECT_P
    assert follows(groups[2], group_laws[2]) < REJECT_P


# --- logprobs -----------------------------------------------------------------------------------

PROMPTS = [[3, 17, 42, 8, 1], [9], [5, 6, 7, 8, 9, 10, 11, 12, 13], [60, 2], [3, 17, 42, 8, 1]]


def plain_logprobs(target, prompt, tokens, warp: SamplingWarp) -> list[float]:
    """log of the warped target law of each generated token, from one full forward (no cache)."""
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt + tokens]), use_cache=False).logits[0]  # [P + T, V]
    probs = warp.probs(logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)])  # [T, V]
    return probs.gather(1, torch.tensor(tokens)[:, None])[:, 0].log().tolist()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("batch_size", [None, 2], ids=["all at once", "admitted mid-run"])
def test_logprobs_equal_a_plain_target_forward(pair64, method, batch_size):
    warps = [SamplingWarp(), SamplingWarp(0.7, 10, 0.9), SamplingWarp(), SamplingWarp(1.2, 0, 0.95), SamplingWarp()]
    out = spectr.generate(*pair64, PROMPTS, method=method, num_drafts=3, draft_length=3,
                          max_new_tokens=[20, 9, 30, 14, 12], eos_token_id=[5, 6], seed=4, batch_size=batch_size,
                          temperature=[w.temperature for w in warps], top_k=[w.top_k for w in warps],
                          top_p=[w.top_p for w in warps], logprobs=True)
    for prompt, tokens, logprobs, warp in zip(PROMPTS, out.tokens, out.logprobs, warps):
        assert len(logprobs) == len(tokens) > 0
        expected = plain_logprobs(pair64[0], prompt, tokens, warp)
        assert max(abs(a - b) for a, b in zip(logprobs, expected)) < 2e-3
    plain = spectr.generate(*pair64, PROMPTS, method=method, num_drafts=3, draft_length=3,
                            max_new_tokens=[20, 9, 30, 14, 12], eos_token_id=[5, 6], seed=4, batch_size=batch_size,
                            temperature=[w.temperature for w in warps], top_k=[w.top_k for w in warps],
                            top_p=[w.top_p for w in warps])
    assert plain.tokens == out.tokens and plain.logprobs is None


@pytest.mark.parametrize("method", ["autoregressive", "spectr"])
def test_logprobs_and_row_warps_add_no_host_sync(pair64, method):
    """Same per-step host reads with and without logprobs / per-row warps (they ride the read-back)."""
    def per_step_syncs(**extra):
        generation = Generation(*pair64, PROMPTS, method=method, num_drafts=3, draft_length=3,
                                max_new_tokens=[20, 9, 30, 14, 12], eos_token_id=[5, 6], seed=4, batch_size=2, **extra)
        counts = []
        with torch.inference_mode():
            generation.start()
            while not generation.done:
                with HostSyncCounter().inside_module(pair64[0]).inside_module(pair64[1]) as syncs:
                    generation.step()
                counts.append(syncs.total)
            generation.finish()
        return counts, generation.tokens

    base, base_tokens = per_step_syncs(top_p=0.9)
    featured, featured_tokens = per_step_syncs(top_p=[0.9] * 5, logprobs=True)
    assert featured == base and featured_tokens == base_tokens
    extras, extras_tokens = per_step_syncs(top_p=0.9, logprobs="raw", top_logprobs=3, min_p=[0.0] * 5,
                                           logit_bias=[{1: 0.0}] * 5)  # a zero bias: the same law
    assert extras == base and extras_tokens == base_tokens


# --- shared prefill -----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["autoregressive", "spectr"])
def test_copies_of_a_prompt_share_one_prefill_and_keep_their_own_tokens(pair64, method):
    prompt, other = [3, 17, 42, 8, 1], [9, 4]
    kwargs = dict(method=method, num_drafts=2, draft_length=3, max_new_tokens=12, top_k=20)
    together = spectr.generate(*pair64, [prompt, other, prompt, prompt], seed=[1, 2, 3, 4], **kwargs)
    assert together.stats.prefilled_rows == 2 and together.stats.shared_prefill_rows == 2
    alone = [spectr.generate(*pair64, [p], seed=[s], **kwargs).tokens[0]
             for p, s in ((prompt, 1), (other, 2), (prompt, 3), (prompt, 4))]
    assert together.tokens == alone
    assert len({tuple(t) for t in together.tokens}) == 4  # independent samples


@pytest.mark.parametrize("method", ["autoregressive", "spectr", "block"])
def test_a_prompt_admitted_mid_run_copies_the_prompt_slots_of_a_live_row(pair64, method):
    """Two slots, six copies of a prompt with different budgets: every later copy joins while another copy
    is generating and takes that row's prompt slots; its tokens are the ones it gets alone."""
    prompt = [3, 17, 42, 8, 1, 7, 7]
    budgets = [4, 9, 3, 12, 5, 6]
    kwargs = dict(method=method, num_drafts=2, draft_length=3, top_p=0.9)
    out = spectr.generate(*pair64, [prompt] * 6, max_new_tokens=budgets, seed=list(range(6)), batch_size=2, **kwargs)
    assert out.stats.prefilled_rows == 1 and out.stats.shared_prefill_rows == 5
    for row in range(6):
        alone = spectr.generate(*pair64, [prompt], max_new_tokens=[budgets[row]], seed=[row], **kwargs)
        assert out.tokens[row] == alone.tokens[0]
