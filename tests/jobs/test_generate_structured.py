"""Structured outputs through the job and the Ray Data stage, on the embedded pair (issue 50).

- `slow`: the job (`jobs.generate`, Ray, auto planner) over 64 of the embedded prompts, one third each `json` (a
  schema with an enum, a bounded integer and a bounded string), `regex` and `choice`, `spectr.max_new_tokens=64`:
  every row that stops parses and validates (jsonschema), fullmatches its regex or equals one of its choices; at
  least 90% stop before the budget; no row errs.
- Default suite (the worker without Ray, 7 rows): the same three kinds valid, `guided_decoding` read as the alias,
  and an invalid regex / an unknown key inside `structured_outputs` each fail their row alone with the problem named;
  the job-level `spectr.structured_outputs` constrains every row that has none of its own.
- The Ray Data stage takes the same key in its rows' `sampling_params`.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

from pipeline.config import PROJECT_ROOT

ASSETS = PROJECT_ROOT / "assets"
SCHEMA = {"type": "object", "properties": {
    "label": {"enum": ["positive", "negative", "neutral"]},
    "score": {"type": "integer", "minimum": 0, "maximum": 100},
    "reason": {"type": "string", "minLength": 1, "maxLength": 24}},
    "required": ["label", "score", "reason"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{2,10} (is|was) [a-z]{3,12}\."
CHOICES = ["happy", "sad", "angry", "calm"]
KINDS = [{"json": SCHEMA, "whitespace_pattern": "[ ]?"}, {"regex": REGEX}, {"choice": CHOICES}]

def _wired() -> bool:
    """Whether the job's feed compiles the rows' grammars (the actor's tokenizer given to `spectr.structured`)."""
    from pipeline.generate.config import SpectrConfig
    from pipeline.generate.feed import ShardFeed

    return hasattr(ShardFeed, "_engine_warp") and hasattr(SpectrConfig(), "structured_outputs")


pytestmark = [
    pytest.mark.skipif(not (ASSETS / "models/target/config.json").exists(), reason="no embedded pair"),
    pytest.mark.skipif(not _wired(), reason="the job's feed does not give the actor's tokenizer to spectr.structured "
                                            "yet (issue 50: pipeline/generate/feed.py, worker.py, config.py)"),
]


def prompts(count: int) -> list[str]:
    lines = (ASSETS / "prompts.jsonl").read_text().splitlines()[:count]
    return [json.loads(line)["prompt"] for line in lines]


def valid(kind: dict, text: str) -> bool:
    if "json" in kind:
        try:
            jsonschema.validate(json.loads(text), kind["json"])
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if "regex" in kind:
        return re.fullmatch(kind["regex"], text) is not None
    return text in kind["choice"]


def check_rows(rows: list[dict], kinds: list[dict]) -> int:
    """Every row error-free, and valid where it stopped; returns how many stopped."""
    stopped = 0
    for row, kind in zip(rows, kinds):
        assert row["error"] is None, row["error"]
        if row["finish_reason"] == "stop":
            stopped += 1
            assert valid(kind, row["completion"]), (kind, row["completion"])
        else:
            assert row["finish_reason"] == "length"
    return stopped


@pytest.mark.slow
def test_a_64_row_job_of_json_regex_and_choice_rows(tmp_path, ray_local):
    from jobs.generate import generate
    from pipeline.generate.reader import read_output

    kinds = [KINDS[i % 3] for i in range(64)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i:02d}", "prompt": p, "params": {"structured_outputs": k}}) + "\n"
                            for i, (p, k) in enumerate(zip(prompts(64), kinds))))
    overrides = [f"data.path={data}", "data.sampling_params_column=params", "data.limit=null",
                 "spectr.max_new_tokens=64", "ray.num_actors=1", f"output_dir={tmp_path / 'out'}",
                 f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", "progress=false"]
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="generate", overrides=overrides)
    report = generate(cfg)
    assert report.exit_code == 0
    rows = sorted(read_output(tmp_path / "out").to_pylist(), key=lambda r: r["id"])
    assert len(rows) == 64
    assert check_rows(rows, kinds) >= 0.9 * 64


def worker_rows(tmp_path, lines: list[dict], **overrides) -> dict[str, dict]:
    """The rows of one shard through the worker (no Ray), on the embedded pair."""
    from tiny_pair_support import job_config

    from pipeline.generate.config import from_dict
    from pipeline.generate.output import output_schema
    from pipeline.generate.plan import prepare
    from pipeline.generate.worker import ShardGenerator, WorkerJob

    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    pair = {"target": ASSETS / "models/target", "draft": ASSETS / "models/draft"}
    raw = job_config(pair, data, tmp_path / "out", **{"data.sampling_params_column": "params", "shard_size": 16,
                                                       "spectr.method": "spectr", "spectr.max_new_tokens": 40,
                                                       **overrides})
    plan = prepare(from_dict(raw))
    (tmp_path / "out").mkdir()
    generator = ShardGenerator(plan.config.model, plan.config.spectr, num_threads=1)
    generator.job = WorkerJob(plan.config.data, plan.source, str(tmp_path / "out"), len(lines),
                              output_schema(plan.id_kind, kept=plan.source.columns.kept))
    part = generator.generate_shard(plan.shard(0)).file
    return {r["id"]: r for r in pq.read_table(tmp_path / "out" / part).to_pylist()}


def test_rows_of_each_kind_are_valid_and_bad_ones_fail_alone(tmp_path):
    text = prompts(3)
    lines = [{"id": f"ok{i}", "prompt": text[i], "params": {"structured_outputs": k}} for i, k in enumerate(KINDS)]
    lines += [{"id": "alias", "prompt": text[0], "params": {"guided_decoding": {"choice": CHOICES}}},
              {"id": "bad_regex", "prompt": text[1], "params": {"structured_outputs": {"regex": "(("}}},
              {"id": "bad_key", "prompt": text[2], "params": {"structured_outputs": {"regexp": "a"}}},
              {"id": "plain", "prompt": text[2], "params": {"temperature": 0.5}}]
    rows = worker_rows(tmp_path, lines)
    stopped = check_rows([rows[f"ok{i}"] for i in range(3)] + [rows["alias"]], [*KINDS, KINDS[2]])
    assert stopped >= 3
    assert "structured_outputs: invalid regex" in rows["bad_regex"]["error"]
    assert "unknown key(s) regexp; known: json, json_object, regex, choice, grammar" in rows["bad_key"]["error"]
    assert rows["plain"]["error"] is None and rows["plain"]["finish_reason"] == "length"  # unconstrained code


def test_the_job_level_setting_constrains_every_row(tmp_path):
    lines = [{"id": f"r{i}", "prompt": p, "params": {}} for i, p in enumerate(prompts(4))]
    lines[3]["params"] = {"structured_outputs": {"regex": "[0-9]{2}"}}  # its own replaces the job's
    rows = worker_rows(tmp_path, lines, **{"spectr.structured_outputs": {"choice": CHOICES}})
    assert all(rows[f"r{i}"]["completion"] in CHOICES for i in range(3))
    assert re.fullmatch("[0-9]{2}", rows["r3"]["completion"])


def test_the_ray_data_stage_takes_the_key_in_its_rows_sampling_params():
    from pipeline.ray_data import SpecTrProcessorConfig, SpecTrStage

    config = SpecTrProcessorConfig(model_source=str(ASSETS / "models/target"),
                                   draft_model_source=str(ASSETS / "models/draft"), batch_size=3,
                                   engine_kwargs={"method": "spectr", "num_drafts": 2, "draft_length": 3,
                                                  "max_new_tokens": 40, "dtype": "float32"},
                                   should_continue_on_error=True)
    stage = SpecTrStage(config)
    text = prompts(3)
    rows = [{"id": i, "prompt": text[i], "sampling_params": {"structured_outputs": k}} for i, k in enumerate(KINDS)]
    out = stage.generate(pa.Table.from_pylist(rows)).to_pylist()
    for row, kind in zip(out, KINDS):
        assert row["finish_reason"] == "stop" and valid(kind, row["generated_text"]), row


def test_rows_with_bad_words_and_allowed_token_ids(tmp_path):
    """vLLM's bad_words (strings, tokenized by the actor as vLLM's) and allowed_token_ids, per row, greedy: the
    unconstrained row's first word is what the bad-words row may not produce; the allowed row samples only those."""
    from transformers import AutoTokenizer

    from spectr.bad_words import bad_words_token_ids

    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "models/target")
    text = prompts(1)[0]
    greedy = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    first = worker_rows(tmp_path / "a", [{"id": "plain", "prompt": text, "params": greedy}])["plain"]
    word = tokenizer.decode(first["completion_token_ids"][:2]).strip()
    allowed = sorted(set(first["completion_token_ids"]))[:3] + [tokenizer.eos_token_id]
    rows = worker_rows(tmp_path / "b", [
        {"id": "bad", "prompt": text, "params": {**greedy, "bad_words": [word]}},
        {"id": "allowed", "prompt": text, "params": {**greedy, "allowed_token_ids": allowed}}])
    ids = rows["bad"]["completion_token_ids"]
    assert rows["bad"]["error"] is None and ids != first["completion_token_ids"]
    for sequence in bad_words_token_ids([word], tokenizer):
        assert not any(ids[i:i + len(sequence)] == list(sequence) for i in range(len(ids)))
    assert rows["allowed"]["error"] is None and set(rows["allowed"]["completion_token_ids"]) <= set(allowed)
