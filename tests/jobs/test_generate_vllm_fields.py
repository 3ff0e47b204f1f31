"""vLLM's row fields in the job (issue 51 §2), each against its vLLM meaning, on the embedded pair.

- `prompt_logprobs=N`: the `prompt_logprobs` column equals a plain HF forward's log_softmax over the prompt (first
  position null, then the prompt token's entry with its rank and the top N others); rows that do not ask have null.
- `truncate_prompt_tokens=k`: the row generates from the prompt's last k tokens (`prompt_token_ids`,
  `prompt_tokens`; greedy: HF's greedy tokens from those k tokens).
- `skip_special_tokens=False` keeps a special token's text (the default drops it); `detokenize=False` writes no text.
- `stop_reason` for a stop token: the `stop_token_id` column holds vLLM's int (and `stop_reason` its text; Parquet
  has no int-or-string column); null at EOS.
- Per-row `logprobs=M` keeps M of the job's N alternatives; more than `spectr.logprobs` fails the row with the rule;
  `cumulative_logprob` is the sum of `completion_logprobs`.
- `prompt_token_ids` on every generated row; `output_kind` is accepted (a batch writes each row once).

None of these changes a sampling law: prompt_logprobs reads the prefill's logits, truncation changes the prompt,
the others the text or the columns (the law tests in tests/spectr cover the engine unchanged).

The worker's part is `pipeline.generate.output.with_vllm_fields`; while the worker does not call it the worker test
is an expected failure (strict: it fails the suite once the worker does, so the marker goes with it).
"""

from __future__ import annotations

import inspect
import json
import math
import re

import pyarrow.parquet as pq
import pytest
import torch

from pipeline.config import PROJECT_ROOT
from pipeline.row_columns import RowSettings, row_settings

ASSETS = PROJECT_ROOT / "assets"
PAIR = {"target": ASSETS / "models/target", "draft": ASSETS / "models/draft"}
EOS = 1


def _wired() -> bool:
    from pipeline.generate.worker import ShardGenerator

    return "with_vllm_fields" in inspect.getsource(ShardGenerator)


needs_pair = pytest.mark.skipif(not (PAIR["target"] / "config.json").exists(), reason="no embedded pair")


# --- the row's settings (pipeline.row_columns) ----------------------------------------------------------------


def settings(**params) -> RowSettings:
    return row_settings(params, None, "params", "stop")


def test_the_new_keys_are_read_with_vllms_ranges():
    s = settings(prompt_logprobs=3, truncate_prompt_tokens=2, skip_special_tokens=False,
                 spaces_between_special_tokens=False, detokenize=False, output_kind=2)
    assert (s.prompt_logprobs, s.truncate_prompt_tokens, s.skip_special_tokens, s.detokenize) == (3, 2, False, False)
    assert s.prompt_ids([5, 6, 7, 8]) == [7, 8] and settings().prompt_ids([5, 6]) == [5, 6]
    assert s.decode_options() == {"skip_special_tokens": False, "spaces_between_special_tokens": False}
    assert settings().decode_options() == {"skip_special_tokens": True}
    for params, message in [({"prompt_logprobs": 21}, "prompt_logprobs must be in [0, 20]"),
                            ({"prompt_logprobs": -1}, "prompt_logprobs must be in [0, 20]"),
                            ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be >= 1"),
                            ({"truncate_prompt_tokens": -1}, "vLLM's -1, the model's length, is not taken"),
                            ({"skip_special_tokens": "no"}, "skip_special_tokens must be true or false"),
                            ({"output_kind": "LATER"}, "output_kind must be one of CUMULATIVE, DELTA, FINAL_ONLY")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            settings(**params)


def test_a_rows_logprobs_needs_the_jobs():
    from pipeline.generate.config import SpectrConfig

    assert settings(logprobs=2).over(SpectrConfig(logprobs=3)).logprobs == 2
    with pytest.raises(ValueError, match="logprobs=2: the job writes no log-probabilities; set spectr.logprobs"):
        settings(logprobs=2).over(SpectrConfig())
    with pytest.raises(ValueError, match="at most spectr.logprobs=1 alternatives per token"):
        settings(logprobs=2).over(SpectrConfig(logprobs=1))
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        row_settings({"detokenize": False}, ["x"], "params", "stop").over(SpectrConfig())


def test_the_schema_has_vllms_columns():
    import pyarrow as pa

    from pipeline.generate.output import output_schema

    plain, with_logprobs = output_schema("str"), output_schema("str", logprobs=2)
    assert plain.field("prompt_token_ids").type == pa.list_(pa.int32())
    assert plain.field("stop_token_id").type == pa.int32() and plain.field("stop_reason").type == pa.string()
    assert plain.field("prompt_logprobs").type.value_type.value_type.names == ["token_id", "logprob", "rank"]
    assert "cumulative_logprob" not in plain.names and with_logprobs.field("cumulative_logprob").type == pa.float64()


def test_with_vllm_fields_fills_a_row():
    from pipeline.generate.output import with_vllm_fields
    from spectr import FinishedRow
    from spectr.rows import PromptLogprobs

    asked = PromptLogprobs([4, 7, 9], [None, -0.5, -2.0], [None, 1, 3], [[], [(7, -0.5), (2, -1.0)],
                                                                        [(5, -0.1), (6, -1.5)]])
    finished = FinishedRow(request=0, tag=None, tokens=[3], finish_reason="length", target_calls=1, error=None,
                           prompt_logprobs=asked)
    row = {"completion": "x", "completion_logprobs": [-1.0, -0.25], "prompt_tokens": 5,
           "completion_top_logprobs": [[{"token_id": 1, "logprob": -0.1}] * 3] * 2}
    out = with_vllm_fields(row, finished, settings(logprobs=2, truncate_prompt_tokens=3), [4, 7, 9], 3)
    assert out["prompt_token_ids"] == [4, 7, 9] and out["prompt_tokens"] == 3 and out["cumulative_logprob"] == -1.25
    assert [len(e) for e in out["completion_top_logprobs"]] == [2, 2]
    assert out["prompt_logprobs"] == [None, [{"token_id": 7, "logprob": -0.5, "rank": 1},
                                             {"token_id": 2, "logprob": -1.0, "rank": 2}],
                                      [{"token_id": 9, "logprob": -2.0, "rank": 3},
                                       {"token_id": 5, "logprob": -0.1, "rank": 1},
                                       {"token_id": 6, "logprob": -1.5, "rank": 2}]]
    assert with_vllm_fields({"completion": "x"}, finished, settings(detokenize=False), [1], False)["completion"] == ""


# --- through the worker (no Ray) -------------------------------------------------------------------------------


def worker_rows(tmp_path, lines: list[dict], **overrides) -> tuple[dict[str, dict], object]:
    """The rows of one shard through the worker (no Ray), on the embedded pair, read back from the part file; and
    the worker."""
    from tiny_pair_support import job_config

    from pipeline.generate.config import from_dict
    from pipeline.generate.output import output_schema
    from pipeline.generate.plan import prepare
    from pipeline.generate.worker import ShardGenerator, WorkerJob

    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    raw = job_config(PAIR, data, tmp_path / "out", **{"data.sampling_params_column": "params", "shard_size": 32,
                                                       "spectr.method": "spectr", "spectr.logprobs": 3, **overrides})
    plan = prepare(from_dict(raw))
    (tmp_path / "out").mkdir()
    generator = ShardGenerator(plan.config.model, plan.config.spectr, num_threads=1)
    generator.job = WorkerJob(plan.config.data, plan.source, str(tmp_path / "out"), len(lines),
                              output_schema(plan.id_kind, logprobs=3, kept=plan.source.columns.kept))
    part = generator.generate_shard(plan.shard(0)).file
    return {r["id"]: r for r in pq.read_table(tmp_path / "out" / part).to_pylist()}, generator


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float().log_softmax(-1)  # [T, V]


def check_prompt_logprobs(column, ids, logp, top):
    assert len(column) == len(ids) and column[0] is None
    for i, entries in enumerate(column[1:], start=1):
        token, expected = ids[i], logp[i - 1]
        first = entries[0]
        assert first["token_id"] == token and abs(first["logprob"] - float(expected[token])) < 1e-3
        assert first["rank"] == int((expected > expected[token]).sum()) + 1
        best = expected.topk(top).indices.tolist()
        assert [e["token_id"] for e in entries[1:]] == [t for t in best if t != token]
        assert [e["rank"] for e in entries[1:]] == [r for r, t in enumerate(best, start=1) if t != token]


@needs_pair
@pytest.mark.xfail(not _wired(), strict=True, reason="the worker does not call pipeline.generate.output."
                   "with_vllm_fields yet (issue 51: pipeline/generate/worker.py)")
def test_vllms_row_fields_through_the_worker(tmp_path):
    greedy = {"temperature": 0.0, "max_tokens": 4}
    eos_first = {"max_tokens": 3, "logit_bias": {str(EOS): 100.0}, "ignore_eos": True}
    forced = {"max_tokens": 6, "logit_bias": {"300": 100.0}, "stop_token_ids": [300]}
    prompt = "The quick brown fox jumps over the lazy dog because"
    lines = [{"id": "plogp", "prompt": prompt, "params": {**greedy, "prompt_logprobs": 3}},
             {"id": "plain", "prompt": prompt, "params": greedy},
             {"id": "trunc", "prompt": prompt, "params": {**greedy, "truncate_prompt_tokens": 3}},
             {"id": "special", "prompt": prompt, "params": {**eos_first, "skip_special_tokens": False}},
             {"id": "skipped", "prompt": prompt, "params": eos_first},
             {"id": "specialstop", "prompt": prompt,  # a stop string only the kept special tokens' text holds
              "params": {**eos_first, "max_tokens": 16, "skip_special_tokens": False, "stop": ["<|endoftext|>"]}},
             {"id": "stoptok", "prompt": prompt, "params": forced},
             {"id": "lp", "prompt": prompt, "params": {"max_tokens": 5, "logprobs": 1, "output_kind": 2}},
             {"id": "lp_over", "prompt": prompt, "params": {"max_tokens": 5, "logprobs": 4}},
             {"id": "nodetok", "prompt": prompt, "params": {**greedy, "detokenize": False}}]
    rows, generator = worker_rows(tmp_path, lines)
    tokenizer, target = generator.tokenizer, generator.target
    ids = rows["plain"]["prompt_token_ids"]
    assert ids and all(r["prompt_token_ids"] == ids for k, r in rows.items() if k not in ("trunc", "lp_over"))
    check_prompt_logprobs(rows["plogp"]["prompt_logprobs"], ids, hf_logprobs(target, ids), 3)
    assert rows["plain"]["prompt_logprobs"] is None
    assert rows["plogp"]["completion_token_ids"] == rows["plain"]["completion_token_ids"]  # the law is untouched
    trunc = rows["trunc"]
    assert trunc["prompt_token_ids"] == ids[-3:] and trunc["prompt_tokens"] == 3
    expected = target.generate(torch.tensor([ids[-3:]]), max_new_tokens=4, do_sample=False)[0, 3:].tolist()
    assert trunc["completion_token_ids"] == expected[: len(trunc["completion_token_ids"])]
    assert rows["special"]["completion_token_ids"][0] == EOS
    assert rows["special"]["completion"].startswith(tokenizer.decode([EOS], skip_special_tokens=False)) \
        and tokenizer.decode([EOS], skip_special_tokens=False) != ""
    assert EOS not in tokenizer(rows["skipped"]["completion"], add_special_tokens=False)["input_ids"]
    assert tokenizer.decode([EOS], skip_special_tokens=False) == "<|endoftext|>"
    special = rows["specialstop"]  # found by the feed's early check in the row's own text: it ends at once
    assert special["stop_reason"] == "<|endoftext|>" and special["completion"] == ""
    assert special["target_calls"] == 1  # not 4: the budget's 16 tokens, then cut
    stop = rows["stoptok"]
    assert stop["finish_reason"] == "stop" and stop["stop_token_id"] == 300 and stop["stop_reason"] == "300"
    assert rows["plain"]["stop_token_id"] is None
    lp = rows["lp"]
    assert all(len(entries) == 1 for entries in lp["completion_top_logprobs"])
    assert math.isclose(lp["cumulative_logprob"], sum(lp["completion_logprobs"]), rel_tol=1e-6)
    assert math.isclose(rows["plain"]["cumulative_logprob"], sum(rows["plain"]["completion_logprobs"]), rel_tol=1e-6)
    assert rows["plain"]["completion_top_logprobs"] and len(rows["plain"]["completion_top_logprobs"][0]) == 3
    assert rows["lp_over"]["finish_reason"] == "error" and "spectr.logprobs=3" in rows["lp_over"]["error"]
    assert rows["nodetok"]["completion"] == "" and rows["nodetok"]["completion_token_ids"]


def test_the_feed_passes_prompt_logprobs_to_the_engine_and_to_a_row_rerun_alone():
    """`Row.prompt_logprobs` reaches the batcher (method spectr and auto), and a row re-run alone after a failed
    batch (`ShardFeed._alone`) gets the same values from its own forward."""
    import transformers

    from pipeline.generate.config import SpectrConfig
    from pipeline.generate.feed import EngineConfig, Row, ShardFeed

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    target, draft = transformers.LlamaForCausalLM(config).eval(), transformers.LlamaForCausalLM(config).eval()
    prompt = [3, 17, 42, 8, 1, 9]
    rows = [Row(0, prompt, 4, 1, prompt_logprobs=2), Row(1, prompt, 4, 2), Row(2, [5, 6, 7], 4, 3, prompt_logprobs=0)]
    expected = hf_logprobs(target, prompt)
    for method in ("spectr", "auto"):
        feed = ShardFeed(target, draft, SpectrConfig(method=method, batch_size=4, num_drafts=2, draft_length=2),
                         [63])
        outcomes = feed.run(0, rows).outcomes
        assert outcomes[1].prompt_logprobs is None and outcomes[2].prompt_logprobs.top[1] == []
        got = outcomes[0].prompt_logprobs
        assert got.logprobs[0] is None and len(got.logprobs) == len(prompt)
        assert max(abs(got.logprobs[i] - float(expected[i - 1, prompt[i]])) for i in range(1, len(prompt))) < 1e-4
    alone = feed._alone(EngineConfig("spectr", 2, 2, 16), rows[0]).prompt_logprobs
    assert alone.ranks == got.ranks and [[t for t, _ in e] for e in alone.top] == [[t for t, _ in e] for e in got.top]
    assert max(abs(a - b) for a, b in zip(alone.logprobs[1:], got.logprobs[1:])) < 1e-4


@needs_pair
def test_job_level_top_k_minus_one_is_off(tmp_path):
    """spectr.top_k=-1 (vLLM's "off") is taken and samples as top_k=0: the same tokens, row by row."""
    lines = [{"id": f"r{k}", "prompt": f"Once upon a time {k}", "params": {"max_tokens": 6, "seed": k}}
             for k in range(3)]
    off, _ = worker_rows(tmp_path / "minus_one", lines, **{"spectr.top_k": -1})
    zero, _ = worker_rows(tmp_path / "zero", lines, **{"spectr.top_k": 0})
    assert [off[k]["completion_token_ids"] for k in sorted(off)] == [zero[k]["completion_token_ids"] for k in sorted(zero)]
    assert all(r["error"] is None for r in off.values())
