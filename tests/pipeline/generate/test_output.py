"""The output directory: atomic shard files with contract types, the manifest, resume decisions."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.errors import JobInputError
from pipeline.generate.manifest import Manifest, finished_shards, open_output_dir
from pipeline.generate.output import output_schema, remove_stale_temporaries, write_shard
from pipeline.generate.reader import read_output, read_settings


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


def test_shard_file_has_contract_types_and_settings_metadata(tmp_path):
    schema = output_schema("str", {"spectr": {"num_drafts": 4}})
    path = write_shard(tmp_path, 3, [row(0), row(1, "error", "ValueError: too long")], schema)
    assert path.name == "part-00003.parquet" and [p.name for p in tmp_path.iterdir()] == [path.name]
    table = pq.read_table(path)
    assert table.schema.field("completion_token_ids").type == pa.list_(pa.int32())
    assert table.schema.field("id").type == pa.string() and table.schema.field("seed").type == pa.int64()
    assert table.column("error").to_pylist() == [None, "ValueError: too long"]
    assert read_settings(path) == {"spectr": {"num_drafts": 4}}
    assert output_schema("int").field("id").type == pa.int64()
    with pytest.raises(ValueError, match="finish_reason 'oops'"):
        write_shard(tmp_path, 4, [row(0, "oops")], schema)


def test_manifest_resume_and_refusal(tmp_path):
    out = tmp_path / "out"
    settings = {"spectr": {"seed": 0}, "shard_size": 2}
    fresh = open_output_dir(out, "h1", settings, num_rows=3, shards=2)
    assert not out.exists()  # deciding writes nothing
    out.mkdir()
    fresh.save(out)
    write_shard(out, 0, [row(0), row(1)], output_schema("str"))
    fresh.record_shard(out, 0, 2, {"generated_tokens": 4})
    (out / ".part-00001.parquet.tmp-123").write_bytes(b"partial")  # a killed run's leftover

    resumed = open_output_dir(out, "h1", settings, 3, 2)
    assert finished_shards(out, resumed) == {0} and not resumed.complete
    assert json.loads((out / "_manifest.json").read_text())["shards"]["00000"]["rows"] == 2
    assert remove_stale_temporaries(out) == [".part-00001.parquet.tmp-123"]

    with pytest.raises(
        JobInputError, match=r"holds results of a different config \(spectr.seed: 0 there, 1 now\)"
    ):
        open_output_dir(out, "h2", {"spectr": {"seed": 1}, "shard_size": 2}, 3, 2)
    (out / "part-00000.parquet").unlink()  # a listed file that vanished is redone
    assert finished_shards(out, resumed) == set()


def test_non_empty_dir_without_manifest_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(JobInputError, match="is not empty \\(notes.txt\\) and holds no _manifest.json"):
        open_output_dir(tmp_path, "h", {}, 1, 1)


def test_read_output_concatenates_in_shard_order(tmp_path):
    manifest = Manifest("h", {}, num_rows=3, num_shards=2)
    manifest.save(tmp_path)
    for index, rows in ((1, [row(2)]), (0, [row(0), row(1)])):
        write_shard(tmp_path, index, rows, output_schema("str"))
        manifest.record_shard(tmp_path, index, len(rows), {})
    assert read_output(tmp_path).column("id").to_pylist() == ["p0", "p1", "p2"] and manifest.complete
