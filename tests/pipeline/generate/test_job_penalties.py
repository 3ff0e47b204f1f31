"""vLLM's penalties and min_tokens as per-row `sampling_params` of the job (#39): no longer refused, run exactly.

The worker runs without Ray (`ShardGenerator.generate_shard` writes a real part file). A greedy row with
repetition / frequency / presence penalties gets the tokens `spectr.generate` gives with those settings (the
engine's penalties are tested against vLLM's formulas and by enumeration in tests/spectr/test_penalties.py); a
row with min_tokens has at least that many tokens; values out of vLLM's ranges fail their row alone.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
from tiny_pair_support import job_config

from pipeline.generate.config import SpectrConfig, from_dict
from pipeline.generate.feed import Row
from pipeline.generate.output import output_schema
from pipeline.generate.plan import prepare
from pipeline.generate.worker import ShardGenerator, WorkerJob
from pipeline.row_columns import REFUSED_KEYS, row_settings
from spectr.api import generate

PROMPT = "the cat sat on the"
PENALTIES = {"repetition_penalty": 1.8, "frequency_penalty": 0.7, "presence_penalty": 0.4}
PARAMS = {
    "greedy": {"temperature": 0, "max_tokens": 10, "ignore_eos": True},
    "penalised": {"temperature": 0, "max_tokens": 10, "ignore_eos": True, **PENALTIES},
    "min_tokens": {"min_tokens": 6, "max_tokens": 10, "presence_penalty": 0.3},
    "bad_repetition": {"repetition_penalty": 0},
    "bad_presence": {"presence_penalty": 2.5},
    "bad_min_tokens": {"min_tokens": 11, "max_tokens": 10},
    "min_over_budget": {"min_tokens": 20},  # the job's max_new_tokens is 12
}


def test_rows_with_penalties_run_exactly_and_bad_values_fail_alone(tiny_pair, tmp_path):
    assert not {"presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"} & set(REFUSED_KEYS)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": name, "prompt": PROMPT, "params": value}) + "\n"
                            for name, value in PARAMS.items()))
    raw = job_config(tiny_pair, data, tmp_path / "out", **{
        "spectr.max_new_tokens": 12, "data.sampling_params_column": "params", "shard_size": 16})
    plan = prepare(from_dict(raw))
    (tmp_path / "out").mkdir()
    generator = ShardGenerator(plan.config.model, plan.config.spectr, num_threads=1)
    generator.job = WorkerJob(plan.config.data, plan.source, str(tmp_path / "out"), 6,
                              output_schema(plan.id_kind, kept=plan.source.columns.kept))
    part = generator.generate_shard(plan.shard(0)).file  # named for the run and attempt
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "out" / part).to_pylist()}

    for name in ("greedy", "penalised", "min_tokens"):
        assert rows[name]["error"] is None, rows[name]["error"]
    prompt_ids = generator.tokenizer(PROMPT)["input_ids"]
    expected = generate(generator.target, generator.draft, [prompt_ids], method="spectr", num_drafts=2,
                        draft_length=3, max_new_tokens=10, temperature=0.0, **PENALTIES).tokens[0]
    assert rows["penalised"]["completion_token_ids"] == expected
    assert rows["penalised"]["completion_token_ids"] != rows["greedy"]["completion_token_ids"]
    # a row re-run alone (after a failed batch step) keeps its penalties: `Row.warp` in SamplingWarp's order
    alone = generator.feed._alone(generator.feed.config, Row(0, prompt_ids, 10, 0, warp=(
        0.0, 0, 1.0, 0.0, (), PENALTIES["presence_penalty"], PENALTIES["frequency_penalty"],
        PENALTIES["repetition_penalty"], 0), stop_ids=()))
    assert alone.tokens == expected
    assert rows["min_tokens"]["completion_tokens"] >= 6
    assert "repetition_penalty must be > 0" in rows["bad_repetition"]["error"]
    assert "presence_penalty must be in [-2, 2]" in rows["bad_presence"]["error"]
    assert "min_tokens (11) must be <= max_tokens (10)" in rows["bad_min_tokens"]["error"]
    assert "min_tokens (20) must be <= the row's max_tokens (12)" in rows["min_over_budget"]["error"]


def test_row_settings_read_the_penalties():
    settings = row_settings({"presence_penalty": -1, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
                             "min_tokens": 3}, None, "params", "stops")
    assert (settings.presence_penalty, settings.frequency_penalty, settings.repetition_penalty,
            settings.min_tokens) == (-1.0, 0.5, 1.2, 3)
    unset = row_settings({"min_tokens": None, "repetition_penalty": None}, None, "p", "s")
    assert unset.min_tokens is None and unset.repetition_penalty is None  # unset: the job's (spectr.*)
    assert unset.over(SpectrConfig()).min_tokens == 0 and unset.over(SpectrConfig()).repetition_penalty == 1.0
