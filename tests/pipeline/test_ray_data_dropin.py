"""Porting `ray.data.llm` code to the SpecTr stage: Ray's own examples, run with the import and the config class
changed (plus `draft_model_source`, and the model's name for a tiny chat model made here: no hub).

- The `build_processor` docstring's examples (`ray.data.llm.build_processor.__doc__`, Ray 2.60, read from the
  installed package, so they are Ray's text as shipped): the basic one (vLLM `engine_kwargs`,
  `detokenize=False`, 300 rows: slow; its light sibling runs it on 8) and the `builder_kwargs` one
  (`chat_template_kwargs`, `chat_template_stage={"enabled": True}`).
- Ray's minimal quickstart (`doc/source/data/doc_code/working-with-llms/minimal_quickstart.py`, not in the
  installed package: `QUICKSTART` below is that file as of Ray 2.60, reproduced without the source at hand;
  and the guide's basic example, slow), and at temperature 0 the
  tokens of Hugging Face's greedy `generate` on the chat-templated prompt (the control: at temperature 0.7
  they differ).
- The output's columns are Ray's engine stage's (`vLLMOutputData`'s fields and the ones Ray's stage adds),
  with Ray's Python types; `ray.data.llm.build_processor` takes the config.
- `concurrency` as Ray's: n is an autoscaling pool of 1..n actors, measured (slow): the pool grows to 2 actors
  as blocks wait; (1, 1) keeps one (the control). Each actor numbers its requests from 0 (`request_id`, as
  Ray's), so the rows with request_id 0 count the actors.
"""

from __future__ import annotations

import functools
import logging
import re

import pytest
from tiny_pair_support import WORDS, build_llama, build_tokenizer

CHAT_TEMPLATE = ("{% if enable_thinking %}think {% endif %}{% for m in messages %}{{ m['role'] }} : "
                 "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")
EXTRA_WORDS = ("user assistant system : think What is machine learning ? Explain neural networks in one sentence . "
               "You are a calculator ** = 2 + 3 bot that responds with haikus Start of the haiku Complete this for "
               "me ...").split()

# Ray 2.60's doc/source/data/doc_code/working-with-llms/minimal_quickstart.py (the part between its markers), as
# reproduced here: the file is not in the installed package and could not be fetched on this machine

QUICKSTART = '''
import ray
from ray.data.llm import vLLMEngineProcessorConfig, build_processor

# Initialize Ray
ray.init()

# simple dataset
ds = ray.data.from_items([
    {"prompt": "What is machine learning?"},
    {"prompt": "Explain neural networks in one sentence."},
])

# Minimal vLLM configuration
config = vLLMEngineProcessorConfig(
    model_source="unsloth/Llama-3.1-8B-Instruct",
    concurrency=1,  # 1 vLLM engine replica
    batch_size=32,  # 32 samples per batch
    engine_kwargs={
        "max_model_len": 4096,  # Fit into test GPU memory
    }
)

# Build processor
# preprocess: converts input row to format expected by vLLM (OpenAI chat format)
# postprocess: extracts generated text from vLLM output
processor = build_processor(
    config,
    preprocess=lambda row: {
        "messages": [{"role": "user", "content": row["prompt"]}],
        "sampling_params": {"temperature": 0.7, "max_tokens": 100},
    },
    postprocess=lambda row: {
        "prompt": row["prompt"],
        "response": row["generated_text"],
    },
)

# Process the dataset
result = processor(ds)
result.show()
'''


# The basic example of Ray's "Working with LLMs" guide (doc_code/working-with-llms/basic_llm_example.py), reproduced
# as QUICKSTART is
BASIC_LLM_EXAMPLE = '''
import ray
from ray.data.llm import vLLMEngineProcessorConfig, build_processor

config = vLLMEngineProcessorConfig(
    model_source="unsloth/Llama-3.1-8B-Instruct",
    engine_kwargs={
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": 4096,
        "max_model_len": 16384,
    },
    concurrency=1,
    batch_size=64,
)
processor = build_processor(
    config,
    preprocess=lambda row: dict(
        messages=[
            {"role": "system", "content": "You are a bot that responds with haikus."},
            {"role": "user", "content": row["item"]}
        ],
        sampling_params=dict(
            temperature=0.3,
            max_tokens=250,
        )
    ),
    postprocess=lambda row: dict(
        answer=row["generated_text"],
        **row  # This will return all the original columns in the dataset.
    ),
)

ds = ray.data.from_items(["Start of the haiku is: Complete this for me..."])

ds = processor(ds)
ds.show(limit=1)
'''


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    """A tiny random Llama pair with a chat template (and a template variable, `enable_thinking`), with room for
    the examples' 250 new tokens (512 positions)."""
    root = tmp_path_factory.mktemp("chat_pair")
    words = WORDS + EXTRA_WORDS
    tokenizer = build_tokenizer(words, root / "target", chat_template=CHAT_TEMPLATE)
    build_tokenizer(words, root / "draft", chat_template=CHAT_TEMPLATE)
    build_llama(root / "target", len(tokenizer), hidden=32, layers=2, seed=11, max_positions=512)
    build_llama(root / "draft", len(tokenizer), hidden=16, layers=1, seed=12, max_positions=512)
    return {"target": root / "target", "draft": root / "draft"}


def ported(code: str, pair: dict) -> str:
    """Ray's code with the import line and the config class changed (plus draft_model_source), and the model's
    name replaced by the tiny pair's directory: nothing else."""
    code = code.replace("from ray.data.llm import vLLMEngineProcessorConfig, build_processor",
                        "from pipeline.ray_data import SpecTrProcessorConfig, build_processor")
    code = code.replace("vLLMEngineProcessorConfig(", f"SpecTrProcessorConfig(draft_model_source={str(pair['draft'])!r},")
    code, count = re.subn(r'model_source="[^"]+"', f"model_source={str(pair['target'])!r}", code)
    assert count == 1 and "vLLMEngineProcessorConfig" not in code and "ray.data.llm" not in code
    return code


def docstring_examples() -> list[str]:
    """The `.. testcode::` blocks of `ray.data.llm.build_processor`'s docstring, dedented."""
    import textwrap

    from ray.data import llm

    blocks = llm.build_processor.__doc__.split(".. testcode::")[1:]
    out = []
    for block in blocks:
        body = block.split("\n", 1)[1].split(":skipif: True", 1)[1]
        lines = []
        for line in body.splitlines()[1:]:
            if line.strip() and not line.startswith(" " * 12):
                break
            lines.append(line)
        out.append(textwrap.dedent("\n".join(lines)))
    assert len(out) == 3 and "detokenize=False" in out[0] and "builder_kwargs=dict(" in out[2]
    return out


_LAST_NAMESPACE: dict = {}  # the globals of the last code `run` executed


def run(code: str, monkeypatch, capsys=None) -> list:
    """Execute ported code; the rows it prints are returned (the docstring's examples print each row, which
    is kept as it is; the quickstart's `result.show()` prints each row's repr, read back from stdout). Its
    `ray.init()` joins the test session's Ray."""
    import ast

    import ray

    monkeypatch.setattr(ray, "init", functools.partial(ray.init, ignore_reinit_error=True))
    printed: list = []
    namespace = {"print": printed.append}
    if capsys is not None:
        capsys.readouterr()
    exec(compile(code, "ray_example", "exec"), namespace)
    _LAST_NAMESPACE.clear()
    _LAST_NAMESPACE.update(namespace)
    if capsys is not None:
        printed = [ast.literal_eval(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    return printed


def ray_columns() -> set[str]:
    """The columns Ray's vLLM processor writes (its engine stage's output model, the fields its stage adds, the
    tokenize stage's)."""
    from ray.llm._internal.batch.stages.vllm_engine_stage import vLLMOutputData

    return set(vLLMOutputData.model_fields) | {"request_id", "batch_uuid", "time_taken_llm", "params",
                                               "__inference_error__", "tokenized_prompt"}


def check_ray_types(row: dict) -> None:
    """A stage row's values have the Python types Ray's rows have."""
    assert isinstance(row["generated_text"], str) and isinstance(row["prompt"], str)
    for name in ("generated_tokens", "prompt_token_ids", "tokenized_prompt"):
        assert isinstance(row[name], list) and all(type(t) is int for t in row[name]), name
    for name in ("num_input_tokens", "num_generated_tokens", "request_id"):
        assert type(row[name]) is int, name
    assert type(row["time_taken_llm"]) is float and isinstance(row["params"], str)
    assert isinstance(row["batch_uuid"], str) and row["__inference_error__"] == ""
    assert row["embeddings"] is None and row["metrics"] is None and row["prompt_logprobs"] is None
    assert row["num_generated_tokens"] == len(row["generated_tokens"])


def test_the_builder_kwargs_example_runs_with_rays_columns_and_types(ray_local, chat_pair, monkeypatch):
    """The docstring's builder_kwargs example: chat_template_kwargs reach the template (`think` is rendered), and
    the output row (no postprocess) has Ray's columns, with Ray's types, plus SpecTr's."""
    code = ported(docstring_examples()[2], chat_pair)
    rows = run(code, monkeypatch)
    assert len(rows) == 1
    row = rows[0]
    assert ray_columns() <= set(row), sorted(ray_columns() - set(row))
    check_ray_types(row)
    assert row["prompt"] == "think user : What is 2+2? assistant :"  # the template, with enable_thinking
    assert row["logprobs"] is None and row["finish_reason"] in ("stop", "length") and row["sample_index"] == 0
    assert {"finish_reason", "stop_reason", "target_calls", "block_efficiency", "seed"} <= set(row)
    assert row["num_generated_tokens"] <= 100


def check_basic_example(rows: list, count: int, pair: dict) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pair["target"])
    assert sorted(r["id"] for r in rows) == list(range(count))
    for row in rows:  # postprocess kept every column (**row) and added resp
        # detokenize=False: Ray's detokenize stage (on by default) still decodes generated_text
        assert row["resp"] == row["generated_text"] == tokenizer.decode(row["generated_tokens"], skip_special_tokens=True)
        assert row["prompt"] == f"system : You are a calculator user : {row['id']} ** 3 = ? assistant :"
        assert 1 <= row["num_generated_tokens"] <= 20
        check_ray_types(row)


def test_the_basic_docstring_example_runs_on_8_rows(ray_local, chat_pair, monkeypatch, caplog):
    """The light sibling of the next test: the basic example with `ray.data.range(8)` for its 300 rows. vLLM's
    engine settings are accepted with one warning naming them."""
    import pipeline.ray_data.config as settings

    monkeypatch.setattr(settings, "_warned", set())  # a warning is given once per process
    code = ported(docstring_examples()[0], chat_pair)
    assert "ds = ray.data.range(300)" in code
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        rows = run(code.replace("ray.data.range(300)", "ray.data.range(8)"), monkeypatch)
    check_basic_example(rows, 8, chat_pair)
    warned = [r.getMessage() for r in caplog.records if "no use in the SpecTr engine" in r.getMessage()]
    assert warned and "enable_chunked_prefill, enable_prefix_caching, max_num_batched_tokens" in warned[0]


@pytest.mark.slow  # its light sibling: test_the_basic_docstring_example_runs_on_8_rows
def test_the_basic_docstring_example_runs_as_written(ray_local, chat_pair, monkeypatch):
    rows = run(ported(docstring_examples()[0], chat_pair), monkeypatch)
    check_basic_example(rows, 300, chat_pair)


def hf_greedy(pair: dict, messages: list, max_new_tokens: int) -> list[int]:
    """Hugging Face's greedy tokens on the chat-templated prompt (EOS included, as the stage's)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pair["target"])
    model = AutoModelForCausalLM.from_pretrained(pair["target"], torch_dtype=torch.float32)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # as apply_chat_template(tokenize=True)
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=2,
                         pad_token_id=3)
    return out[0, len(ids):].tolist()


def test_rays_quickstart_runs_and_gives_hf_greedy_tokens_at_temperature_0(ray_local, chat_pair, monkeypatch,
                                                                        capsys):
    """Ray's minimal quickstart as written (ported), then at temperature 0 with the tokens kept: HF's greedy
    tokens on each chat-templated prompt. Control: the quickstart's own temperature 0.7 gives other text than
    HF's greedy tokens do."""
    from transformers import AutoTokenizer

    code = ported(QUICKSTART, chat_pair)
    rows = run(code, monkeypatch, capsys)
    questions = ["What is machine learning?", "Explain neural networks in one sentence."]
    assert [r["prompt"] for r in rows] == [f"user : {q} assistant :" for q in questions]  # Ray's: the rendered prompt
    assert all(isinstance(r["response"], str) and set(r) == {"prompt", "response"} for r in rows)
    greedy = run(code.replace('"temperature": 0.7', '"temperature": 0.0').replace(
        "result.show()", "rows = result.take_all()").replace(
        '"response": row["generated_text"],', '"response": row["generated_text"], "tokens": row["generated_tokens"],'),
        monkeypatch, None)
    assert greedy == []
    tokenizer = AutoTokenizer.from_pretrained(chat_pair["target"])
    expected = [hf_greedy(chat_pair, [{"role": "user", "content": q}], 100) for q in questions]
    greedy_rows = _LAST_NAMESPACE["rows"]
    assert [r["tokens"] for r in greedy_rows] == expected
    assert [r["response"] for r in greedy_rows] == [tokenizer.decode(t, skip_special_tokens=True) for t in expected]
    assert [r["response"] for r in rows] != [r["response"] for r in greedy_rows]  # the control


@pytest.mark.slow  # the quickstart above is the default suite's
def test_rays_basic_llm_example_runs(ray_local, chat_pair, monkeypatch, capsys):
    """The guide's basic example, ported: one row, the system and user messages rendered, `answer` added."""
    code = ported(BASIC_LLM_EXAMPLE, chat_pair)
    exec_rows = run(code, monkeypatch, capsys)  # ds.show(limit=1) prints the row
    assert len(exec_rows) == 1
    row = exec_rows[0]
    assert row["answer"] == row["generated_text"] and row["item"] == "Start of the haiku is: Complete this for me..."
    assert row["prompt"] == ("system : You are a bot that responds with haikus. user : Start of the haiku is: "
                             "Complete this for me... assistant :")
    check_ray_types(row)


def test_rays_own_build_processor_takes_the_config(chat_pair):
    """`ray.data.llm.build_processor(config, ..., builder_kwargs=...)` with this config: Ray's keyword
    forwarding reaches this builder (chat_template_kwargs included)."""
    from ray.data.llm import build_processor as ray_build_processor

    from pipeline.ray_data import SpecTrProcessor, SpecTrProcessorConfig

    config = SpecTrProcessorConfig(model_source=str(chat_pair["target"]), draft_model_source=str(chat_pair["draft"]))
    processor = ray_build_processor(config, preprocess=lambda row: row, postprocess_map_kwargs={"num_cpus": 0.25},
                                    builder_kwargs=dict(chat_template_kwargs={"enable_thinking": True}))
    assert isinstance(processor, SpecTrProcessor) and processor.postprocess_map_kwargs == {"num_cpus": 0.25}
    assert processor.config.chat().chat_template_kwargs == {"enable_thinking": True}


@pytest.mark.slow  # the config's pool sizes are checked in test_ray_data.py::test_config_checks
def test_concurrency_n_is_an_autoscaling_pool_that_grows(ray_local, chat_pair):
    """concurrency=2 (Ray's meaning: 1..2 actors) on 24 one-row blocks of 200 tokens: the pool starts with one
    actor and grows to 2 while blocks wait on it; concurrency=(1, 1) keeps one (the control). Each actor's
    first row has request_id 0."""
    import ray

    from pipeline.ray_data import SpecTrProcessorConfig, build_processor

    actors = {}
    for concurrency in (2, (1, 1)):
        config = SpecTrProcessorConfig(model_source=str(chat_pair["target"]), draft_model_source=str(chat_pair["draft"]),
                                       concurrency=concurrency, batch_size=1, num_cpus=0.5,
                                       engine_kwargs={"method": "speculative", "batch_size": 1})
        processor = build_processor(config, preprocess=lambda row: {"prompt": "the cat", "sampling_params":
                                                                    {"max_tokens": 200, "ignore_eos": True}})
        rows = processor(ray.data.range(24)).take_all()
        assert len(rows) == 24
        actors[str(concurrency)] = sum(r["request_id"] == 0 for r in rows)
    assert actors == {"2": 2, "(1, 1)": 1}


def stage_config(pair: dict, **overrides):
    from pipeline.ray_data import SpecTrProcessorConfig

    fields = dict(model_source=str(pair["target"]), draft_model_source=str(pair["draft"]), batch_size=8,
                  should_continue_on_error=True,
                  engine_kwargs={"method": "spectr", "num_drafts": 2, "draft_length": 2, "batch_size": 4,
                                 "dtype": "float32"})
    return SpecTrProcessorConfig(**{**fields, **overrides})


def test_stage_only_sampling_keys_logprobs_and_prompt_sources(chat_pair):
    """Without Ray (the actor called directly), with the detokenize and tokenize stages off: skip_special_tokens
    and detokenize as vLLM's engine writes text (each against its default: the control), logprobs=N in Ray's
    shape from the engine's top max_logprobs, an assistant prefill continued (Ray's template rule), a row's own
    tokenized_prompt, and the rows that cannot run failing alone, each naming why."""
    import pyarrow as pa

    from pipeline.ray_data import SpecTrStage

    config = stage_config(chat_pair, detokenize_stage=False, tokenize_stage=False,
                          engine_kwargs={**stage_config(chat_pair).engine_kwargs, "max_logprobs": 3})
    stage = SpecTrStage(config)
    eos_first = {"max_tokens": 4, "seed": 1, "logit_bias": {"2": 100.0}}  # the first token is EOS, a special token
    rows = [
        {"prompt": "the cat", "sampling_params": {**eos_first, "skip_special_tokens": False}},
        {"prompt": "the cat", "sampling_params": eos_first},
        {"prompt": "the cat", "sampling_params": {"max_tokens": 4, "seed": 1, "detokenize": False}},
        {"prompt": "the cat", "sampling_params": {"max_tokens": 4, "seed": 1, "output_kind": 2,
                                                  "spaces_between_special_tokens": True}},  # no token changes
        {"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "def"}],
         "sampling_params": {"max_tokens": 3, "seed": 2}},
        {"tokenized_prompt": [1, 5, 6], "sampling_params": {"max_tokens": 3, "seed": 3}},
        {"prompt": "the cat", "sampling_params": {"max_tokens": 5, "seed": 4, "logprobs": 3}},
        {"prompt": "the cat", "sampling_params": {"max_tokens": 5, "logprobs": 5}},
        {"prompt": None, "sampling_params": {"max_tokens": 5}},
        {"prompt": "the cat", "sampling_params": {"prompt_logprobs": 21}},
    ]
    keys = {key: None for row in rows for key in row}  # every column in every row (from_pylist reads the first)
    out = stage.generate(pa.Table.from_pylist([{**keys, **row} for row in rows])).to_pylist()
    errors = [r["__inference_error__"] for r in out]
    assert errors[:7] == [""] * 7, errors
    assert out[0]["generated_tokens"] == [2] and out[0]["generated_text"] == "</s>" and out[1]["generated_text"] == ""
    assert out[2]["generated_text"] == "" and out[2]["generated_tokens"] == out[3]["generated_tokens"]
    assert out[3]["generated_text"] == stage.generator.tokenizer.decode(out[3]["generated_tokens"],
                                                                        skip_special_tokens=True) != ""
    assert out[4]["prompt"] == "user : the cat assistant : def"  # continued, no new generation prompt
    # one batch, two tokenizations: the plain prompt with the tokenizer's BOS (Ray's tokenize stage), the rendered
    # chat prompt without (its template writes its own, as apply_chat_template(tokenize=True))
    tok = stage.generator.tokenizer
    assert out[3]["prompt_token_ids"] == tok("the cat")["input_ids"] and out[3]["prompt_token_ids"][0] == 1
    assert out[4]["prompt_token_ids"] == tok(out[4]["prompt"], add_special_tokens=False)["input_ids"]
    assert out[5]["prompt_token_ids"] == [1, 5, 6] and "tokenized_prompt" not in output_columns(stage)
    lp = out[6]["logprobs"]
    assert len(lp) == out[6]["num_generated_tokens"] == 5
    for entry, token in zip(lp, out[6]["generated_tokens"]):
        assert token in entry and 1 <= len(entry) <= 4
        others = sorted((v["rank"], v["logprob"]) for t, v in entry.items() if t != token)
        assert [rank for rank, _ in others] == sorted(set(range(1, 4)) - {entry[token]["rank"]})[: len(others)]
        assert all(a[1] >= b[1] for a, b in zip(others, others[1:]))  # ranked by log-probability
        assert entry[token]["logprob"] <= 0
    assert "engine_kwargs max_logprobs (3" in errors[7]
    assert "prompt is null, and the row has no 'messages'" in errors[8] and "'tokenized_prompt'" in errors[8]
    assert "prompt_logprobs must be in [0, 20]" in errors[9]  # vLLM's max_logprobs (test_ray_data_fields: values)
    assert [r["request_id"] for r in out] == list(range(7)) + [-1] * 3  # per actor, -1 on a failed row


def output_columns(stage) -> set[str]:
    from pipeline.ray_data.stage import output_types

    return set(output_types(stage.tokenize_stage))


def test_engine_kwargs_and_stage_settings_are_checked_with_reasons(chat_pair, caplog):
    """vLLM engine settings: ignored ones named in one warning, meaning-changing ones refused with the reason,
    unknown ones refused; max_num_seqs is the engine's rows in flight; Ray's stage configs (bool, dict, Ray's own
    objects) are read, their resource keys named in a warning, a key Ray's stage config does not have refused."""
    from ray.data.llm import ChatTemplateStageConfig

    base = stage_config(chat_pair).engine_kwargs
    with pytest.raises(ValueError, match=r"quantization='awq' \(quantized weights are another model"):
        stage_config(chat_pair, engine_kwargs={**base, "quantization": "awq"})
    with pytest.raises(ValueError, match="tensor_parallel_size=2 .*num_gpus=N and engine_kwargs device_map='auto'"):
        stage_config(chat_pair, engine_kwargs={**base, "tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="unknown engine_kwargs nope; known: method"):
        stage_config(chat_pair, engine_kwargs={**base, "nope": 1})
    with pytest.raises(ValueError, match="task_type 'embed'"):
        stage_config(chat_pair, task_type="embed")
    with pytest.raises(ValueError, match="prepare_multimodal_stage=True is not supported: multimodal rows"):
        stage_config(chat_pair, prepare_multimodal_stage=True)
    with pytest.raises(ValueError, match="placement_group_config=.* is not supported: an actor's GPUs are num_gpus"):
        stage_config(chat_pair, placement_group_config={"bundles": [{"GPU": 1}]})
    # Ray's fields at their defaults, as ported code may write them, are accepted
    stage_config(chat_pair, prepare_multimodal_stage={"enabled": False}, placement_group_config=None,
                 dynamic_lora_loading_path=None, log_engine_metrics=True, max_pending_requests=None)
    with pytest.raises(ValueError, match="chat_template_stage: unknown key\\(s\\) nope; known: enabled"):
        stage_config(chat_pair, chat_template_stage={"nope": 1})
    with pytest.raises(ValueError, match="tokenize_stage.model_source 'other/model' is not model_source"):
        stage_config(chat_pair, tokenize_stage={"model_source": "other/model"})
    config = stage_config(chat_pair, engine_kwargs={**{k: v for k, v in base.items() if k != "batch_size"},
                                                    "max_num_seqs": 5, "tensor_parallel_size": 1})
    assert config.spectr_config().batch_size == 5
    import pipeline.ray_data.config as settings

    settings._warned.clear()  # a warning is given once per process
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        config = stage_config(chat_pair, chat_template_stage=ChatTemplateStageConfig(
            batch_size=16, chat_template_kwargs={"enable_thinking": True}), engine_kwargs={**base, "max_model_len": 9})
    messages = [r.getMessage() for r in caplog.records]
    assert any("chat_template_stage.batch_size not applied" in m for m in messages), messages
    assert any("engine_kwargs max_model_len are vLLM engine settings" in m for m in messages), messages
    assert config.chat().chat_template_kwargs == {"enable_thinking": True} and config.chat().enabled
    from pipeline.ray_data import build_processor

    runtime_env = {"env_vars": {"SPECTR_X": "1"}, "py_modules": ["pipeline"]}  # Ray's field, to the stage's actors
    assert build_processor(stage_config(chat_pair, runtime_env=runtime_env)).stage_map_kwargs(gpus=False)[
        "runtime_env"] == runtime_env
    assert not stage_config(chat_pair, chat_template_stage=False).chat().enabled
    assert not stage_config(chat_pair, apply_chat_template=False).chat().enabled
