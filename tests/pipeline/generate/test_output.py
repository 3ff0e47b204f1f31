"""The output directory: whole part files with contract types, the commit log, resume decisions, reading back."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import fs
from pipeline.errors import JobInputError
from pipeline.generate.commit_log import SEGMENT_RECORDS, AppendLog, SegmentLog, read_commit_records
from pipeline.generate.manifest import Manifest, check_output_dir, load_state
from pipeline.generate.output import output_schema, remove_stale_temporaries, write_shard
from pipeline.generate.reader import read_output, read_settings
from pipeline.generate.shards import part_digits, part_name


def row(i, reason="length", error=None):
    return {
        "id": f"p{i}",
        "prompt": "def f",
        "completion": "x",
        "completion_token_ids": [5, 6],
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "finish_reason": reason,
        "target_calls": 1,
        "block_efficiency": 2.0,
        "seed": 2**62 + i,
        "error": error,
    }


def commit(log, index, name, size, rows=2, failed=0, tokens=4):
    stats = {"generated_tokens": tokens, "prompts_completed": rows - failed, "prompts_failed": failed}
    log.append({"shard": index, "file": name, "rows": rows, "bytes": size, "failed": failed, "stats": stats})


def test_part_names_sort_in_row_order():
    assert part_name(3) == "part-000003.parquet" and part_digits(10) == 6 and part_digits(1_000_001) == 7
    names = [part_name(i, part_digits(2_000_000)) for i in (9, 999_999, 1_000_000, 1_999_999)]
    assert names == sorted(names)


def test_shard_file_has_contract_types_and_settings_metadata(tmp_path):
    schema = output_schema("str", {"spectr": {"num_drafts": 4}})
    name, size = write_shard(tmp_path, 3, [row(0), row(1, "error", "ValueError: too long")], schema)
    path = tmp_path / name
    assert name == "part-000003.parquet" and [p.name for p in tmp_path.iterdir()] == [name]
    assert size == path.stat().st_size
    table = pq.read_table(path)
    assert table.schema.field("completion_token_ids").type == pa.list_(pa.int32())
    assert table.schema.field("id").type == pa.string() and table.schema.field("seed").type == pa.int64()
    assert table.column("error").to_pylist() == [None, "ValueError: too long"]
    assert read_settings(path) == {"spectr": {"num_drafts": 4}}
    assert output_schema("int").field("id").type == pa.int64()
    with pytest.raises(ValueError, match="finish_reason 'oops'"):
        write_shard(tmp_path, 4, [row(0, "oops")], schema)


def test_commit_log_appends_and_cuts_a_torn_line(tmp_path):
    out = fs.resolve(str(tmp_path), "output_dir")
    log = AppendLog(out)
    commit(log, 0, "a", 1)
    commit(log, 1, "b", 2)
    log.close()
    with open(tmp_path / "_commits.jsonl", "ab") as f:
        f.write(b'{"shard": 2, "fi')  # a crash in the middle of an append
    assert [r["shard"] for r in read_commit_records(out)] == [0, 1]  # readers skip it
    log = AppendLog(out)  # the next run cuts it off before appending
    commit(log, 2, "c", 3)
    log.close()
    assert [r["shard"] for r in read_commit_records(out)] == [0, 1, 2]
    assert all(json.loads(line) for line in (tmp_path / "_commits.jsonl").read_text().splitlines())


def test_segment_log_writes_bounded_segments_that_sort_by_run(tmp_path):
    out = fs.resolve(str(tmp_path), "output_dir")
    (tmp_path / "_commits").mkdir()
    first = SegmentLog(out, run=1)
    for i in range(SEGMENT_RECORDS + 3):
        commit(first, i, f"f{i}", i)
    second = SegmentLog(out, run=2)
    commit(second, 0, "again", 7)  # a later record for shard 0 wins
    names = sorted(p.name for p in (tmp_path / "_commits").iterdir())
    assert names == ["seg-000001-000000.jsonl", "seg-000001-000001.jsonl", "seg-000002-000000.jsonl"]
    records = list(read_commit_records(out))
    assert len(records) == SEGMENT_RECORDS + 4 and records[-1]["file"] == "again"


def test_resume_state_trusts_only_listed_parts_of_the_listed_size(tmp_path):
    out = fs.resolve(str(tmp_path), "output_dir")
    schema = output_schema("str")
    log = AppendLog(out)
    for index in range(4):
        name, size = write_shard(tmp_path, index, [row(2 * index), row(2 * index + 1)], schema)
        if index < 3:
            commit(log, index, name, size, failed=1 if index == 2 else 0)
    log.close()  # shard 3's file is there but not listed: not done
    (tmp_path / "part-000001.parquet").write_bytes(b"truncated")  # listed, wrong size: not done
    state = load_state(out, 4, retry_failed=True)
    assert list(state.done) == [1, 0, 0, 0] and state.rows_done == 2 and state.shards_retried == 1
    assert state.earlier_stats["generated_tokens"] == 4  # only the done shard's statistics
    kept = load_state(out, 4, retry_failed=False)  # shard 2 has an error row; kept when not retrying
    assert list(kept.done) == [1, 0, 1, 0] and kept.rows_done == 4 and kept.earlier_stats["prompts_failed"] == 1


def test_manifest_resume_and_refusal(tmp_path):
    out = fs.resolve(str(tmp_path / "out"), "output_dir")
    settings = {"spectr": {"seed": 0}, "shard_size": 2, "data": {"path": "p"}, "inputs": [], "model": {}}
    assert check_output_dir(out, "h1", settings) is None and not (tmp_path / "out").exists()  # writes nothing
    (tmp_path / "out").mkdir()
    Manifest("h1", settings, num_rows=3, num_shards=2).save(out)
    (tmp_path / "out" / ".part-000001.parquet.tmp-123-abcd").write_bytes(b"partial")  # a killed run's leftover
    assert check_output_dir(out, "h1", settings).num_rows == 3
    assert remove_stale_temporaries(out) == [".part-000001.parquet.tmp-123-abcd"]
    with pytest.raises(JobInputError, match=r"holds results of a different config \(spectr.seed: 0 there, 1 now\)"):
        check_output_dir(out, "h2", {**settings, "spectr": {"seed": 1}})


def test_changed_input_and_replaced_model_are_named(tmp_path):
    out = fs.resolve(str(tmp_path), "output_dir")
    inputs = [{"path": "/d/p.jsonl", "size": 10, "mtime_ns": 1}]
    old = {"data": {"path": "/d/p.jsonl"}, "inputs": inputs, "model": {"target": "/m/t", "draft": "/m/d"},
           "models": {"target": {"model.safetensors": {"size": 5, "sampled_sha256": "a"}}, "draft": {}}}  # fmt: skip
    Manifest("h1", old, 1, 1).save(out)
    grown = {**old, "inputs": [{"path": "/d/p.jsonl", "size": 12, "mtime_ns": 2}]}
    with pytest.raises(JobInputError, match=r"data.path: the input changed since .*p.jsonl: size 10 then, 12 now"):
        check_output_dir(out, "h2", grown)
    replaced = {**old, "models": {"target": {"model.safetensors": {"size": 5, "sampled_sha256": "b"}}, "draft": {}}}
    with pytest.raises(JobInputError, match=r"model.target: the model at /m/t changed .*model.safetensors: content"):
        check_output_dir(out, "h3", replaced)


def test_non_empty_dir_without_manifest_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(JobInputError, match="is not empty \\(notes.txt\\) and holds no _manifest.json"):
        check_output_dir(fs.resolve(str(tmp_path), "output_dir"), "h", {})


def test_read_output_concatenates_committed_shards_in_order(tmp_path):
    out = fs.resolve(str(tmp_path), "output_dir")
    Manifest("h", {}, num_rows=3, num_shards=2, id_kind="str").save(out)
    log = AppendLog(out)
    for index, rows in ((1, [row(2)]), (0, [row(0), row(1)])):
        name, size = write_shard(tmp_path, index, rows, output_schema("str"))
        commit(log, index, name, size, rows=len(rows))
    write_shard(tmp_path, 2, [row(9)], output_schema("str"))  # written, never committed: not read
    log.close()
    assert read_output(tmp_path).column("id").to_pylist() == ["p0", "p1", "p2"]


def test_a_late_writer_never_replaces_the_committed_part_and_reader_checks_sizes(tmp_path):
    """Attempts write fenced names (`ShardTask.fence`): attempt 1 is committed; attempt 0, given up but
    still running, writes late under its own name and changes nothing the reader returns; the finished job
    removes it. A committed part whose size differs from its record is refused (negative control)."""
    from pipeline.generate.output import remove_uncommitted_parts
    from pipeline.generate.shards import ShardTask

    out = fs.resolve(str(tmp_path), "output_dir")
    Manifest("h", {}, num_rows=2, num_shards=1, id_kind="str").save(out)
    first = ShardTask(0, 0, 2, run="r1")
    second = first.again()
    assert (first.fence, second.fence, ShardTask(0, 0, 2, run="r1", fresh=False).fence) == ("r1-0", "r1-1", "r1-0")
    log = AppendLog(out)
    name, size = write_shard(tmp_path, 0, [row(0), row(1)], output_schema("str"), fence=second.fence)
    commit(log, 0, name, size)
    log.close()
    late, _ = write_shard(tmp_path, 0, [row(7), row(8)], output_schema("str"), fence=first.fence)  # late writer
    assert (name, late) == ("part-000000-r1-1.parquet", "part-000000-r1-0.parquet")
    assert read_output(tmp_path).column("id").to_pylist() == ["p0", "p1"]
    assert remove_uncommitted_parts(out, {name}) == [late] and not (tmp_path / late).exists()
    (tmp_path / name).write_bytes((tmp_path / name).read_bytes() + b"x")  # not what the commit lists
    with pytest.raises(ValueError, match="commit lists"):
        read_output(tmp_path)


def test_a_late_writer_of_an_earlier_run_is_removed_and_globbing_readers_read_each_id_once(tmp_path):
    """#40 finding 5, without Ray (the job is tests/jobs/test_generate_late_run.py): run A was killed while its
    first attempt at shard 0 (a shard no run had listed) was writing; run B's first attempt at it is committed;
    then A's part lands. Every attempt's name carries its run's tag, so A's part sits beside B's instead of
    replacing it; the cleanup of B's end removes it, and pyarrow.dataset then reads each id once."""
    import pyarrow.dataset as ds

    from pipeline.generate.output import remove_uncommitted_parts
    from pipeline.generate.shards import ShardTask

    out = fs.resolve(str(tmp_path), "output_dir")
    Manifest("h", {}, num_rows=2, num_shards=1, id_kind="str").save(out)
    run_a, run_b = ShardTask(0, 0, 2, run="aaaa0000"), ShardTask(0, 0, 2, run="bbbb1111")
    log = AppendLog(out)
    name, size = write_shard(tmp_path, 0, [row(0), row(1)], output_schema("str"), fence=run_b.fence)
    commit(log, 0, name, size)
    log.close()
    late, _ = write_shard(tmp_path, 0, [row(0), row(1)], output_schema("str"), fence=run_a.fence)
    assert late != name and (tmp_path / name).stat().st_size == size  # the committed part is untouched
    assert remove_uncommitted_parts(out, {name}) == [late]
    assert ds.dataset(str(tmp_path), format="parquet").to_table().column("id").to_pylist() == ["p0", "p1"]
