"""Many samples per prompt: shards cut by output rows (prompts x samples), sample ranges of a prompt spread over
shards, rows byte-identical whatever the sharding, per-row n (vLLM's, up to data.max_samples), the first line.

The layout is checked as a pure function (`shard_layout`); the rows by running every shard of a real plan
through one `ShardGenerator` without Ray (its `generate_shard` writes real part files), once per sharding.
"""

from __future__ import annotations

import json
import logging
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tiny_pair_support import job_config

from pipeline.generate.config import from_dict
from pipeline.generate.job import RunHooks, run_generate
from pipeline.generate.output import output_schema
from pipeline.generate.plan import prepare
from pipeline.generate.reader import read_output
from pipeline.generate.shards import SHARD_GRANULE, SMALL_INPUT, auto_shard_size, sample_seed, shard_layout
from pipeline.generate.worker import ShardGenerator, WorkerJob

PROMPTS = ["the cat sat on", "a dog ran to the", "one two three", "big red house by the", "blue sky over"]


@pytest.mark.parametrize("prompts,samples,shards,block,per_shard", [
    (16, 4, 4, 4, 4),  # the case: one shard by prompts; four by rows (4 prompts x 4 samples each)
    (4, 16, 4, 1, 16),  # 4 prompts x 16 samples: a shard per prompt
    (4, 64, 16, 1, 16),  # 4 prompts x 64 samples: 16 shards of 16 samples, enough for 8 actors
    (1000, 4, 63, 16, 4),  # many prompts: 16 prompts x all 4 samples a shard
    (30_000, 32, 1875, 16, 32),  # large inputs: blocks of whole granules (no rows read twice)
])
def test_auto_layout_counts_output_rows(prompts, samples, shards, block, per_shard):
    layout = shard_layout(prompts, samples)
    assert (layout.num_shards, layout.shard_size, layout.samples_per_shard) == (shards, block, per_shard)
    assert layout.output_rows == prompts * samples
    if prompts > SMALL_INPUT:
        assert layout.shard_size % SHARD_GRANULE == 0  # the scan's JSONL/CSV offsets fit the blocks


@pytest.mark.parametrize("prompts", [1, 15, 16, 17, 100, 5000, 200_000])
def test_one_sample_per_prompt_keeps_the_old_shards(prompts):
    layout = shard_layout(prompts, 1)
    assert (layout.shard_size, layout.samples_per_shard) == (auto_shard_size(prompts), 1)
    assert shard_layout(prompts, 1, 7).shard_size == 7  # an explicit shard_size: rows per shard, as it was


@pytest.mark.parametrize("prompts,samples,size", [(3, 8, 4), (5, 3, 9), (2, 8, 5), (17, 4, None), (4, 7, None),
                                                  (40, 1, 4), (3, 64, None), (2, 5, 1)])
def test_every_prompt_and_sample_in_exactly_one_shard(prompts, samples, size):
    layout = shard_layout(prompts, samples, size)
    seen = []
    for index in range(layout.num_shards):
        task = layout.task(index)
        assert task.output_rows <= (size or layout.output_rows)  # no shard over the rows asked for
        seen += [(row, s) for row in range(task.start, task.stop) for s in range(task.sample_start, task.sample_stop)]
    assert sorted(seen) == [(row, s) for row in range(prompts) for s in range(samples)]
    assert shard_layout(prompts, samples, size) == layout  # a pure function: resume re-plans the same shards


def write_prompts(tmp_path, rows):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_every_shard(tiny_pair, tmp_path, generator, name, rows, **settings):
    """Every shard of the plan through `generator` (no Ray): the output table and the plan."""
    data = write_prompts(tmp_path, rows)
    out = tmp_path / name
    plan = prepare(from_dict(job_config(tiny_pair, data, out, **settings)))
    out.mkdir()
    schema = output_schema(plan.id_kind, logprobs=False, kept=plan.source.columns.kept)
    generator.reconfigure(plan.config.spectr)  # the job's engine settings (num_samples), the pair loaded once
    generator.job = WorkerJob(plan.config.data, plan.source, str(out), 6, schema)
    results = [generator.generate_shard(plan.shard(i)) for i in range(plan.num_shards)]
    plan.results = results  # their statistics (the shared prefills)
    return pa.concat_tables([pq.read_table(out / result.file) for result in results]), plan


def content(table: pa.Table) -> list[dict]:
    """The rows sorted by (id, sample_index), without the timing column (seconds differ run to run)."""
    return sorted(table.drop(["time_taken_s"]).to_pylist(), key=lambda r: (r["id"], r["sample_index"]))


@pytest.fixture(scope="module")
def generator(tiny_pair, tmp_path_factory):
    data = write_prompts(tmp_path_factory.mktemp("base"), [{"prompt": "a"}])
    base = from_dict(job_config(tiny_pair, data, data.parent / "unused"))
    return ShardGenerator(base.model, base.spectr, num_threads=1)


def test_rows_are_byte_identical_for_1_2_and_4_shards(tiny_pair, tmp_path, generator):
    rows = [{"id": f"r{i}", "prompt": PROMPTS[i]} for i in range(2)]
    settings = {"spectr.num_samples": 8, "spectr.max_new_tokens": 6, "spectr.batch_size": 3}
    tables = {}
    for size, shards in ((16, 1), (8, 2), (4, 4)):  # 4: two shards per prompt, samples 0-3 and 4-7
        table, plan = run_every_shard(tiny_pair, tmp_path, generator, f"out{size}", rows, shard_size=size, **settings)
        assert plan.num_shards == shards and table.num_rows == 16
        tables[size] = table
        prefills = [(r.stats["prefilled_rows"], r.stats["shared_prefill_rows"]) for r in plan.results]
        assert sum(p + s for p, s in prefills) == 16 and all(s > 0 for _, s in prefills)  # shards report sharing
    assert [(plan.shard(i).start, plan.shard(i).sample_start) for i in range(4)] == [(0, 0), (0, 4), (1, 0), (1, 4)]
    first = content(tables[16])
    assert [(r["id"], r["sample_index"]) for r in first] == [(f"r{i}", s) for i in range(2) for s in range(8)]
    assert len({tuple(r["completion_token_ids"]) for r in first}) > 2  # independent samples
    assert first[9]["seed"] == sample_seed(first[8]["seed"], 1)  # sample 1 of r1: its seed from r1's
    for size in (8, 4):
        assert content(tables[size]) == first, f"shard_size={size} changed the rows"


def test_per_row_n_up_to_max_samples(tiny_pair, tmp_path, generator):
    rows = [{"id": "a", "prompt": PROMPTS[0], "params": {"n": 3}},
            {"id": "b", "prompt": PROMPTS[1], "params": None},  # spectr.num_samples (2)
            {"id": "c", "prompt": PROMPTS[2], "params": {"n": 1, "temperature": 0.5}},
            {"id": "d", "prompt": PROMPTS[3], "params": {"n": 5}}]  # over data.max_samples: its error
    settings = {"spectr.num_samples": 2, "data.sampling_params_column": "params", "data.max_samples": 4,
                "spectr.max_new_tokens": 4}
    table, plan = run_every_shard(tiny_pair, tmp_path, generator, "out", rows, shard_size=4, **settings)
    assert plan.num_shards == 4 and plan.output_rows == 3 + 2 + 1 + 2  # 1 prompt a shard; the rows written, exactly
    got = [(r["id"], r["sample_index"], r["finish_reason"] == "error") for r in content(table)]
    assert got == [("a", 0, False), ("a", 1, False), ("a", 2, False), ("b", 0, False), ("b", 1, False),
                   ("c", 0, False), ("d", 0, True), ("d", 1, True)]
    assert len(got) == plan.output_rows
    error = table.filter(pa.compute.equal(table["id"], "d"))["error"][0].as_py()
    assert "n=5" in error and "data.max_samples = 4" in error
    assert sum(r.failed_input for r in plan.results) == 2  # the input's own failure: a rerun does not redo it
    # without data.max_samples the scan's count places every row's n: 5 samples a prompt, nothing fails
    table, plan = run_every_shard(tiny_pair, tmp_path, generator, "out2", rows, shard_size=5,
                                  **{**settings, "data.max_samples": None})
    got = [(r["id"], r["sample_index"], r["finish_reason"]) for r in content(table)]
    assert [g[:2] for g in got] == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("c", 0)] + [
        ("d", s) for s in range(5)] and "error" not in {g[2] for g in got}
    assert (plan.samples_per_prompt, plan.output_rows, plan.config.data.max_samples) == (5, 11, 5)


def test_a_failed_row_writes_the_rows_the_plan_counted(tiny_pair, tmp_path, generator):
    """A row that fails on another setting still has its n (the scan counted it): n error rows; a value
    that is unusable as a whole (unknown name, n not an int) counts and fails with the job's n."""
    rows = [{"id": "a", "prompt": PROMPTS[0], "params": {"n": 3, "temperature": -1}},  # 3 error rows
            {"id": "b", "prompt": PROMPTS[1], "params": {"n": 4, "colour": "red"}},  # unknown name: the job's 2
            {"id": "c", "prompt": PROMPTS[2], "params": {"n": "x"}},  # the job's 2
            {"id": "d", "prompt": PROMPTS[3], "params": '{"n": 1}'}]  # JSON text: 1 row
    settings = {"spectr.num_samples": 2, "data.sampling_params_column": "params", "spectr.max_new_tokens": 2}
    table, plan = run_every_shard(tiny_pair, tmp_path, generator, "out", rows, shard_size=3, **settings)
    got = [(r["id"], r["sample_index"], r["finish_reason"]) for r in content(table)]
    assert got[:-1] == [("a", s, "error") for s in range(3)] + [("b", s, "error") for s in range(2)] + [
        ("c", s, "error") for s in range(2)] and got[-1][:2] == ("d", 0) and got[-1][2] != "error"
    assert plan.output_rows == len(got) == 8 and plan.samples_per_prompt == 3
    assert sum(r.failed_input for r in plan.results) == 7  # the rows' own settings: input failures


PARAMS_N = [{"n": 3}, None, {"n": 1, "temperature": 0.5}, {"n": 6}, {"top_p": 0.9}]  # 3 + 2 + 1 + 6 + 2 = 14


@pytest.mark.parametrize("kind", ["jsonl", "jsonl-text", "jsonl-mixed", "csv", "parquet-struct", "parquet-text",
                                  "hf_disk"])
def test_the_scan_counts_each_rows_n_in_every_format(tiny_pair, tmp_path, kind):
    """The plan reads each row's n on the scan's one pass, whatever the format and the column's shape (a struct,
    JSON text, or both in one JSON-lines file: pyarrow's reader rejects that block, the line-by-line path counts):
    the layout places the largest n, the first line and the bar count the rows exactly."""
    from pipeline.generate.plan import samples_line

    rows = [{"id": i, "prompt": PROMPTS[i], "params": p} for i, p in enumerate(PARAMS_N)]
    text = [{**r, "params": None if r["params"] is None else json.dumps(r["params"])} for r in rows]
    if kind.startswith("jsonl"):
        chosen = {"jsonl": rows, "jsonl-text": text, "jsonl-mixed": rows[:3] + text[3:]}[kind]
        data = write_prompts(tmp_path, chosen)
    elif kind == "csv":
        import csv

        data = tmp_path / "p.csv"
        with data.open("w", newline="") as f:
            writer = csv.DictWriter(f, ["id", "prompt", "params"])
            writer.writeheader()
            writer.writerows(text)
    elif kind.startswith("parquet"):
        data = tmp_path / "p.parquet"
        pq.write_table(pa.Table.from_pylist(rows if kind == "parquet-struct" else text), data)
    else:
        import datasets

        data = tmp_path / "hf"
        datasets.Dataset.from_list(rows).save_to_disk(str(data))
    plan = prepare(from_dict(job_config(tiny_pair, data, tmp_path / "out", shard_size=None,
                                        **{"spectr.num_samples": 2, "data.sampling_params_column": "params"})))
    assert (plan.samples_per_prompt, plan.output_rows) == (6, 14)
    assert samples_line(plan) == "5 prompts x 1 to 6 samples = 14 rows"
    assert plan.config.data.max_samples == 6  # the workers place what the plan placed


@pytest.mark.parametrize("suffix", ["jsonl", "jsonl.gz", "csv"])
def test_blocks_inside_a_granule_read_their_own_rows(tiny_pair, tmp_path, suffix):
    """20 prompts x 4 samples, auto: blocks of 4 prompts while the JSONL/CSV scan keeps an offset every 16 rows;
    each shard reads its granule and keeps its own rows (ids in order, each once)."""
    import gzip

    from pipeline.generate.shards import load_shard
    from pipeline.models import load_tokenizer

    ids = [f"q{i}" for i in range(20)]
    path = tmp_path / f"p.{suffix}"
    if suffix == "csv":
        text = "id,prompt\n" + "".join(f"{i},{PROMPTS[k % 5]}\n" for k, i in enumerate(ids))
    else:
        text = "".join(json.dumps({"id": i, "prompt": PROMPTS[k % 5]}) + "\n" for k, i in enumerate(ids))
    path.write_bytes(gzip.compress(text.encode()) if suffix.endswith("gz") else text.encode())
    plan = prepare(from_dict(job_config(tiny_pair, path, tmp_path / "out", shard_size=None,
                                        **{"spectr.num_samples": 4})))
    assert (plan.shard_size, plan.source.shard_size, plan.num_shards) == (4, SHARD_GRANULE, 5)
    tokenizer = load_tokenizer(tiny_pair["target"], "model.target", False)
    read = [load_shard(plan.shard(i), plan.source, tokenizer, plan.config.data, 0).ids for i in range(5)]
    assert read == [ids[4 * i: 4 * i + 4] for i in range(5)]


def test_max_samples_below_num_samples_is_refused(tiny_pair, tmp_path):
    from pipeline.errors import JobInputError

    raw = job_config(tiny_pair, write_prompts(tmp_path, [{"prompt": "a"}]), tmp_path / "out",
                     **{"spectr.num_samples": 4, "data.max_samples": 2})
    with pytest.raises(JobInputError, match=r"data.max_samples must be >= spectr.num_samples \(4\)"):
        from_dict(raw)


@pytest.mark.slow  # two whole jobs; the layout and rows without Ray: the tests above (run_every_shard)
def test_job_spreads_few_prompts_samples_over_both_actors(tiny_pair, tmp_path, ray_local, caplog):
    """16 prompts x 4 samples: 4 shards of output rows (4 prompts x 4 samples; not 1 shard of prompts), both
    actors busy; the first line counts rows; the summary says how many prefills were shared (the samples of a
    prompt are in one shard: at most one prefill per prompt unless a copy joins after its prompt's last live
    row finished); resume by shard leaves every (id, sample_index) once."""
    data = write_prompts(tmp_path, [{"id": i, "prompt": PROMPTS[i % 5]} for i in range(16)])
    raw = job_config(tiny_pair, data, tmp_path / "out", shard_size=None,
                     **{"spectr.num_samples": 4, "spectr.max_new_tokens": 4, "spectr.batch_size": 8})
    workers = set()
    with caplog.at_level(logging.INFO, logger="pipeline"):
        report = run_generate(from_dict(raw))
    assert report.exit_code == 0
    assert "16 prompts x 4 samples = 64 rows in" in caplog.text and "4 of 4 shards to generate" in caplog.text
    table = read_output(tmp_path / "out")
    assert sorted(zip(table["id"].to_pylist(), table["sample_index"].to_pylist())) == [
        (i, s) for i in range(16) for s in range(4)]
    records = [json.loads(line) for line in (tmp_path / "out" / "_commits.jsonl").read_text().splitlines()]
    workers = {r["worker"]["pid"] for r in records}
    assert len(records) == 4 and len(workers) == 2  # the samples spread over both actors
    summary = report.summary
    assert summary.num_prompts == 64 and summary.prompts_completed == 64
    assert re.search(r"\n  rows +64 from 16 prompts \(64 completed, 0 failed\)", "\n" + summary.table())  # not "prompts"
    assert summary.prefilled_rows + summary.shared_prefill_rows == 64 and summary.shared_prefill_rows > 0
    # resume: as if the driver died once two shards were listed; the other two (and only they) run again
    out = tmp_path / "out"
    (out / "_commits.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:2]))
    (out / "_SUCCESS").unlink()
    for record in records[2:]:
        (out / record["file"]).unlink()
    dispatched = []
    again = run_generate(from_dict(raw), RunHooks(on_dispatch=lambda actor, shard: dispatched.append(shard)))
    assert again.exit_code == 0 and sorted(s.index for s in dispatched) == sorted(r["shard"] for r in records[2:])
    assert {(s.stop - s.start, s.sample_start, s.sample_stop) for s in dispatched} == {(4, 0, 4)}
    again_table = read_output(out)
    assert content(again_table) != [] and sorted(zip(again_table["id"].to_pylist(),
                                                      again_table["sample_index"].to_pylist())) == [
        (i, s) for i in range(16) for s in range(4)]


def test_resume_with_an_older_plans_shards_is_refused_by_name(tiny_pair, tmp_path):
    """A directory whose manifest has other shards for the same input and settings (a plan of an earlier version,
    which placed spectr.num_samples where the scan now counts each row's n) is refused naming both counts, not
    blamed on the input; the same manifest resumes."""
    import dataclasses

    from pipeline.errors import JobInputError

    rows = [{"id": i, "prompt": PROMPTS[i], "params": {"n": 1 + i}} for i in range(3)]
    raw = job_config(tiny_pair, write_prompts(tmp_path, rows), tmp_path / "out", shard_size=2,
                     **{"data.sampling_params_column": "params"})
    plan = prepare(from_dict(raw))
    (tmp_path / "out").mkdir()
    plan.manifest.save(plan.output)
    assert prepare(from_dict(raw)).num_shards == plan.num_shards  # the same plan resumes
    dataclasses.replace(plan.manifest, num_shards=plan.num_shards - 1).save(plan.output)
    with pytest.raises(JobInputError, match=rf"started with {plan.num_shards - 1} shards, this version plans "
                                            rf"{plan.num_shards} .*3 samples per prompt"):
        prepare(from_dict(raw))


def test_max_samples_has_a_default_cap_that_places_only_what_rows_ask_for(tiny_pair, tmp_path):
    """conf/data's `data.max_samples` is 64 (DEFAULT_MAX_SAMPLES): the plan places the largest n at most the cap
    (3 here, not 64), a row over the cap counts the job's n error rows (its message names the cap: the test
    above), and the default leaves the output directory's hash as it was without the key; without rows' own n
    the job's n is placed, whatever the cap."""
    from omegaconf import OmegaConf

    from pipeline.generate.config import DEFAULT_MAX_SAMPLES, generation_settings

    conf = OmegaConf.load(__file__.split("/tests/")[0] + "/conf/data/embedded.yaml")
    assert conf.max_samples == DEFAULT_MAX_SAMPLES == 64
    rows = [{"id": "a", "prompt": PROMPTS[0], "params": {"n": 3}}, {"id": "b", "prompt": PROMPTS[1], "params": None},
            {"id": "c", "prompt": PROMPTS[2], "params": {"n": 65}}]  # over the cap: 1 error row (the job's n)
    data = write_prompts(tmp_path, rows)
    capped = {"data.sampling_params_column": "params", "data.max_samples": DEFAULT_MAX_SAMPLES, "shard_size": None}
    plan = prepare(from_dict(job_config(tiny_pair, data, tmp_path / "out", **capped)))
    assert (plan.samples_per_prompt, plan.output_rows, plan.layout.samples) == (3, 3 + 1 + 1, 3)
    unset = from_dict(job_config(tiny_pair, data, tmp_path / "out", **{**capped, "data.max_samples": None}))
    assert generation_settings(plan.config) == generation_settings(unset)
    plain = prepare(from_dict(job_config(tiny_pair, data, tmp_path / "out2", **{"data.max_samples": 8})))
    assert (plain.samples_per_prompt, plain.output_rows) == (1, 3)
