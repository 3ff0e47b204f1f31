"""spectr.generate: input checks, seeds, batch independence, EOS/length handling and statistics."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import hf_greedy, noisy_copy, tiny_model

import spectr

METHODS = ["autoregressive", "speculative", "spectr", "specinfer", "block"]
PROMPTS = [[3, 17, 42, 8, 1], [9], [5, 6, 7, 8, 9, 10, 11, 12, 13], [60, 2]]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(vocab_size=64, init_std=0.2, seed=3, max_positions=64)
    return target, noisy_copy(target, noise_std=0.08, seed=4)


@pytest.fixture(scope="module")
def pair64():
    """float64 models: batched kernels differ by ~1e-16, so sampled outputs cannot depend on the batch."""
    target = tiny_model(vocab_size=64, init_std=0.2, seed=3, dtype=torch.float64)
    return target, noisy_copy(target, noise_std=0.08, seed=4)


# --- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompts,kwargs,message",
    [
        ([[1, 2], []], {}, r"prompt 1 is empty"),
        ([[1, 2], [3, 64, 5]], {}, r"prompt 1 has token id 64 outside the target vocabulary \[0, 64\)"),
        ([[1, -2]], {}, r"prompt 0 has token id -2 outside"),
        ([[1, 2.5]], {}, r"prompt 0 has a non-integer token 2.5 at position 1"),
        ([[1], [1] * 60], dict(max_new_tokens=10), r"prompt 1: 60 prompt tokens \+ max_new_tokens 10 = 70 exceeds "
                                                   r"the target model's 64 positions"),
        ([[1]], dict(num_drafts=0), r"num_drafts must be an int >= 1"),
        ([[1]], dict(draft_length=0), r"draft_length must be an int >= 1"),
        ([[1]], dict(method="beam"), r"unknown method 'beam'"),
        ([[1]], dict(temperature=-1.0), r"temperature"),
        ([[1]], dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        ([[1]], dict(top_p=1.01), r"top_p must be in \(0, 1\]"),
        ([[1]], dict(top_k=-3), r"top_k"),
        ([[1]], dict(max_new_tokens=-1), r"max_new_tokens must be an int >= 1"),
        ([[1]], dict(max_new_tokens=0), r"max_new_tokens must be an int >= 1"),
        ([[1], [2], [3]], dict(max_new_tokens=[4, 4, 0]), r"max_new_tokens\[2\] \(prompt 2\) must be an int >= 1, got 0"),
        ([[1], [2]], dict(max_new_tokens=[4, 2.5]), r"max_new_tokens\[1\] \(prompt 1\) must be an int >= 1, got 2.5"),
        ([[1], [2]], dict(max_new_tokens=[4, True]), r"max_new_tokens\[1\] \(prompt 1\) must be an int >= 1"),
        ([[1], [2]], dict(max_new_tokens=[4]), r"max_new_tokens has 1 entries but there are 2 prompts"),
        ([[1], [2]], dict(max_new_tokens="4"), r"max_new_tokens must be an int >= 1"),
        ([[1], [2]], dict(seed=[1, "x"]), r"seed\[1\] \(prompt 1\) must be an int, got 'x'"),
        ([[1], [2]], dict(batch_size=0), r"batch_size must be None or an int >= 1, got 0"),
        ([[1], [2]], dict(batch_size=1.5), r"batch_size must be None or an int >= 1, got 1.5"),
        ([[1], [2]], dict(batch_size=True), r"batch_size must be None or an int >= 1, got True"),
        ([[1], [2]], dict(seed=[1]), r"seed has 1 entries but there are 2 prompts"),
        ([[1]], dict(eos_token_id="x"), r"eos_token_id"),
        ("hello", {}, r"prompts must be a list"),
    ],
)
def test_bad_input_raises_value_error_naming_what_and_where(pair, prompts, kwargs, message):
    target, draft = pair
    with pytest.raises(ValueError, match=message):
        spectr.generate(target, draft, prompts, **({"max_new_tokens": 4} | kwargs))


def test_prompt_too_long_for_the_draft_is_named():
    target = tiny_model(vocab_size=64, max_positions=128)
    draft = tiny_model(vocab_size=64, max_positions=16, seed=1)
    with pytest.raises(ValueError, match=r"prompt 0: .* exceeds the draft model's 16 positions"):
        spectr.generate(target, draft, [[1] * 10], max_new_tokens=10)
    spectr.generate(target, draft, [[1] * 10], method="autoregressive", max_new_tokens=10)  # draft unused


def test_speculative_methods_need_a_draft(pair):
    with pytest.raises(ValueError, match="needs a draft model"):
        spectr.generate(pair[0], None, [[1]], method="spectr")


def test_empty_prompt_list_gives_empty_output(pair):
    out = spectr.generate(*pair, [], method="spectr")
    assert out.tokens == [] and out.stats.generated_tokens == [] and out.stats.block_efficiency == 0.0


# --- seeds and batch independence -------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_same_inputs_and_seed_give_identical_output(pair, method):
    kwargs = dict(method=method, num_drafts=3, draft_length=3, max_new_tokens=15, seed=123)
    first = spectr.generate(*pair, PROMPTS, **kwargs)
    assert first.tokens == spectr.generate(*pair, PROMPTS, **kwargs).tokens
    other = spectr.generate(*pair, PROMPTS, **(kwargs | {"seed": 124}))
    assert other.tokens != first.tokens


@pytest.mark.parametrize("method", METHODS)
def test_a_rows_output_does_not_depend_on_its_batch_companions(pair64, method):
    kwargs = dict(method=method, num_drafts=3, draft_length=2, max_new_tokens=20, top_p=0.95)
    together = spectr.generate(*pair64, PROMPTS, seed=[10, 11, 12, 13], **kwargs).tokens
    alone = spectr.generate(*pair64, [PROMPTS[2]], seed=[12], **kwargs).tokens
    shuffled = spectr.generate(*pair64, [PROMPTS[3], PROMPTS[2], [1] * 30], seed=[13, 12, 99], **kwargs).tokens
    assert alone[0] == together[2] == shuffled[1]
    assert shuffled[0] == together[3]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_rows_alone_equal_rows_in_a_batch(pair, method):
    kwargs = dict(method=method, num_drafts=2, draft_length=3, max_new_tokens=10, temperature=0.0)
    together = spectr.generate(*pair, PROMPTS, **kwargs).tokens
    assert together == [spectr.generate(*pair, [p], **kwargs).tokens[0] for p in PROMPTS]
    assert together == [hf_greedy(pair[0], p, 10) for p in PROMPTS]


# --- EOS, length, statistics ------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_eos_cuts_each_row_after_its_first_eos(pair64, method):
    kwargs = dict(method=method, num_drafts=2, draft_length=4, max_new_tokens=24, seed=[1, 2, 3, 4])
    free = spectr.generate(*pair64, PROMPTS, **kwargs)
    assert free.stats.finish_reason == ["length"] * 4 and all(len(t) == 24 for t in free.tokens)
    # the most common token among positions 1.. makes rows stop at different places (some never)
    counts = torch.bincount(torch.tensor([t for row in free.tokens for t in row[1:]]), minlength=64)
    eos = int(counts.argmax())
    cut = spectr.generate(*pair64, PROMPTS, eos_token_id=[eos], **kwargs)
    for row, tokens in enumerate(free.tokens):
        if eos in tokens:
            expected = tokens[: tokens.index(eos) + 1]
            assert cut.stats.finish_reason[row] == "eos"
        else:
            expected = tokens
            assert cut.stats.finish_reason[row] == "length"
        assert cut.tokens[row] == expected
        assert cut.stats.generated_tokens[row] == len(expected)
    assert "eos" in cut.stats.finish_reason


@pytest.mark.parametrize("method", METHODS)
def test_statistics_are_consistent(pair, method):
    out = spectr.generate(*pair, PROMPTS, method=method, num_drafts=3, draft_length=3, max_new_tokens=17,
                          eos_token_id=5, seed=7)
    stats = out.stats
    assert stats.generated_tokens == [len(t) for t in out.tokens]
    histogram = stats.tokens_per_call_histogram
    assert sum(n * count for n, count in enumerate(histogram)) == sum(stats.generated_tokens)
    assert sum(histogram) == sum(stats.target_calls)
    assert all(0 < calls <= tokens for calls, tokens in zip(stats.target_calls, stats.generated_tokens))
    assert stats.block_efficiency == pytest.approx(sum(stats.generated_tokens) / sum(stats.target_calls))
    for tokens, reason in zip(out.tokens, stats.finish_reason):
        assert reason == ("eos" if tokens[-1] == 5 else "length")
        assert 5 not in tokens[:-1]
        assert reason == "eos" or len(tokens) == 17
    phases = [stats.draft_seconds, stats.target_seconds, stats.selection_seconds, stats.other_seconds]
    assert all(s >= 0 for s in phases) and sum(phases) == pytest.approx(stats.wall_seconds, rel=1e-6)
    assert stats.target_seconds > 0 and stats.selection_seconds > 0
    if method == "autoregressive":
        assert stats.block_efficiency == 1.0 and stats.accepted_per_position == [] and stats.draft_seconds == 0
    else:
        assert len(stats.accepted_per_position) == 3 and len(histogram) == 5
        # a later position can only be accepted after the earlier ones
        assert all(a >= b for a, b in zip(stats.accepted_per_position, stats.accepted_per_position[1:]))
        assert stats.accepted_tokens <= stats.tested_positions
        assert stats.num_drafts == (1 if method in ("speculative", "block") else 3)
        assert stats.draft_seconds > 0
    assert set(stats.to_dict()) >= {"block_efficiency", "accepted_per_position", "tokens_per_call_histogram",
                                    "generated_tokens", "target_calls", "finish_reason", "acceptance_rate"}


def test_max_new_tokens_one(pair):
    out = spectr.generate(*pair, PROMPTS, max_new_tokens=1, draft_length=4)
    assert [len(t) for t in out.tokens] == [1, 1, 1, 1] and out.stats.target_calls == [1, 1, 1, 1]


def test_models_are_left_in_their_training_mode(pair):
    target, draft = pair
    target.train()
    try:
        spectr.generate(target, draft, PROMPTS, max_new_tokens=3)
        assert target.training and not draft.training
    finally:
        target.eval()
