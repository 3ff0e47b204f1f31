"""A row's vLLM fields as `pipeline.row_columns` reads them (the job's column and the Ray Data stage's rows).

structured_outputs (issue 50): the row key and its older name guided_decoding, the job-level
`spectr.structured_outputs`, a row's own value replacing the job's, unknown keys inside refused with the list of
known ones, an invalid regex / schema failing the row with the problem named, and the spec riding the engine warp
as `spectr.SamplingWarp`'s last field.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline.row_columns import RowSettings, job_settings, row_settings
from spectr.structured import StructuredSpec
from spectr.warps import SamplingWarp

PARAMS = "data.sampling_params_column 'params'"
STOP = "data.stop_column 'stop'"


def job(**values):
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, logit_bias=None, presence_penalty=0.0,
                frequency_penalty=0.0, repetition_penalty=1.0, min_tokens=0, stop_token_ids=None, ignore_eos=False,
                include_stop_str_in_output=False, structured_outputs=None)
    return SimpleNamespace(**{**base, **values})


def settings(params):
    return row_settings(params, None, PARAMS, STOP)


def test_structured_outputs_and_its_older_name_are_read():
    regex = settings({"structured_outputs": {"regex": "[0-9]+"}})
    assert regex.structured_outputs == StructuredSpec("regex", "[0-9]+")
    assert settings('{"guided_decoding": {"choice": ["yes", "no"]}}').structured_outputs.kind == "choice"
    schema = settings({"structured_outputs": {"json": '{"type": "object"}', "whitespace_pattern": " "}})
    assert schema.structured_outputs.kind == "json" and schema.structured_outputs.whitespace_pattern == " "
    assert settings({"structured_outputs": None}).structured_outputs is None


@pytest.mark.parametrize(("params", "message"), [
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs: unknown key(s) regexp; known: json, json_object"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs: invalid regex"),
    ({"guided_decoding": {"json": {"type": "objekt"}}}, "guided_decoding: invalid json"),
    ({"structured_outputs": {"regex": "a"}, "guided_decoding": {"regex": "b"}}, "may not both be set"),
])
def test_a_bad_structured_outputs_fails_the_row_naming_the_problem(params, message):
    with pytest.raises(ValueError, match=PARAMS) as error:
        settings(params)
    assert message in str(error.value)


def test_the_spec_rides_the_engine_warp_as_its_last_field():
    row = settings({"structured_outputs": {"regex": "a+"}}).over(job())
    warp = SamplingWarp(*row.engine_warp(job()))
    assert warp.structured == StructuredSpec("regex", "a+") and warp.temperature == 1.0
    assert RowSettings().over(job()).engine_warp(job()) is None  # nothing of its own: the batcher's warp


def test_the_job_level_setting_applies_to_every_row_and_a_rows_own_replaces_it():
    spectr = job(structured_outputs={"choice": ["a", "b"]})
    assert job_settings(spectr)["structured_outputs"] == StructuredSpec("choice", '["a", "b"]')
    plain = RowSettings().over(spectr)
    assert SamplingWarp(*plain.engine_warp(spectr)).structured.kind == "choice"
    own = settings({"structured_outputs": {"regex": "x"}}).over(spectr)
    assert own.structured_outputs.kind == "regex"


def test_an_invalid_job_level_setting_names_the_key():
    with pytest.raises(ValueError, match=r"spectr\.structured_outputs: invalid regex"):
        job_settings(job(structured_outputs={"regex": "(("}))


# --- issue 51, section 2: vLLM's row fields that touch the law or the row -------------------------------------


def test_seed_minus_one_is_no_seed():
    """vLLM's seed=-1 / None: the row takes the job's seed (derived from spectr.seed and its id)."""
    assert settings({"seed": -1}).seed is None and settings({"seed": 7}).seed == 7
    with pytest.raises(ValueError, match=r"seed must be >= 0, or -1 \(no seed\), got -2"):
        settings({"seed": -2})


def test_logit_bias_is_clamped_to_100_and_an_infinite_one_refused():
    assert settings({"logit_bias": {"5": 250, "6": -1e9, "7": 3}}).logit_bias == ((5, 100.0), (6, -100.0), (7, 3.0))
    for value in (float("inf"), float("-inf"), float("nan")):
        with pytest.raises(ValueError, match=r"logit_bias\[5\] must be finite"):
            settings({"logit_bias": {"5": value}})


def test_allowed_token_ids_ride_the_engine_warp():
    row = settings({"allowed_token_ids": [3, 5, 9]}).over(job())
    warp = SamplingWarp(*row.engine_warp(job()))
    assert warp.allowed_token_ids == (3, 5, 9) and warp.structured is None
    both = settings({"allowed_token_ids": [1], "structured_outputs": {"regex": "a"}}).over(job())
    assert SamplingWarp(*both.engine_warp(job())).structured.kind == "regex"
    for bad, message in (([], "must not be empty"), ([1, -2], "allowed_token_ids must be a list of token ids"),
                         ("12", "allowed_token_ids must be a list of token ids")):
        with pytest.raises(ValueError, match=message):
            settings({"allowed_token_ids": bad})


def test_bad_words_ride_the_engine_warp_as_strings():
    row = settings({"bad_words": ["foo", "bar baz"]}).over(job())
    warp = SamplingWarp(*row.engine_warp(job()))
    assert warp.bad_words == ("foo", "bar baz") and warp.allowed_token_ids == () and warp.structured is None
    assert settings({"bad_words": "foo"}).bad_words == ("foo",)  # one string, as vLLM's
    with pytest.raises(ValueError, match="bad_words must be a list of non-empty strings"):
        settings({"bad_words": [1, 2]})
