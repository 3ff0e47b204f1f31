"""Reading prompts: every format gives the same table; every bad input is named with file, column, row."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import DataConfig
from pipeline.errors import JobInputError
from pipeline.prompts import read_prompts

ROWS = [{"id": f"r{i}", "prompt": f"def f{i}(x):", "extra": i} for i in range(5)]


def write_all_formats(folder: Path, rows: list[dict]) -> dict[str, Path]:
    import datasets

    paths = {}
    paths["jsonl"] = folder / "p.jsonl"
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths["parquet"] = folder / "p.parquet"
    pq.write_table(pa.Table.from_pylist(rows), paths["parquet"])
    paths["csv"] = folder / "p.csv"
    pa.csv.write_csv(pa.Table.from_pylist(rows), paths["csv"])
    paths["hf_disk"] = folder / "p_hf"
    datasets.Dataset.from_list(rows).save_to_disk(str(paths["hf_disk"]))
    return paths


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    import pyarrow.csv  # noqa: F401  (registers pa.csv)

    return write_all_formats(tmp_path_factory.mktemp("formats"), ROWS)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "csv", "hf_disk"])
def test_every_format_reads_the_same_rows(formats, fmt):
    table = read_prompts(DataConfig(path=str(formats[fmt])))  # format auto-detected
    assert table.format == fmt
    assert table.ids == [r["id"] for r in ROWS] and table.id_kind == "str"
    assert table.prompts == [r["prompt"] for r in ROWS]
    explicit = read_prompts(DataConfig(path=str(formats[fmt]), format=fmt, limit=2))
    assert explicit.ids == ["r0", "r1"]


def test_row_number_is_the_id_when_the_column_is_absent(formats):
    table = read_prompts(DataConfig(path=str(formats["parquet"]), id_column="no_such_column"))
    assert table.ids == [0, 1, 2, 3, 4] and table.id_kind == "int"


def test_other_prompt_column(formats):
    table = read_prompts(DataConfig(path=str(formats["jsonl"]), prompt_column="id"))
    assert table.prompts == [r["id"] for r in ROWS]


def test_csv_prompts_that_look_like_numbers_stay_text(tmp_path):
    path = tmp_path / "n.csv"
    path.write_text("id,prompt\n1,123\n2,4.5\n")
    table = read_prompts(DataConfig(path=str(path)))
    assert table.prompts == ["123", "4.5"] and table.ids == [1, 2] and table.id_kind == "int"


def error_of(tmp_path: Path, text: str, name: str = "p.jsonl", **kwargs) -> str:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(JobInputError) as caught:
        read_prompts(DataConfig(path=str(path), **kwargs))
    return str(caught.value)


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(JobInputError, match="data.path: no such file or directory: .*nope.jsonl"):
        read_prompts(DataConfig(path=str(tmp_path / "nope.jsonl")))
    message = error_of(tmp_path, "x", name="p.txt")
    assert "data.format" in message and "'.txt'" in message
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(JobInputError, match="not a `datasets.save_to_disk` directory"):
        read_prompts(DataConfig(path=str(tmp_path / "plain_dir")))


def test_missing_prompt_column_lists_the_columns(tmp_path):
    message = error_of(tmp_path, '{"id": 1, "text": "a"}\n')
    assert "data.prompt_column: column 'prompt' not found" in message and "columns are: id, text" in message


def test_non_string_and_null_prompts_name_the_row(tmp_path):
    message = error_of(tmp_path, '{"id": "a", "prompt": "ok"}\n{"id": "b", "prompt": 7}\n')
    assert "row 1 (id 'b')" in message and "prompt is int 7, expected a string" in message
    message = error_of(tmp_path, '{"id": "a", "prompt": null}\n')
    assert "row 0 (id 'a')" in message and "prompt is null" in message


def test_duplicate_ids_empty_data_and_bad_json(tmp_path):
    message = error_of(tmp_path, "".join(json.dumps({"id": i % 3, "prompt": "x"}) + "\n" for i in range(5)))
    assert "duplicate ids" in message and "0 at rows 0 and 3" in message and "2 duplicate row(s)" in message
    assert "holds no rows" in error_of(tmp_path, "\n")
    assert "line 2 is not valid JSON" in error_of(tmp_path, '{"id": 1, "prompt": "a"}\n{oops\n')
    assert "mixes int and string ids" in error_of(
        tmp_path, '{"id": 1, "prompt": "a"}\n{"id": "b", "prompt": "a"}\n'
    )


def test_empty_parquet(tmp_path):
    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"id": pa.array([], pa.int64()), "prompt": pa.array([], pa.string())}), path)
    with pytest.raises(JobInputError, match="holds no rows"):
        read_prompts(DataConfig(path=str(path)))


def test_chat_messages(tmp_path):
    rows = [{"id": 1, "messages": [{"role": "user", "content": "hi"}]}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = read_prompts(DataConfig(path=str(path), chat=True))
    assert table.messages == [[{"role": "user", "content": "hi"}]] and table.prompts is None
    message = error_of(tmp_path, '{"id": 1, "messages": [{"role": "user"}]}\n', chat=True)
    assert "row 0 (id 1)" in message and "message 0 must have string 'role' and 'content'" in message
