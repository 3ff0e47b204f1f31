"""The train_draft job making a feature draft (`draft.kind=eagle` / `eagle3`): end to end on a tiny target.

The head learns the sharp tiny target's law from its features (acceptance on held-out positions well above
the untrained head's), saves in the EAGLE layouts, loads in the generate job's loader (`pipeline.models`) and
runs in the engine; a run with the target's laws shuffled across positions (the negative control) does not
learn them. The frequency-ranked draft vocabulary: the saved head drafts only its N tokens.
"""

from __future__ import annotations

import pytest
import torch
from test_train_draft import compose_config, sharp_target  # noqa: F401 - the module fixture

from jobs.train_draft import run, summary_line
from pipeline.config import ModelConfig
from pipeline.train_draft import feature
from spectr.feature_draft import feature_draft_kind, load_feature_draft


def eagle(sharp_target, out, *overrides):  # noqa: F811
    return compose_config(sharp_target, out, "draft.kind=eagle", *overrides)


def test_the_job_makes_a_feature_draft_the_generate_job_loads_and_the_engine_runs(sharp_target, tmp_path):  # noqa: F811
    import spectr
    from pipeline.models import check_pair, load_model

    out = tmp_path / "head"
    result = run(eagle(sharp_target, out, "draft.vocab_size=24"))
    assert feature_draft_kind(out) == "eagle" and result.kind == "eagle"
    assert result.history[-1][1] < result.history[0][1], "the loss goes down"
    assert result.acceptance > 0.6 and result.second_acceptance is not None
    line = summary_line(result, str(sharp_target["target"]))
    assert f"model.draft={out}" in line
    assert 0.0 <= result.fit_acceptance <= 1.0 and f"on training sequences {result.fit_acceptance:.3f}" in line

    pair = ModelConfig(target=str(sharp_target["target"]), draft=str(out), dtype="float32")
    check_pair(pair)
    target = load_model(pair.target, pair, "cpu")
    head = load_model(pair.draft, pair, "cpu")
    assert getattr(head, "is_feature_draft", False) and head.config.draft_vocab_size == 24
    output = spectr.generate(target, head, [[1, 5, 6, 7], [1, 8]], method="spectr", num_drafts=2, draft_length=3,
                             max_new_tokens=8, eos_token_id=2, seed=[0, 1])
    assert all(0 < len(tokens) <= 8 for tokens in output.tokens)
    assert output.stats.block_efficiency > 1.0, "the head's tokens are accepted"

    untrained = feature.build_head(target, "eagle", head.draft_ids(), "random", 0).eval()
    from pipeline.train_draft.completions import Sequences

    saved = torch.load(out / "_train_draft" / "completions.pt", weights_only=True)
    heldout = Sequences(**saved["heldout"])
    before = feature.heldout_acceptance(target, untrained, heldout, 1.0, "cpu")[0]
    assert result.acceptance > before + 0.2, (before, result.acceptance)


def test_shuffled_laws_are_a_negative_control_for_the_feature_draft(sharp_target, tmp_path):  # noqa: F811
    normal = run(eagle(sharp_target, tmp_path / "normal"))
    shuffled = run(eagle(sharp_target, tmp_path / "shuffled", "train.shuffle_targets=true"))
    assert normal.acceptance > shuffled.acceptance + 0.2, (normal.acceptance, shuffled.acceptance)


def test_an_eagle3_head_trains_and_loads(sharp_target, tmp_path):  # noqa: F811
    """EAGLE-3's layout over three fused layers of the target (the tiny target has one layer: EAGLE-3's indices
    2, L/2, L-3 are clamped into [0, 1]), trained with a second pass over its own states (train.unroll=2)."""
    out = tmp_path / "head3"
    result = run(eagle(sharp_target, out, "draft.kind=eagle3", "draft.init=random", "train.unroll=2"))
    assert feature_draft_kind(out) == "eagle3"
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(sharp_target["target"])
    head = load_feature_draft(out, target)
    assert head.config.feature_layers == feature.feature_layers(target.config, "eagle3")
    assert result.acceptance > 0.3


def test_a_head_can_keep_the_targets_output_rows(sharp_target, tmp_path):  # noqa: F811
    """draft.train_lm_head=false: the head's output layer stays the target's rows for its draft vocabulary (what
    EAGLE-1 does with the whole output layer), the rest of the head trains; true (the control) moves them."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(sharp_target["target"])
    rows = {}
    for train_head in (False, True):
        out = tmp_path / f"head-{train_head}"
        result = run(eagle(sharp_target, out, "draft.kind=eagle3", "draft.vocab_size=24",
                           f"draft.train_lm_head={str(train_head).lower()}"))
        head = load_feature_draft(out, target)
        expected = target.get_output_embeddings().weight[head.draft_ids()].detach().float()
        # saved in bfloat16: equal up to its rounding (a relative 2^-8)
        rows[train_head] = torch.allclose(head.lm_head.weight.detach().float(), expected, rtol=2 ** -7, atol=1e-6)
        assert result.history[-1][1] < result.history[0][1], "the loss goes down either way"
    assert rows == {False: True, True: False}, rows


def test_the_last_line_says_when_the_head_learnt_its_training_text_rather_than_the_target():
    """A training-sequence acceptance well above the held-out one (the head overfits) is said with what to do;
    a small gap is not."""
    from jobs.train_draft import OVERFIT_GAP
    from pipeline.train_draft.training import DraftResult

    def line(fit):
        result = DraftResult(out="/d", draft_parameters=1, target_parameters=2, steps=3, train_seconds=60.0,
                             stopped_by="steps", final_loss=1.0, acceptance=0.44, heldout_positions=9,
                             train_sequences=4, train_completion_tokens=5, kind="eagle3", fit_acceptance=fit)
        return summary_line(result, "/t")

    assert "more prompts help more than more steps" in line(0.62)
    assert "on training sequences 0.460" in line(0.46) and "more prompts" not in line(0.44 + OVERFIT_GAP / 2)


def test_train_lm_head_must_be_a_boolean(sharp_target, tmp_path):  # noqa: F811
    from pipeline.errors import JobInputError

    with pytest.raises(JobInputError, match="draft.train_lm_head: true or false, got 'maybe'"):
        run(eagle(sharp_target, tmp_path / "bad", "draft.train_lm_head=maybe"))


@pytest.mark.parametrize("size,expected", [(None, None), (4, [2, 5, 6, 9])])
def test_the_draft_vocabulary_is_the_most_frequent_completion_tokens(size, expected):
    from pipeline.train_draft.completions import Sequences

    sequences = Sequences([[1, 9, 9, 5, 6, 5, 9], [1, 1, 6, 5, 9, 7, 8]], [1, 2])
    ids = feature.frequent_tokens(sequences, size, 50, always=[2])
    assert (ids if ids is None else ids.tolist()) == expected
