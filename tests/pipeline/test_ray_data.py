"""The Ray Data stage (`pipeline.ray_data`): the actor called directly, then one real pipeline on the local Ray.

Direct (no Ray; the actor's `generate` / `__call__` on pyarrow batches): per-row settings and seeds give
`spectr.generate`'s tokens (a wrong seed does not: the negative control); two concurrent Ray Data batches
share the actor's one continuous batch (fewer engine iterations than one after the other, same tokens);
chat rows with `chat_template_kwargs` (the template's variable changes the prompt ids; without it they
differ); failed rows carry `__inference_error__` or, without `should_continue_on_error`, fail the batch;
the config's checks. On Ray (one session-wide local Ray): `read_parquet` from moto's S3 server -> preprocess
-> the stage -> postprocess -> `write_parquet`: every row once, the columns, per-row `max_tokens`, the
tokens, the error row bypassing postprocess; and `ray.data.llm.build_processor` taking the same config.
Slow: the chat example on two actors through Ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from s3_support import moto_s3
from tiny_pair_support import WORDS

from pipeline import fs
from pipeline.generate.shards import row_seed
from pipeline.ray_data import SpecTrProcessor, SpecTrProcessorConfig, SpecTrStage, build_processor
from pipeline.ray_data.stage import ERROR_COLUMN, RowsFailed, output_types

ENGINE = {"method": "spectr", "num_drafts": 2, "draft_length": 3, "batch_size": 4, "max_new_tokens": 8,
          "dtype": "float32"}


def config_for(tiny_pair, **overrides) -> SpecTrProcessorConfig:
    fields = dict(model_source=str(tiny_pair["target"]), draft_model_source=str(tiny_pair["draft"]),
                  batch_size=4, engine_kwargs=dict(ENGINE), should_continue_on_error=True)
    return SpecTrProcessorConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def stage(tiny_pair) -> SpecTrStage:
    return SpecTrStage(config_for(tiny_pair))


def reference(stage: SpecTrStage, prompt_ids: list[int], seed: int, max_tokens: int, **warp) -> list[int]:
    """spectr.generate on one prompt with the stage's engine settings."""
    import spectr

    g = stage.generator
    s = g.spectr
    out = spectr.generate(g.target, g.draft, [prompt_ids], method=s.method, num_drafts=s.num_drafts,
                          draft_length=s.draft_length, max_new_tokens=max_tokens, eos_token_id=g.eos_token_id,
                          seed=seed, **warp)
    return list(out.tokens[0])


def words(rng: random.Random, low: int = 2, high: int = 8) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def test_rows_get_spectr_generates_tokens_for_their_seed_and_settings(stage):
    rng = random.Random(1)
    rows = [
        {"id": 10, "prompt": words(rng), "sampling_params": {"max_tokens": 5, "seed": 3, "logprobs": True}},
        {"id": 11, "prompt": words(rng), "sampling_params": {"max_tokens": 2}},
        {"id": 12, "prompt": words(rng), "sampling_params": {"max_tokens": 7, "temperature": 0.5, "top_k": 5}},
        {"id": None, "prompt": words(rng), "sampling_params": {"seed": 4}},  # no id: its own seed
    ]
    out = stage.generate(pa.Table.from_pylist(rows)).to_pylist()
    assert [r["id"] for r in out] == [10, 11, 12, None]
    assert all(set(output_types()) | {ERROR_COLUMN, "sampling_params", "prompt"} <= set(r) for r in out)
    tok = stage.generator.tokenizer
    seeds = [3, row_seed(0, 11), row_seed(0, 12), 4]
    budgets = [5, 2, 7, 8]
    warps = [{}, {}, {"temperature": 0.5, "top_k": 5}, {}]
    for row, seed, budget, warp in zip(out, seeds, budgets, warps):
        assert row["prompt_token_ids"] == tok(row["prompt"])["input_ids"]
        assert row["num_input_tokens"] == len(row["prompt_token_ids"])
        assert row["generated_tokens"] == reference(stage, row["prompt_token_ids"], seed, budget, **warp)
        assert row["num_generated_tokens"] == len(row["generated_tokens"]) <= budget
        assert row["finish_reason"] in ("stop", "length") and row[ERROR_COLUMN] == ""
        assert row["target_calls"] >= 1 and row["time_taken_llm"] >= 0
    # Ray's shape: per token {token id: {logprob, rank, decoded_token}}, the sampled token's (logprobs=True: alone)
    assert [list(entry) for entry in out[0]["logprobs"]] == [[t] for t in out[0]["generated_tokens"]]
    assert all(e[t]["logprob"] <= 0 and e[t]["decoded_token"] == tok.decode([t])
               for e, t in zip(out[0]["logprobs"], out[0]["generated_tokens"]))
    assert [r["logprobs"] for r in out[1:]] == [None] * 3  # only where sampling_params asks
    assert [r["seed"] for r in out] == seeds  # the seed column reproduces each row
    # negative control: another seed gives other tokens (the comparison above can fail)
    others = [reference(stage, r["prompt_token_ids"], s + 1, b, **w) for r, s, b, w in zip(out, seeds, budgets, warps)]
    assert others != [r["generated_tokens"] for r in out]


def test_rows_without_id_or_seed_are_independent_samples_like_vllms_seed_none(stage):
    """No id and no sampling_params.seed: a fresh seed per row (vLLM's seed=None), so copies of a prompt are
    independent samples; the control: copies with one explicit seed are all the same."""
    prompt = "the cat sat on"
    fresh = stage.generate(pa.Table.from_pylist([{"prompt": prompt, "sampling_params": {"max_tokens": 6}}] * 8))
    seeded = stage.generate(pa.Table.from_pylist([{"prompt": prompt, "sampling_params": {"max_tokens": 6,
                                                                                      "seed": 9}}] * 8))
    assert len({tuple(r["generated_tokens"]) for r in fresh.to_pylist()}) > 1
    assert len({tuple(r["generated_tokens"]) for r in seeded.to_pylist()}) == 1


def test_a_row_with_n_gives_n_rows_seeded_as_the_jobs_samples(stage):
    """vLLM's `n` in sampling_params: n output rows of that row (its columns repeated, sample_index 0..n-1), each
    the tokens of spectr.generate with the job's sample seed; the other rows keep their one row, in order."""
    from pipeline.generate.shards import sample_seed

    rows = [{"id": 20, "prompt": "the cat sat on", "sampling_params": {"n": 3, "max_tokens": 5}, "tag": "a"},
            {"id": 21, "prompt": "a dog ran to the", "sampling_params": {"max_tokens": 5}, "tag": "b"},
            {"id": 22, "prompt": "one two three", "sampling_params": {"n": 2, "max_tokens": 5, "seed": 7}, "tag": "c"}]
    out = stage.generate(pa.Table.from_pylist(rows)).to_pylist()
    assert [(r["id"], r["sample_index"], r["tag"]) for r in out] == [
        (20, 0, "a"), (20, 1, "a"), (20, 2, "a"), (21, 0, "b"), (22, 0, "c"), (22, 1, "c")]
    seeds = [sample_seed(row_seed(0, 20), k) for k in range(3)] + [row_seed(0, 21)] + [sample_seed(7, k) for k in (0, 1)]
    for row, seed in zip(out, seeds):
        assert row[ERROR_COLUMN] == "" and row["prompt_token_ids"] == stage.generator.tokenizer(row["prompt"])["input_ids"]
        assert row["generated_tokens"] == reference(stage, row["prompt_token_ids"], seed, 5)
    assert len({tuple(r["generated_tokens"]) for r in out[:3]}) > 1  # independent samples


def test_the_stage_reads_like_ray_data_llm(tiny_pair, tmp_path):
    """ray.data.llm's surface: builder_kwargs, log_input_column_names, stop_reason; a missing local model path is
    refused on the driver naming it (a hub id or an s3:// URI is passed on to loading); the engine's rows in flight
    default by device."""
    config = config_for(tiny_pair)
    processor = build_processor(config, postprocess_map_kwargs={"num_cpus": 0.5},
                                builder_kwargs={"chat_template_kwargs": {"enable_thinking": False}})
    assert processor.postprocess_map_kwargs == {"num_cpus": 0.5}
    assert processor.config.chat().chat_template_kwargs == {"enable_thinking": False}
    assert processor.log_input_column_names()[:2] == ["messages (rendered with the chat template)",
                                                      "prompt (when a row has no messages)"]
    with pytest.raises(TypeError, match="unknown builder_kwargs nope; known: chat_template_kwargs"):
        build_processor(config, builder_kwargs={"nope": 1})
    with pytest.raises(ValueError, match="builder_kwargs cannot contain postprocess_map_kwargs"):  # Ray's rule
        build_processor(config, builder_kwargs={"postprocess_map_kwargs": {}})
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(ValueError, match=f"model_source '{missing}' is a local path that does not exist"):
        dataclasses.replace(config, model_source=str(missing))
    from pipeline.ray_data.config import missing_local_path

    missing_local_path("model_source", "Qwen/Qwen2.5-0.5B")  # a hub id: passed on
    missing_local_path("model_source", "s3://bucket/models/target")
    plain = config_for(tiny_pair, engine_kwargs={"method": "speculative"})
    assert plain.spectr_config().batch_size == 8 and plain.spectr_config(gpu=True).batch_size == 64
    assert "stop_reason" in output_types() and "logprobs" in output_types()


def test_a_stop_string_cuts_the_completion(stage):
    row = {"prompt": "def x in y", "sampling_params": {"max_tokens": 8, "seed": 11}}
    full = stage.generate(pa.Table.from_pylist([row])).to_pylist()[0]
    words_out = full["generated_text"].split()
    assert len(words_out) >= 3
    stop = words_out[2]
    cut = stage.generate(pa.Table.from_pylist([{**row, "sampling_params": {**row["sampling_params"],
                                                                           "stop": [stop]}}])).to_pylist()[0]
    assert cut["finish_reason"] == "stop" and stop not in cut["generated_text"] and cut["stop_reason"] == stop
    assert full["generated_text"].startswith(cut["generated_text"])
    assert cut["generated_tokens"] == full["generated_tokens"][: cut["num_generated_tokens"]]


def test_concurrent_batches_share_one_continuous_batch(tiny_pair):
    """Two Ray Data batches in flight on one actor: the second's rows take the slots the first's free, so
    the engine runs fewer iterations than for the two one after the other; the tokens are the same."""
    engine = {**ENGINE, "method": "autoregressive"}  # one token per iteration: iterations count tokens
    stage = SpecTrStage(config_for(tiny_pair, engine_kwargs=engine, max_concurrent_batches=2))
    rng = random.Random(2)
    batches = [pa.Table.from_pylist([{"id": 4 * b + i, "prompt": words(rng), "sampling_params":
                                      {"max_tokens": 1 if (b + i) % 2 else 8}} for i in range(4)])
               for b in range(2)]
    feed = stage.generator.feed
    start = feed.steps
    apart = [stage.generate(batch).to_pylist() for batch in batches]
    sequential = feed.steps - start

    async def together():
        return await asyncio.gather(*(stage(batch) for batch in batches))

    start = feed.steps
    shared = [table.to_pylist() for table in asyncio.run(together())]
    concurrent = feed.steps - start
    assert [[r["generated_tokens"] for r in b] for b in shared] == [[r["generated_tokens"] for r in b] for b in apart]
    assert concurrent < sequential, (concurrent, sequential)
    assert feed.allocations == 1  # one cache pool for every batch


def test_method_auto_runs_the_planners_batcher(tiny_pair):
    stage = SpecTrStage(config_for(tiny_pair, engine_kwargs={**ENGINE, "method": "auto", "max_num_drafts": 2,
                                                             "max_draft_length": 2}))
    rows = [{"prompt": "def x in y", "sampling_params": {"max_tokens": m}} for m in (3, 6)]
    out = stage.generate(pa.Table.from_pylist(rows)).to_pylist()
    assert [r["num_generated_tokens"] for r in out] == [3, 6] or any(r["finish_reason"] == "stop" for r in out)
    assert type(stage.generator.feed.batcher).__name__ == "AutoBatcher"


def test_chat_rows_use_the_template_and_its_kwargs(tiny_pair, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(tiny_pair["target"], target)
    settings = json.loads((target / "tokenizer_config.json").read_text())
    settings["chat_template"] = ("{% if lead %}{{ lead }} {% endif %}{% for m in messages %}{{ m['role'] }} : "
                                 "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")
    (target / "tokenizer_config.json").write_text(json.dumps(settings))
    (target / "chat_template.jinja").unlink(missing_ok=True)
    messages = [{"role": "user", "content": "def x in y"}]
    batch = pa.Table.from_pylist([{"messages": messages, "sampling_params": {"max_tokens": 3, "seed": 5}}])
    ids = {}
    for lead in ("import", None):
        kwargs = {"lead": lead} if lead else None
        stage = SpecTrStage(config_for(tiny_pair, model_source=str(target), apply_chat_template=True,
                                       chat_template_kwargs=kwargs))
        row = stage.generate(batch).to_pylist()[0]
        text = ("import " if lead else "") + "user : def x in y assistant :"
        assert row["prompt_token_ids"] == stage.generator.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert row["generated_tokens"] == reference(stage, row["prompt_token_ids"], 5, 3)
        assert row["messages"] == messages
        ids[lead] = row["prompt_token_ids"]
    assert ids["import"] != ids[None]  # negative control: the kwargs reach the template


def test_failed_rows_carry_their_error_or_fail_the_batch(stage):
    rows = [
        {"prompt": None, "sampling_params": None},
        {"prompt": "def x", "sampling_params": {"temperature": -1.0}},
        {"prompt": "def x", "sampling_params": {"best_of": 2}},  # cannot be exact: refused with the reason
        {"prompt": " ".join(["x"] * 70), "sampling_params": None},  # longer than the model's 64 positions
        {"prompt": "return value", "sampling_params": {"max_tokens": 3, "ignore_eos": True}},  # 3 tokens, always
    ]
    out = stage.generate(pa.Table.from_pylist(rows)).to_pylist()
    errors = [r[ERROR_COLUMN] for r in out]
    assert "prompt is null" in errors[0] and "temperature must be >= 0" in errors[1]
    assert "best_of" in errors[2] and errors[3] and errors[4] == ""
    assert [r["finish_reason"] for r in out[:4]] == ["error"] * 4 and out[4]["num_generated_tokens"] == 3
    lenient = stage.config
    stage.config = dataclasses.replace(lenient, should_continue_on_error=False)
    try:
        with pytest.raises(RowsFailed, match="4 of 5 rows failed; the first: .*prompt is null"):
            stage.generate(pa.Table.from_pylist(rows))
    finally:
        stage.config = lenient


def test_config_checks(tiny_pair):
    with pytest.raises(ValueError, match="unknown engine_kwargs n; known: method"):
        config_for(tiny_pair, engine_kwargs={"n": 2})
    with pytest.raises(ValueError, match="spectr.method must be one of"):
        config_for(tiny_pair, engine_kwargs={"method": "beam"})
    with pytest.raises(ValueError, match="concurrency must be"):
        config_for(tiny_pair, concurrency=(3, 2))
    with pytest.raises(ValueError, match="chat_template_kwargs must be a dict"):
        config_for(tiny_pair, chat_template_kwargs="enable_thinking")
    assert config_for(tiny_pair, engine_kwargs={"method": "block", "num_drafts": 4}).spectr_config().num_drafts == 1
    processor = build_processor(config_for(tiny_pair, concurrency=(1, 3), accelerator_type="H100"))
    kwargs = processor.stage_map_kwargs(gpus=False)
    assert kwargs["num_gpus"] == 1 and kwargs["accelerator_type"] == "H100"
    assert (kwargs["compute"].min_size, kwargs["compute"].max_size) == (1, 3)
    # Ray's concurrency: n is an autoscaling pool of 1..n actors, (n, n) a fixed one
    for concurrency, sizes in ((3, (1, 3)), ((2, 2), (2, 2))):
        compute = build_processor(config_for(tiny_pair, concurrency=concurrency)).stage_map_kwargs(gpus=False)["compute"]
        assert (compute.min_size, compute.max_size) == sizes
    # batches of 4 rows, 4 engine slots: one batch fills them, one more refills them; a fixed pool queues none
    # beyond; an autoscaling one as many again (Ray Data grows a pool only while batches wait on its actors)
    assert kwargs["max_concurrency"] == 2 and kwargs["compute"].max_tasks_in_flight_per_actor == 4
    fixed = build_processor(config_for(tiny_pair, concurrency=(2, 2))).stage_map_kwargs(gpus=False)
    assert fixed["compute"].max_tasks_in_flight_per_actor == fixed["max_concurrency"] == 2
    small = config_for(tiny_pair, batch_size=3, engine_kwargs={"batch_size": 8})  # 3 batches fill 8 slots, + 1
    assert small.batches_in_flight() == 4 and dataclasses.replace(small, max_concurrent_batches=3).batches_in_flight() == 3
    assert build_processor(config_for(tiny_pair, num_cpus=2)).stage_map_kwargs(gpus=False)["num_cpus"] == 2
    split = config_for(tiny_pair, num_gpus=2, engine_kwargs={**ENGINE, "device_map": "auto"})
    assert split.model_config().device_map == "auto" and build_processor(split).stage_map_kwargs(gpus=True)["num_gpus"] == 2
    with pytest.raises(ValueError, match="num_gpus must be an int >= 1"):
        config_for(tiny_pair, num_gpus=0)


@pytest.fixture(scope="module")
def s3_prompts(tmp_path_factory):
    """moto's S3 server with a bucket 'prompts'; the AWS variables point at it meanwhile."""
    with moto_s3(tmp_path_factory.mktemp("moto_ray_data"), ("prompts",)) as (url, _):
        yield url


@pytest.mark.slow  # the default suite's budget (8 min on 2 cores); see docs/testing.md
def test_read_parquet_from_s3_stage_write_parquet(ray_local, s3_prompts, stage, tiny_pair, tmp_path):
    import ray

    rng = random.Random(3)
    rows = [{"id": i, "text": None if i == 3 else words(rng), "budget": 1 + i % 8, "tag": f"t{i}"} for i in range(10)]
    location = fs.resolve("s3://prompts/in/rows.parquet", "data.path")
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    fs.write_bytes(location, sink.getvalue().to_pybytes())

    def preprocess(row):
        seed = 100 + row["id"] if row["id"] % 2 == 0 else None
        return {"prompt": row["text"], "sampling_params": {"max_tokens": row["budget"], "seed": seed,
                                                           "logprobs": row["id"] == 2}}

    def postprocess(row):  # Ray's logprobs (token id -> {logprob, ...} per token) as the sampled tokens' floats
        floats = None if row["logprobs"] is None else [next(iter(e.values()))["logprob"] for e in row["logprobs"]]
        return {**row, "answer_words": len(row["generated_text"].split()), "logprobs": floats}

    config = config_for(tiny_pair, max_concurrent_batches=2, num_cpus=1)
    processor = build_processor(config, preprocess=preprocess, postprocess=postprocess)
    dataset = ray.data.read_parquet(location.path, filesystem=location.filesystem)
    processor(dataset).write_parquet(str(tmp_path / "out"))

    out = sorted(pq.read_table(tmp_path / "out").to_pylist(), key=lambda r: r["id"])
    assert [r["id"] for r in out] == list(range(10))  # every row once
    failed = out[3]
    assert "prompt is null" in failed[ERROR_COLUMN] and failed["answer_words"] is None  # bypassed postprocess
    for row in out[:3] + out[4:]:
        assert {"text", "budget", "tag", "prompt", "sampling_params", "answer_words", ERROR_COLUMN} <= set(row)
        assert set(output_types()) <= set(row) and row[ERROR_COLUMN] == ""
        assert row["num_generated_tokens"] <= row["budget"]
        seed = row["sampling_params"]["seed"]
        seed = row_seed(0, row["id"]) if seed is None else seed
        assert row["generated_tokens"] == reference(stage, row["prompt_token_ids"], seed, row["budget"])
        assert row["answer_words"] == len(row["generated_text"].split())
    assert len(out[2]["logprobs"]) == out[2]["num_generated_tokens"]
    assert all(r["logprobs"] is None for r in out if r["id"] != 2)


def test_ray_data_llm_build_processor_takes_the_config(tiny_pair):
    from ray.data.llm import build_processor as ray_build_processor

    config = config_for(tiny_pair)
    processor = ray_build_processor(config, postprocess=lambda row: row)
    assert isinstance(processor, SpecTrProcessor) and processor.config is config


@pytest.mark.slow
def test_chat_example_on_two_actors(ray_local, tiny_pair, tmp_path):
    """The chat example of docs/ray-data.md: messages + chat_template_kwargs, two actors, local Parquet in and out (the
    actors take half a CPU each: Ray Data's read and write tasks need the local Ray's other CPU). The file is
    one block as read; the processor cuts it into batches of `batch_size` rows for the actors."""
    import ray

    rng = random.Random(4)
    rows = [{"id": i, "question": words(rng)} for i in range(16)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    config = config_for(tiny_pair, concurrency=2, apply_chat_template=True, num_cpus=0.5,
                        chat_template_kwargs={"enable_thinking": False}, should_continue_on_error=False)
    processor = build_processor(
        config,
        preprocess=lambda row: {"messages": [{"role": "user", "content": row["question"]}],
                                "sampling_params": {"max_tokens": 4, "temperature": 0.7}},
        postprocess=lambda row: {"id": row["id"], "answer": row["generated_text"],
                                 "tokens": row["generated_tokens"], "prompt_ids": row["prompt_token_ids"]},
    )
    dataset = ray.data.read_parquet(str(tmp_path / "in.parquet"))
    assert dataset.materialize().num_blocks() == 1
    done = processor(dataset).materialize()
    assert done.num_blocks() == 4  # four Ray Data tasks of batch_size rows, not one task holding the block
    done.write_parquet(str(tmp_path / "out"))
    out = sorted(pq.read_table(tmp_path / "out").to_pylist(), key=lambda r: r["id"])
    assert [r["id"] for r in out] == list(range(16)) and set(out[0]) == {"id", "answer", "tokens", "prompt_ids"}
    stage = SpecTrStage(config)
    for row, source in zip(out, rows):
        text = f"user : {source['question']} assistant :"
        assert row["prompt_ids"] == stage.generator.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert row["tokens"] == reference(stage, row["prompt_ids"], row_seed(0, row["id"]), 4, temperature=0.7)


def test_actors_do_not_import_the_ray_data_llm_registry(ray_local):
    """The registration is the driver's: a Ray worker that imports the package (as the stage's actors do
    when they unpickle it) skips `ray.llm`'s batch stages, which only add to each actor's start.
    Control: this driver did register (the previous test's `ray.data.llm.build_processor` relies on it)."""
    import ray

    import pipeline.ray_data

    @ray.remote(num_cpus=0)
    def in_a_worker():
        import sys

        import pipeline.ray_data as package

        return package.RAY_DATA_LLM_REGISTERED, "ray.llm._internal.batch.processor" in sys.modules

    assert ray.get(in_a_worker.remote()) == (False, False)
    assert pipeline.ray_data.RAY_DATA_LLM_REGISTERED


def run_the_first_example_of_docs_ray_data(tiny_pair, tmp_path, num_rows: int, concurrency: str) -> list[dict]:
    """docs/ray-data.md's first example, executed as written but for its paths (the tiny pair, local Parquet for
    S3), a short budget, and `concurrency` in place of its `concurrency=2,` (half a CPU per actor: the local Ray
    has 2): a pipeline written as for ray.data.llm, with SpecTr's config class. Its output rows, by id."""
    from pipeline.config import PROJECT_ROOT

    text = (PROJECT_ROOT / "docs" / "ray-data.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    rng = random.Random(5)
    pq.write_table(pa.Table.from_pylist([{"id": i, "text": words(rng)} for i in range(num_rows)]),
                   tmp_path / "in.parquet")
    for old, new in (("assets/models/target", str(tiny_pair["target"])), ("assets/models/draft", str(tiny_pair["draft"])),
                     ("concurrency=2,", f"{concurrency} num_cpus=0.5,"), ('"max_tokens": 128', '"max_tokens": 4'),
                     ('"s3://bucket/prompts/"', repr(str(tmp_path / "in.parquet"))),
                     ('"s3://bucket/completions/"', repr(str(tmp_path / "out")))):
        assert old in code, old
        code = code.replace(old, new)
    exec(compile(code, "docs/ray-data.md", "exec"), {})
    out = sorted(pq.read_table(tmp_path / "out").to_pylist(), key=lambda r: r["id"])
    assert [r["id"] for r in out] == list(range(num_rows)) and set(out[0]) == {"id", "completion", "tokens", "reason"}
    assert all(r["reason"] in ("stop", "length") and 1 <= r["tokens"] <= 4 for r in out)
    return out


def test_the_first_example_of_docs_ray_data_runs_on_one_actor(ray_local, tiny_pair, tmp_path):
    """The light sibling of the next test (the default suite's): the example's own code on 4 rows, one actor."""
    run_the_first_example_of_docs_ray_data(tiny_pair, tmp_path, 4, "concurrency=1,")


@pytest.mark.slow  # its light sibling: test_the_first_example_of_docs_ray_data_runs_on_one_actor
def test_the_first_example_of_docs_ray_data_runs_as_written(ray_local, tiny_pair, tmp_path):
    """docs/ray-data.md's first example on 12 rows, with its two actors."""
    run_the_first_example_of_docs_ray_data(tiny_pair, tmp_path, 12, "concurrency=2,")
