"""Job-level vLLM settings (#39): `spectr.min_p`, `spectr.logit_bias`, the penalties, `spectr.min_tokens`,
`spectr.stop_token_ids`, `spectr.ignore_eos` and `spectr.include_stop_str_in_output` apply to every row, and a row's
`sampling_params` value of the same name replaces the job's, a neutral one included (a row that leaves a key
unset gets the job's; one that sets it to "off" gets off). Stop strings follow vLLM's min_tokens rule: a stop string
counts only once it ends in the text of a token after the first min_tokens, in the feed's early end and in the cut.

The worker runs without Ray (`ShardGenerator.generate_shard` writes a real part file, as in test_job_penalties);
the expected tokens come from `spectr.generate` with the same settings, or Hugging Face's greedy decoding.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch
from tiny_pair_support import job_config

from pipeline.errors import JobInputError
from pipeline.generate.config import SpectrConfig, from_dict, generation_settings
from pipeline.generate.output import output_schema
from pipeline.generate.plan import prepare
from pipeline.generate.worker import ShardGenerator, WorkerJob
from pipeline.row_columns import row_settings
from pipeline.stops import cut_at_stop
from spectr.api import generate
from spectr.warps import SamplingWarp

PENALTIES = {"repetition_penalty": 1.8, "frequency_penalty": 0.7, "presence_penalty": 0.4}
OFF = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "logit_bias": {},
       "stop_token_ids": []}


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face's own greedy decoding of one prompt, no end-of-sequence (the reference for plain greedy)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


def run_rows(tiny_pair, tmp_path, prompt: str, params: dict, **settings) -> tuple[dict, ShardGenerator]:
    """One shard of rows (id: its sampling_params) through the worker; the part file's rows by id."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": name, "prompt": prompt, "params": value}) + "\n"
                            for name, value in params.items()))
    raw = job_config(tiny_pair, data, tmp_path / "out", **{
        "data.sampling_params_column": "params", "shard_size": 16, **settings})
    plan = prepare(from_dict(raw))
    (tmp_path / "out").mkdir()
    schema = output_schema(plan.id_kind, logprobs=plan.config.spectr.logprobs, kept=plan.source.columns.kept)
    generator = ShardGenerator(plan.config.model, plan.config.spectr, num_threads=1)
    generator.job = WorkerJob(plan.config.data, plan.source, str(tmp_path / "out"), 6, schema)
    generator.generate_shard(plan.shard(0))
    (part,) = (tmp_path / "out").glob("part-*.parquet")
    return {r["id"]: r for r in pq.read_table(part).to_pylist()}, generator


def test_job_penalties_bias_and_stop_tokens_apply_to_every_row_and_a_row_overrides_them(tiny_pair, tmp_path):
    """Greedy rows under the job's penalties, logit bias, ignore_eos and stop_token_ids: each row equals
    `spectr.generate` with the settings it should have after its own overrides."""
    prompt = "the cat sat on the"
    params = {
        "job": None,  # every setting the job's
        "off": OFF,  # penalties, bias and stop tokens off: plain greedy decoding
        "no_bias": {"logit_bias": {}, "stop_token_ids": []},  # the job's penalties only
        "eos": {"logit_bias": {}, "stop_token_ids": [], "ignore_eos": False},  # ... and EOS ends it again
        "min_tokens": {"min_tokens": 6},  # the job's stop token masked until 6 tokens
    }
    bias, stop_id = 27, 34  # the penalised path's first token (banned), the biased path's 5th (checked below)
    rows, generator = run_rows(tiny_pair, tmp_path, prompt, params, **{
        "spectr.temperature": 0.0, "spectr.max_new_tokens": 10, **{f"spectr.{k}": v for k, v in PENALTIES.items()},
        "spectr.logit_bias": {bias: -100.0}, "spectr.ignore_eos": True, "spectr.stop_token_ids": [stop_id]})
    assert all(r["error"] is None for r in rows.values()), {k: r["error"] for k, r in rows.items()}
    ids = generator.tokenizer(prompt)["input_ids"]
    eos = generator.eos_token_id[0]

    def expected(**settings):
        return generate(generator.target, generator.draft, [ids], method="spectr", num_drafts=2, draft_length=3,
                        max_new_tokens=10, temperature=0.0, **settings).tokens[0]

    penalised = expected(eos_token_id=None, **PENALTIES)
    assert penalised[0] == bias and eos in penalised[:-1]  # the bias and ignore_eos have something to change
    biased = expected(eos_token_id=[stop_id], logit_bias={bias: -100.0}, **PENALTIES)
    assert biased[-1] == stop_id and len(biased) == 5 and bias not in biased

    job = rows["job"]
    assert job["completion_token_ids"] == biased
    assert (job["finish_reason"], job["stop_reason"]) == ("stop", str(stop_id))
    plain = hf_greedy(generator.target, ids, 10)
    assert rows["off"]["completion_token_ids"] == plain != penalised[: len(plain)]
    assert rows["off"]["finish_reason"] == "length"
    assert rows["no_bias"]["completion_token_ids"] == penalised and rows["no_bias"]["finish_reason"] == "length"
    row = rows["eos"]
    assert row["completion_token_ids"] == penalised[: penalised.index(eos) + 1]
    assert (row["finish_reason"], row["stop_reason"]) == ("stop", None)
    late = expected(eos_token_id=[stop_id], logit_bias={bias: -100.0}, min_tokens=6, **PENALTIES)
    assert rows["min_tokens"]["completion_token_ids"] == late != biased
    assert stop_id not in late[:6]


def test_job_min_p_applies_to_every_row_and_a_row_turns_it_off(tiny_pair, tmp_path):
    """Sampled rows with the job's min_p: the processed log-probabilities are those of the min-p law (a plain
    target forward, warped); a row with min_p 0 reads the unwarped law."""
    prompt = "the cat sat on"
    rows, generator = run_rows(tiny_pair, tmp_path, prompt, {"job": None, "off": {"min_p": 0.0}}, **{
        "spectr.min_p": 0.8, "spectr.logprobs": True, "spectr.logprobs_mode": "processed",
        "spectr.ignore_eos": True, "spectr.max_new_tokens": 8})
    ids = generator.tokenizer(prompt)["input_ids"]

    def logprobs(tokens, warp):
        with torch.no_grad():
            logits = generator.target(input_ids=torch.tensor([ids + tokens]), use_cache=False).logits[0]
        probs = warp.probs(logits[len(ids) - 1 : len(ids) - 1 + len(tokens)])
        return probs.gather(1, torch.tensor(tokens)[:, None])[:, 0].log().tolist()

    for name, warp, other in (("job", SamplingWarp(min_p=0.8), SamplingWarp()),
                              ("off", SamplingWarp(), SamplingWarp(min_p=0.8))):
        row = rows[name]
        assert row["error"] is None and row["completion_tokens"] == 8
        own = logprobs(row["completion_token_ids"], warp)
        assert max(abs(a - b) for a, b in zip(row["completion_logprobs"], own)) < 2e-3
        assert max(abs(a - b) for a, b in zip(own, logprobs(row["completion_token_ids"], other))) > 1e-2


def test_stop_strings_count_only_after_min_tokens_as_vllms(tiny_pair, tmp_path):
    """Greedy rows whose stop string ("value") is the text of their 2nd token and again of their 7th: with the
    job's min_tokens 4 the first one does not count (vLLM's detokenizer skips the first min_tokens tokens' text),
    so the row runs on (the feed does not end it early) and is cut at the second; with include_stop_str_in_output
    (the job's) the completion keeps it. A row with min_tokens 0 is cut at the first; a row whose max_tokens is
    below the job's min_tokens fails, naming spectr.min_tokens."""
    prompt = "the cat sat on the"
    params = {"job": None, "early": {"min_tokens": 0, "include_stop_str_in_output": False},
              "short": {"max_tokens": 2}}
    rows, generator = run_rows(tiny_pair, tmp_path, prompt, params, **{
        "spectr.temperature": 0.0, "spectr.max_new_tokens": 12, "spectr.stop": ["value"], "spectr.min_tokens": 4,
        "spectr.ignore_eos": True, "spectr.include_stop_str_in_output": True})
    ids = generator.tokenizer(prompt)["input_ids"]
    greedy = hf_greedy(generator.target, ids, 12)

    def text(tokens):
        return generator.tokenizer.decode(tokens, skip_special_tokens=True)

    assert text([greedy[1]]) == text([greedy[6]]) == "value" and "value" not in text(greedy[2:6])
    job = rows["job"]
    assert job["completion_token_ids"] == greedy[:7] and job["completion"] == text(greedy[:7])
    assert job["completion"].endswith("value") and job["completion"].count("value") == 2
    assert (job["finish_reason"], job["stop_reason"]) == ("stop", "value")
    early = rows["early"]
    assert early["completion_token_ids"] == greedy[:1] and (early["finish_reason"], early["stop_reason"]) == (
        "stop", "value")
    assert "min_tokens (4 of spectr.min_tokens) must be <= the row's max_tokens (2)" in rows["short"]["error"]


def test_the_cut_skips_the_text_of_the_first_min_tokens_tokens():
    vocabulary = {1: "ab", 2: "c\n", 3: "d", 4: "e", 5: "ab"}

    def decode(ids):
        return "".join(vocabulary[i] for i in ids)

    assert cut_at_stop(decode, [1, 3, 5, 4], ["ab"]).num_tokens == 0
    assert cut_at_stop(decode, [1, 3, 5, 4], ["ab"], min_tokens=1).num_tokens == 2  # the second "ab"
    assert cut_at_stop(decode, [1, 3, 5, 4], ["ab"], min_tokens=3) is None  # "ab" ends in the 3rd token's text
    spanning = cut_at_stop(decode, [1, 3, 4, 2], ["dec"], min_tokens=2)  # begins in the 2nd token, ends in the 4th
    assert (spanning.text, spanning.num_tokens, spanning.stop) == ("ab", 1, "dec")
    assert cut_at_stop(decode, [1, 3, 4, 2], ["dec"], min_tokens=4) is None  # no token after min_tokens


def test_row_settings_tell_unset_from_off_and_take_the_jobs_value():
    job = SpectrConfig(min_p=0.1, logit_bias={"5": 2.0}, presence_penalty=0.5, frequency_penalty=-0.5,
                       repetition_penalty=1.3, min_tokens=2, stop_token_ids=[7], ignore_eos=True,
                       include_stop_str_in_output=True)
    unset = row_settings({"temperature": 0.5}, None, "params", "stops")
    assert unset.repetition_penalty is None and unset.logit_bias is None and unset.ignore_eos is None
    filled = unset.over(job)
    assert (filled.min_p, filled.logit_bias, filled.presence_penalty, filled.frequency_penalty,
            filled.repetition_penalty, filled.min_tokens, filled.stop_token_ids, filled.ignore_eos,
            filled.include_stop_str_in_output) == (0.1, ((5, 2.0),), 0.5, -0.5, 1.3, 2, [7], True, True)
    assert filled.engine_warp(job) == (0.5, 0, 1.0, 0.1, ((5, 2.0),), 0.5, -0.5, 1.3, 2)
    assert filled.stop_ids([2]) == (7,)  # ignore_eos: the job's stop token only
    off = row_settings({**OFF, "min_p": 0, "min_tokens": 0, "ignore_eos": False,
                        "include_stop_str_in_output": False}, None, "params", "stops").over(job)
    assert off.engine_warp(job) is None and off.stop_ids([2]) is None and not off.include_stop_str_in_output
    none = row_settings(None, None, "params", "stops").over(SpectrConfig())  # a job and a row without any
    assert none.engine_warp(SpectrConfig()) is None and none.stop_ids([2]) is None and none.min_tokens == 0


@pytest.mark.parametrize("override,message", [
    ({"spectr.min_p": 1.5}, r"spectr.min_p must be in \[0, 1\]"),
    ({"spectr.presence_penalty": 2.5}, r"spectr.presence_penalty must be in \[-2, 2\]"),
    ({"spectr.frequency_penalty": -3}, r"spectr.frequency_penalty must be in \[-2, 2\]"),
    ({"spectr.repetition_penalty": 0}, r"spectr.repetition_penalty must be > 0"),
    ({"spectr.min_tokens": -1}, r"spectr.min_tokens must be >= 0"),
    ({"spectr.min_tokens": 9}, r"spectr.min_tokens must be <= spectr.max_new_tokens \(8\)"),
    ({"spectr.logit_bias": {"x": 1.0}}, r"spectr.logit_bias keys must be token ids"),
    ({"spectr.logit_bias": [1, 2]}, r"spectr.logit_bias must be an object of token id -> bias"),
    ({"spectr.stop_token_ids": [-1]}, r"spectr.stop_token_ids must be a list of token ids"),
    ({"spectr.stop_token_ids": 3}, r"spectr.stop_token_ids must be a list of token ids"),
    ({"spectr.ignore_eos": "yes"}, r"spectr.ignore_eos must be bool"),
    ({"spectr.include_stop_str_in_output": 1}, r"spectr.include_stop_str_in_output must be bool"),
])
def test_bad_job_level_values_are_refused_up_front(tiny_pair, tmp_path, override, message):
    raw = job_config(tiny_pair, tmp_path / "in.jsonl", tmp_path / "out", **override)
    with pytest.raises(JobInputError, match=message):
        from_dict(raw)


def test_the_output_hash_changes_only_with_a_setting_that_is_on(tiny_pair, tmp_path):
    """At their defaults the new keys leave the output directory's hash as before them; on, they change it, with
    logit_bias read as the rows read it (a key "5" and a key 5 are one setting)."""
    base = job_config(tiny_pair, tmp_path / "in.jsonl", tmp_path / "out")
    plain = generation_settings(from_dict(base))
    assert not {"min_p", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                "stop_token_ids", "ignore_eos", "include_stop_str_in_output"} & set(plain["spectr"])
    neutral = job_config(tiny_pair, tmp_path / "in.jsonl", tmp_path / "out", **{
        "spectr.repetition_penalty": 1, "spectr.logit_bias": {}, "spectr.stop_token_ids": [], "spectr.min_p": 0})
    assert generation_settings(from_dict(neutral)) == plain
    by_text = job_config(tiny_pair, tmp_path / "in.jsonl", tmp_path / "out", **{"spectr.logit_bias": {"5": 1}})
    by_int = job_config(tiny_pair, tmp_path / "in.jsonl", tmp_path / "out", **{"spectr.logit_bias": {5: 1.0}})
    assert generation_settings(from_dict(by_text)) == generation_settings(from_dict(by_int)) != plain


def test_the_ray_data_stage_takes_them_as_engine_kwargs(tiny_pair):
    """engine_kwargs take the same keys (the stage's job-level settings): every row gets them, a row's
    sampling_params replaces them; a bad value is refused on the driver, naming the key."""
    import pyarrow as pa

    from pipeline.ray_data import SpecTrProcessorConfig, SpecTrStage

    engine = {"method": "speculative", "draft_length": 2, "temperature": 0.0, "ignore_eos": True,
              "max_new_tokens": 6, **PENALTIES}
    config = SpecTrProcessorConfig(model_source=str(tiny_pair["target"]), draft_model_source=str(tiny_pair["draft"]),
                                   batch_size=4, engine_kwargs=engine)
    stage = SpecTrStage(config)
    prompt = "the cat sat on the"
    out = stage.generate(pa.Table.from_pylist([
        {"prompt": prompt, "sampling_params": {"seed": 1}},
        {"prompt": prompt, "sampling_params": {"seed": 1, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
                                               "presence_penalty": 0.0}}])).to_pylist()
    g = stage.generator
    ids = g.tokenizer(prompt)["input_ids"]
    penalised = generate(g.target, g.draft, [ids], method="speculative", draft_length=2, max_new_tokens=6,
                         temperature=0.0, eos_token_id=None, **PENALTIES).tokens[0]
    assert out[0]["generated_tokens"] == penalised and out[0]["finish_reason"] == "length"
    assert out[1]["generated_tokens"] == hf_greedy(g.target, ids, 6) != penalised
    with pytest.raises(ValueError, match=r"spectr.repetition_penalty must be > 0"):
        SpecTrProcessorConfig(model_source=str(tiny_pair["target"]), draft_model_source=str(tiny_pair["draft"]),
                              engine_kwargs={"repetition_penalty": -1.0})
