"""A worker's read of Parquet rows that cannot be decoded (issue #52, item 1), without Ray.

Faults injected in the file: bytes that are not UTF-8 in one string value (pyarrow's unvalidated buffers),
and a corrupt page (bytes of one row group's prompt column flipped on disk). Each costs the rows it holds:
the value's row, or the group's row range, as problems naming where and why; the other rows read as before.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import DataConfig
from pipeline.prompts import read_rows
from pipeline.readers import scan_source
from pipeline.source import list_source


def plan(path, shard_size=40):
    config = DataConfig(path=str(path), id_column="id")
    return scan_source(config, list_source(config), shard_size)


def table(prompts):
    return pa.table({"id": [f"p{i:03d}" for i in range(len(prompts))], "prompt": prompts})


def test_a_value_that_is_not_utf8_is_a_problem_of_its_row_alone(tmp_path):
    values = [f"value {i}".encode() for i in range(40)]
    values[16] = b"va\xfflue"
    raw = pa.array(values, pa.binary())
    pq.write_table(table(pa.Array.from_buffers(pa.string(), 40, raw.buffers())), tmp_path / "p.parquet",
                   row_group_size=10)
    rows = read_rows(plan(tmp_path / "p.parquet"), 0, 40)
    assert [i for i, p in enumerate(rows.problems) if p] == [16]
    assert rows.problems[16] == (f"data.path: row 16 (id 'p016') of {tmp_path / 'p.parquet'}: column 'prompt' is not "
                                 "valid UTF-8 (byte 0xff at position 3 of the value)")
    assert rows.texts[15] == "value 15" and rows.texts[16] is None and rows.ids[16] == "p016"


@pytest.mark.parametrize("shard", [(0, 40), (12, 28)])  # the whole file; a shard that starts and ends mid-group
def test_a_corrupt_row_group_is_problems_of_its_rows_and_names_their_range(tmp_path, shard):
    path = tmp_path / "p.parquet"
    pq.write_table(table([f"hello world number {i} " * 5 for i in range(40)]), path, row_group_size=10,
                   compression="snappy")
    chunk = pq.ParquetFile(path).metadata.row_group(1).column(1)  # group 1's prompts: rows 10-19
    data = bytearray(path.read_bytes())
    middle = chunk.data_page_offset + chunk.total_compressed_size // 2
    data[middle : middle + 40] = bytes(b ^ 0x5A for b in data[middle : middle + 40])
    source = plan(path)  # the scan reads the footer only
    path.write_bytes(bytes(data))
    start, stop = shard
    rows = read_rows(source, start, stop)
    bad = [start + i for i, p in enumerate(rows.problems) if p]
    assert bad == [r for r in range(10, 20) if start <= r < stop]
    where = f"data.path: rows {bad[0]}-{bad[-1]} of {path} (row group 1) cannot be read: OSError: "  # of this shard
    assert all(p.startswith(where) for p in rows.problems[bad[0] - start : bad[-1] - start + 1])
    assert rows.texts == [None if r in bad else f"hello world number {r} " * 5 for r in range(start, stop)]
