"""vLLM's row fields in the Ray Data stage (issue 51 §2), each against its vLLM meaning, the actor called directly.

- `truncate_prompt_tokens=k`: `prompt_token_ids` / `num_input_tokens` are the prompt's last k tokens, and the
  greedy tokens are HF's greedy tokens from them; an untruncated row of the same prompt keeps them all.
- `cumulative_logprob`: with `logprobs`, the sum of the sampled tokens' log-probabilities in the `logprobs`
  column (vLLM's); null on a row that did not ask.
- `stop_reason`: vLLM's value and type, an object column: the stop string (str), the stop token's id (int), None
  at the budget.
- `prompt_logprobs=N`: Ray's shape (None first, then {token id: {logprob, rank, decoded_token}} for the prompt
  token and the top N), equal to a plain HF forward's log_softmax; None on rows that do not ask.

The int stop_reason and prompt_logprobs need the worker's `with_vllm_fields` (an expected failure until then).
"""

from __future__ import annotations

import inspect

import pyarrow as pa
import pytest
import torch
from test_ray_data_dropin import chat_pair, stage_config  # noqa: F401 - the module's fixture

from pipeline.ray_data import SpecTrStage

PROMPT = "def value for item in list return the data"


def _wired() -> bool:
    from pipeline.generate.worker import ShardGenerator

    return "with_vllm_fields" in inspect.getsource(ShardGenerator)


@pytest.fixture(scope="module")
def stage(chat_pair):  # noqa: F811 - the fixture imported above
    return SpecTrStage(stage_config(chat_pair))


def generate(stage, rows: list[dict]) -> list[dict]:
    return stage.generate(pa.Table.from_pylist([{"prompt": PROMPT, **row} for row in rows])).to_pylist()


def greedy(model, ids: list[int], count: int) -> list[int]:
    return model.generate(torch.tensor([ids]), max_new_tokens=count, do_sample=False)[0, len(ids):].tolist()


def test_truncation_cumulative_logprob_and_a_stop_string(stage):
    tokenizer, target = stage.generator.tokenizer, stage.generator.target
    ids = tokenizer(PROMPT)["input_ids"]
    stop_word = tokenizer.decode([ids[2]])
    out = generate(stage, [
        {"sampling_params": {"temperature": 0.0, "max_tokens": 4, "truncate_prompt_tokens": 3}},
        {"sampling_params": {"temperature": 0.0, "max_tokens": 4}},
        {"sampling_params": {"max_tokens": 5, "seed": 3, "logprobs": 0}},
        {"sampling_params": {"max_tokens": 6, "seed": 3, "logit_bias": {str(ids[2]): 100.0}, "stop": [stop_word]}},
    ])
    assert [r["__inference_error__"] for r in out] == [""] * 4
    assert out[0]["prompt_token_ids"] == ids[-3:] and out[0]["num_input_tokens"] == 3
    assert out[0]["generated_tokens"] == greedy(target, ids[-3:], 4)[: len(out[0]["generated_tokens"])]
    assert out[1]["prompt_token_ids"] == ids and out[1]["generated_tokens"] == greedy(target, ids, 4)[
        : len(out[1]["generated_tokens"])]
    sampled = [entry[token]["logprob"] for entry, token in zip(out[2]["logprobs"], out[2]["generated_tokens"])]
    assert out[2]["cumulative_logprob"] == pytest.approx(sum(sampled), abs=1e-5)
    assert out[1]["cumulative_logprob"] is None
    assert out[3]["finish_reason"] == "stop" and out[3]["stop_reason"] == stop_word
    assert out[1]["stop_reason"] is None or out[1]["finish_reason"] == "stop"


@pytest.mark.xfail(not _wired(), strict=True, reason="the worker does not call pipeline.generate.output."
                   "with_vllm_fields yet (issue 51: pipeline/generate/worker.py)")
def test_prompt_logprobs_and_an_int_stop_reason(stage):
    tokenizer, target = stage.generator.tokenizer, stage.generator.target
    ids = tokenizer(PROMPT)["input_ids"]
    forced = ids[3]
    out = generate(stage, [
        {"sampling_params": {"temperature": 0.0, "max_tokens": 2, "prompt_logprobs": 2}},
        {"sampling_params": {"temperature": 0.0, "max_tokens": 2}},
        {"sampling_params": {"max_tokens": 6, "logit_bias": {str(forced): 100.0}, "stop_token_ids": [forced]}},
    ])
    assert [r["__inference_error__"] for r in out] == [""] * 3
    stop = out[2]["stop_reason"]
    assert isinstance(stop, int) and stop == forced and out[2]["finish_reason"] == "stop"
    assert out[1]["prompt_logprobs"] is None
    column = out[0]["prompt_logprobs"]
    with torch.no_grad():
        logp = target(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float().log_softmax(-1)
    assert len(column) == len(ids) and column[0] is None
    for i, entry in enumerate(column[1:], start=1):
        token, expected = ids[i], logp[i - 1]
        best = expected.topk(2).indices.tolist()
        assert set(entry) == {token, *best}
        assert entry[token]["logprob"] == pytest.approx(float(expected[token]), abs=1e-3)
        assert entry[token]["rank"] == int((expected > expected[token]).sum()) + 1
        assert entry[token]["decoded_token"] == tokenizer.decode([token])
        assert [entry[t]["rank"] for t in best if t != token] == [r for r, t in enumerate(best, 1) if t != token]
    assert out[0]["generated_tokens"] == out[1]["generated_tokens"]  # the law is untouched
