"""Planning from metadata: record offsets, row counts, pieces, and the rows a worker reads for a range."""

from __future__ import annotations

import io
import json
import random
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import DataConfig
from pipeline.errors import JobInputError
from pipeline.linescan import ScanError, scan_records, split_records
from pipeline.prompts import read_rows
from pipeline.readers import scan_source
from pipeline.source import list_source

ROWS = [{"id": f"r{i:02d}", "prompt": f"def f{i}(x):\n    return {i}", "extra": i} for i in range(23)]


def plan(path, shard_size=4, **data):
    config = DataConfig(path=str(path), **data)
    return scan_source(config, list_source(config), shard_size)


def all_rows(source, shard_size):
    """Every shard's rows read as a worker reads them, concatenated."""
    rows = [read_rows(source, s, min(s + shard_size, source.num_rows)) for s in range(0, source.num_rows, shard_size)]
    return [i for r in rows for i in r.ids], [t for r in rows for t in r.texts]


def test_record_offsets_match_a_line_by_line_reference():
    rng = random.Random(0)
    for _ in range(200):
        lines = [rng.choice(["", "  \t", json.dumps({"i": i, "p": "x" * rng.randint(0, 40)})]) for i in range(30)]
        data = "\n".join(lines).encode() + rng.choice([b"", b"\n"])
        every, first_row = rng.randint(1, 5), rng.randint(0, 7)
        limit = rng.choice([None, rng.randint(1, 25)])
        scan = scan_records(io.BytesIO(data), every=every, first_row=first_row, limit=limit, block_bytes=rng.randint(1, 64))
        starts, position = [], 0
        for raw in data.split(b"\n"):
            if raw.strip():
                starts.append(position)
            position += len(raw) + 1
        starts = starts[:limit]
        assert scan.rows == len(starts)
        assert scan.offsets.tolist() == [s for k, s in enumerate(starts) if (first_row + k) % every == 0]
        assert len(split_records(data[scan.data_start : scan.data_end])) == scan.rows


def test_records_over_the_limit_are_listed_with_their_lines_whatever_the_block_size():
    rng = random.Random(1)
    for _ in range(200):
        lines = [rng.choice(["", "x" * rng.randint(1, 12), "y" * rng.randint(13, 40)]) for _ in range(20)]
        data = ("a\n" + "\n".join(lines)).encode() + rng.choice([b"", b"\n"])
        every, limit = rng.randint(1, 4), rng.choice([None, rng.randint(1, 15)])
        scan = scan_records(io.BytesIO(data), every=every, limit=limit, block_bytes=rng.randint(1, 64), max_record_bytes=12)
        records, position = [], 0  # (start, length, line) of every non-blank record
        for line, raw in enumerate(data.split(b"\n"), start=1):
            if raw.strip():
                records.append((position, len(raw), line))
            position += len(raw) + 1
        records = records[:limit]
        assert scan.rows == len(records)
        assert scan.offsets.tolist() == [r[0] for k, r in enumerate(records) if k % every == 0]
        assert scan.lines.tolist() == [r[2] for k, r in enumerate(records) if k % every == 0]
        assert [(r.row, r.start, r.size, r.line) for r in scan.long_records] == [
            (k, start, size, line) for k, (start, size, line) in enumerate(records) if size > 12
        ]


def test_csv_records_keep_quoted_newlines_and_an_unclosed_quote_is_refused():
    data = b'id,prompt\n1,"a\nb"\n\n2,"say ""hi""\n"\n3,c'
    scan = scan_records(io.BytesIO(data), every=1, quoted=True, header=True, block_bytes=3)
    assert scan.rows == 3 and scan.header == b"id,prompt" and len(scan.offsets) == 3
    with pytest.raises(ScanError, match="never closed"):
        scan_records(io.BytesIO(b'id,prompt\n1,"open\n'), every=1, quoted=True, header=True)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet", "hf_disk"])
def test_every_format_plans_the_same_shards_and_rows(tmp_path, fmt):
    import datasets
    import pyarrow.csv as pacsv

    path = {"jsonl": tmp_path / "p.jsonl", "csv": tmp_path / "p.csv", "parquet": tmp_path / "p.parquet", "hf_disk": tmp_path / "hf"}[fmt]
    table = pa.Table.from_pylist(ROWS)
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" + ("\n" if i % 5 == 0 else "") for i, r in enumerate(ROWS)))
    elif fmt == "csv":
        pacsv.write_csv(table, path)
    elif fmt == "parquet":
        pq.write_table(table, path, row_group_size=5)
    else:
        datasets.Dataset.from_list(ROWS).save_to_disk(str(path), max_shard_size="1KB")
    source = plan(path, shard_size=4)
    assert source.num_rows == 23 and source.id_kind == "str" and source.format == fmt
    ids, texts = all_rows(source, 4)
    assert ids == [r["id"] for r in ROWS] and texts == [r["prompt"] for r in ROWS]
    limited = plan(path, shard_size=4, limit=10)
    assert limited.num_rows == 10 and all_rows(limited, 4)[0] == [r["id"] for r in ROWS[:10]]


def test_a_directory_of_files_is_one_input_and_shards_span_files(tmp_path):
    for part, rows in enumerate((ROWS[:7], ROWS[7:8], ROWS[8:])):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"part-{part}.parquet", row_group_size=3)
    (tmp_path / "_SUCCESS").write_text("")  # marker files are not data
    source = plan(tmp_path, shard_size=5)
    assert [f.num_rows for f in source.files] == [7, 1, 15] and source.num_rows == 23
    pieces = source.pieces(5, 10)
    assert [(p.file, p.start, p.stop) for p in pieces] == [(0, 5, 7), (1, 0, 1), (2, 0, 2)]
    assert all_rows(source, 5)[0] == [r["id"] for r in ROWS]
    identity = list_source(DataConfig(path=str(tmp_path))).identity()
    assert [f["path"].rsplit("/", 1)[-1] for f in identity] == ["part-0.parquet", "part-1.parquet", "part-2.parquet"]
    assert all(f["size"] > 0 and f["mtime_ns"] for f in identity)


def test_duplicate_ids_across_files_are_named(tmp_path):
    pq.write_table(pa.Table.from_pylist(ROWS[:5]), tmp_path / "a.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[3:9]), tmp_path / "b.parquet")
    with pytest.raises(JobInputError, match=r"duplicate ids .*'r03' at rows 3 and 5 \(2 duplicate row\(s\) in all\)"):
        plan(tmp_path)


def test_parquet_null_prompts_from_statistics_or_from_the_workers(tmp_path):
    rows = [{"id": i, "prompt": None if i == 6 else "x"} for i in range(9)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "stats.parquet", row_group_size=4)
    with pytest.raises(JobInputError, match=r"data.prompt_column: row 6 \(id 6\) of .*stats.parquet: prompt is null"):
        plan(tmp_path / "stats.parquet")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bare.parquet", write_statistics=False)
    source = plan(tmp_path / "bare.parquet", shard_size=4)  # no statistics: the worker finds it
    problems = read_rows(source, 4, 8).problems
    assert problems[:2] == [None, None] and "row 6 (id 6)" in problems[2] and "prompt is null" in problems[2]


def test_jsonl_problems_are_found_up_front_with_line_and_row(tmp_path):
    def error(text):
        (tmp_path / "p.jsonl").write_text(text)
        with pytest.raises(JobInputError) as caught:
            plan(tmp_path / "p.jsonl")
        return str(caught.value)

    good = "".join(json.dumps({"id": i, "prompt": "x"}) + "\n" for i in range(50))
    (tmp_path / "p.jsonl").write_text(good + "\n{oops\n")  # not JSON: an error row, not the job's end (#40)
    assert "line 52 is not valid JSON" in read_rows(plan(tmp_path / "p.jsonl"), 48, 51).problems[2]
    assert "row 50 (id 50)" in error(good + '{"id": 50, "prompt": 7}\n') and "prompt is int 7" in error(good + '{"id": 50, "prompt": 7}\n')
    assert re.search(r"row 50 of .*p.jsonl has a null id", error(good + '{"id": null, "prompt": "x"}\n'))
    assert "mixes int and string ids" in error(good + '{"id": "50", "prompt": "x"}\n')
    assert "id 1.5 is float" in error(good + '{"id": 1.5, "prompt": "x"}\n')


UNREADABLE = {  # record (1-based, the line but for a blank line after line 6) -> (its bytes, its problem's words)
    3: (b'{"id": "r02", "prompt": "a\xff\xfe b"}', "is not valid UTF-8 (byte 0xff at column 27)"),
    5: (b'{"id": "r04", "prompt": "a \\ud800 b"}', "holds a lone surrogate escape"),
    8: (b'{"id": "r07", "prompt": oops}', "is not valid JSON"),
    9: (b'["r08", "a list"]', "is a JSON list, expected an object"),
    12: (b'{"id": "r11", "prompt": "' + b"long " * 100 + b'"}', "is 527 bytes long, over data.max_record_bytes"),
}


@pytest.mark.parametrize("name", ["p.jsonl", "p.jsonl.gz"])
def test_unreadable_jsonl_records_are_rows_whose_problem_names_file_and_line(tmp_path, name):
    """Issue #40: bad UTF-8, a lone surrogate escape, not JSON, not an object, or a record over
    data.max_record_bytes: a row of its own (its id if it has a clean one, else its row number) with a
    problem naming the file and the line; the scan refuses nothing, every other row reads as usual."""
    import gzip

    lines = [json.dumps({"id": f"r{i:02d}", "prompt": f"p{i}"}).encode() for i in range(14)]
    for line, (record, _) in UNREADABLE.items():
        lines[line - 1] = record
    data = b"\n".join(lines[:6] + [b"  "] + lines[6:]) + b"\n"  # a blank line: lines after it move down one
    (tmp_path / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    source = plan(tmp_path / name, shard_size=4, max_record_bytes=200)
    rows = [read_rows(source, s, min(s + 4, source.num_rows)) for s in range(0, source.num_rows, 4)]
    ids = [i for r in rows for i in r.ids]
    problems = [p for r in rows for p in r.problems]
    # no id to read in lines 8 and 9 (not JSON, not an object) nor in a record never read (over the limit)
    assert ids == [f"r{i:02d}" for i in range(7)] + ["7", "8", "r09", "r10", "11", "r12", "r13"]
    for line, (_, words) in UNREADABLE.items():
        problem = problems[line - 1]
        assert problem.startswith(f"data.path: {tmp_path / name} line {line + (line > 6)} ") and words in problem
    assert sum(p is not None for p in problems) == len(UNREADABLE)
    assert [t for r in rows for t in r.texts][13] == "p13"


def test_unreadable_csv_records_are_rows_and_input_without_line_breaks_is_refused(tmp_path):
    rows = [f"{i},p{i}".encode() for i in range(8)]
    rows[2] = b"2,p2,extra"  # another number of fields
    rows[4] = b'4,"two\nlines \xff"'  # not UTF-8, over two lines
    rows[6] = b"6," + b"q" * 300  # over max_record_bytes
    (tmp_path / "p.csv").write_bytes(b"id,prompt\n" + b"\n".join(rows) + b"\n")
    source = plan(tmp_path / "p.csv", shard_size=4, max_record_bytes=200)
    read = [read_rows(source, 0, 4), read_rows(source, 4, 8)]
    problems = [p for r in read for p in r.problems]
    assert [i for r in read for i in r.ids] == list(range(8))
    assert [t for r in read for t in r.texts] == ["p0", "p1", None, "p3", None, "p5", None, "p7"]
    where = f"data.path: {tmp_path / 'p.csv'}"
    assert problems[2] == f"{where} line 4 has 3 fields, expected 2"
    assert problems[4].startswith(f"{where} line 6 is not valid UTF-8")
    assert problems[6] == f"{where} line 9 is 302 bytes long, over data.max_record_bytes"

    # one long record with no line break at all: refused up front (one line), read once, not again per block
    (tmp_path / "one.jsonl").write_bytes(b'{"id": 1, "prompt": "' + b"z" * 5000 + b'"}')
    with pytest.raises(JobInputError, match=r"no line break in its 5023 bytes, over data.max_record_bytes=200"):
        plan(tmp_path / "one.jsonl", max_record_bytes=200)
    assert plan(tmp_path / "one.jsonl").num_rows == 1  # under the default 4 MiB it is one record


def test_a_long_record_is_skipped_in_time_linear_in_its_size():
    """A record over max_record_bytes is read on to its end block by block, never held nor scanned again."""
    class Counting(io.BytesIO):
        served = 0

        def read(self, n=-1):
            chunk = super().read(n)
            Counting.served += len(chunk)
            return chunk

    scanned = []
    data = b"a\n" + b"x" * (1 << 20) + b"\nb\n"
    stream = Counting(data)
    scan = scan_records(stream, every=1, block_bytes=1 << 10, max_record_bytes=1 << 12,
                        on_block=lambda block: scanned.append(len(block.data)))  # fmt: skip
    assert scan.rows == 3 and [(r.row, r.start, r.stop, r.line) for r in scan.long_records] == [(1, 2, 2 + (1 << 20), 2)]
    assert Counting.served == len(data) and sum(scanned) < 16  # the long record reaches no block


def test_chat_messages_are_checked_per_row_by_the_reader(tmp_path):
    rows = [{"id": 1, "messages": [{"role": "user", "content": "hi"}]}, {"id": 2, "messages": [{"role": "user"}]}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = plan(tmp_path / "chat.jsonl", chat=True)
    rows_read = read_rows(source, 0, 2)
    assert rows_read.messages[0] == [{"role": "user", "content": "hi"}] and rows_read.problems[0] is None
    assert rows_read.messages[1] is None and "row 1 (id 2)" in rows_read.problems[1]


BUDGET_ROWS = [{"id": f"r{i:02d}", "prompt": f"p{i}", "budget": 2 if i % 2 else 30} for i in range(23)]


def write_rows(path, fmt, rows):
    import datasets
    import pyarrow.csv as pacsv

    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "csv":
        pacsv.write_csv(pa.Table.from_pylist(rows), path)
    elif fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=5)
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path), max_shard_size="1KB")
    return path


FORMAT_PATHS = {"jsonl": "p.jsonl", "csv": "p.csv", "parquet": "p.parquet", "hf_disk": "hf"}


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet", "hf_disk"])
def test_per_row_budgets_are_read_with_their_rows(tmp_path, fmt):
    path = write_rows(tmp_path / FORMAT_PATHS[fmt], fmt, BUDGET_ROWS)
    config = DataConfig(path=str(path), max_new_tokens_column="budget")
    source = scan_source(config, list_source(config), 4, max_new_tokens_limit=63)
    assert source.budget_column == "budget" and source.max_budget == 30
    rows = [read_rows(source, s, min(s + 4, 23)) for s in range(0, 23, 4)]
    assert [b for r in rows for b in r.budgets] == [r["budget"] for r in BUDGET_ROWS]
    assert not any(p for r in rows for p in r.problems)


BAD_BUDGETS = {  # value at row 13 -> what the message says
    "text": ("many", r"max_new_tokens is str 'many', expected an integer >= 1"),
    "float": (2.5, r"max_new_tokens is float 2.5, expected an integer >= 1"),
    "zero": (0, r"max_new_tokens is 0, expected an integer >= 1"),
    "negative": (-4, r"max_new_tokens is -4, expected an integer >= 1"),
    "null": (None, r"max_new_tokens is null"),
    "over the limit": (64, r"max_new_tokens is 64, over the models' limit of 63 new tokens"),
}
# what a typed file cannot hold: its whole column is then refused by type
BY_TYPE = {("parquet", "text"), ("parquet", "float"), ("hf_disk", "text"), ("hf_disk", "float")}


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet", "hf_disk"])
@pytest.mark.parametrize("case", sorted(BAD_BUDGETS))
def test_a_bad_budget_is_refused_up_front_naming_column_row_and_file(tmp_path, fmt, case):
    value, words = BAD_BUDGETS[case]
    rows = [dict(r) for r in BUDGET_ROWS]
    rows[13]["budget"] = value
    if (fmt, case) in BY_TYPE:  # a typed column holds one type: every value is of the bad one
        cast = str if case == "text" else float
        rows = [{**r, "budget": value if k == 13 else cast(r["budget"])} for k, r in enumerate(rows)]
    if fmt == "csv":  # as a CSV writer writes them
        rows = [{**r, "budget": None if r["budget"] is None else str(r["budget"])} for r in rows]
    path = write_rows(tmp_path / FORMAT_PATHS[fmt], fmt, rows)
    config = DataConfig(path=str(path), max_new_tokens_column="budget")
    with pytest.raises(JobInputError) as caught:
        scan_source(config, list_source(config), 4, max_new_tokens_limit=63)
    message = str(caught.value)
    assert message.startswith("data.max_new_tokens_column: ")
    if (fmt, case) in BY_TYPE:
        assert re.search(r"column 'budget' of .* holds (string|double), expected integers", message), message
        return
    if fmt == "csv" and case == "float":
        words = r"max_new_tokens is str '2.5', expected an integer >= 1"  # CSV fields are text
    assert re.search(rf"row 13 \(id 'r13'\) of \S+: column 'budget': {words}", message), message
    assert str(path.name) in message or fmt == "hf_disk"


def test_a_missing_budget_column_is_named(tmp_path):
    path = write_rows(tmp_path / "p.jsonl", "jsonl", ROWS)
    config = DataConfig(path=str(path), max_new_tokens_column="budget")
    with pytest.raises(JobInputError, match=r"data.max_new_tokens_column: column 'budget' not found in .*p.jsonl"):
        scan_source(config, list_source(config), 4)


def _write_compressed(path, data: bytes, codec: str) -> None:
    with pa.CompressedOutputStream(str(path), codec) as out:
        out.write(data)


@pytest.mark.parametrize("name,codec", [("p.jsonl.gz", "gzip"), ("p.jsonl.zst", "zstd"), ("p.csv.gz", "gzip")])
def test_compressed_text_inputs_plan_and_read_like_plain_ones(tmp_path, name, codec):
    """Told from the extension, scanned through the codec, and read by a worker that decompresses in a
    stream: every shard's rows equal the plain file's, in order and out of order (a stream reopened).
    The old worker read (a byte range of the compressed file) does not give the rows (negative control)."""
    from pipeline import fs
    from pipeline.prompts import ReadCache

    if name.startswith("p.csv"):
        buffer = io.BytesIO()
        import pyarrow.csv as pacsv

        pacsv.write_csv(pa.Table.from_pylist([{"id": r["id"], "prompt": r["prompt"]} for r in ROWS]), buffer)
        data = buffer.getvalue()
    else:
        data = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    plain = tmp_path / name.rsplit(".", 1)[0]
    plain.write_bytes(data)
    _write_compressed(tmp_path / name, data, codec)
    expected = all_rows(plan(plain, shard_size=4, id_column="id"), 4)
    source = plan(tmp_path / name, shard_size=4, id_column="id")
    assert source.format == name.split(".")[1] and all_rows(source, 4) == expected
    cache = ReadCache()
    ranges = [(8, 12), (0, 4), (20, 23), (12, 16)]  # backwards too: the stream starts again
    for start, stop in ranges:
        assert read_rows(source, start, stop, cache).ids == expected[0][start:stop]
    piece = source.pieces(4, 8)[0]
    raw = fs.read_range(fs.resolve(source.files[0].uri, "data.path"), piece.byte_start, piece.byte_stop)
    assert raw != cache.text_range(source.files[0].uri, piece.byte_start, piece.byte_stop)


def test_a_directory_of_compressed_files_and_a_compressed_parquet_name(tmp_path):
    for k in range(2):
        rows = ROWS[k * 12 : (k + 1) * 12]
        _write_compressed(tmp_path / f"part{k}.jsonl.gz", "".join(json.dumps(r) + "\n" for r in rows).encode(), "gzip")
    source = plan(tmp_path, shard_size=5, id_column="id")
    assert source.format == "jsonl" and all_rows(source, 5)[0] == [r["id"] for r in ROWS]
    (tmp_path / "x.parquet.gz").write_bytes(b"")
    with pytest.raises(JobInputError, match="cannot tell the format"):
        plan(tmp_path / "x.parquet.gz")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_one_reader_per_format_serves_both_the_plan_and_the_workers(tmp_path, fmt, monkeypatch):
    """pipeline.readers.READERS is the only dispatch: a reader swapped in there is what the scan and the reads use."""
    from pipeline import readers
    from pipeline.formats import FORMATS

    assert set(readers.READERS) == set(FORMATS)
    assert all(reader.format.name == name for name, reader in readers.READERS.items())
    calls = {"scan": 0, "read": 0}
    real = readers.READERS[fmt]

    def counted(kind, function):
        def call(*args):
            calls[kind] += 1
            return function(*args)
        return call

    monkeypatch.setitem(readers.READERS, fmt, readers.FormatReader(
        real.format, counted("scan", real.scan), real.columns, counted("read", real.read)))
    path = write_rows(tmp_path / f"p.{fmt}", fmt, ROWS)
    source = plan(path, shard_size=8, id_column="id")
    ids, _ = all_rows(source, 8)
    assert ids == [r["id"] for r in ROWS] and calls == {"scan": 1, "read": 3}


def test_the_modules_below_the_readers_import_neither_the_readers_nor_the_prompts():
    """No import circle: prompts -> readers -> scanners -> source -> formats, never back."""
    import ast
    from pathlib import Path

    import pipeline

    root = Path(pipeline.__file__).parent
    for module in ("source", "scanners", "linescan", "rowcheck", "formats", "row_columns"):
        tree = ast.parse((root / f"{module}.py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert not imported & {"pipeline.readers", "pipeline.prompts"}, module


def test_a_sampling_params_column_the_job_does_not_read_is_named_once(tmp_path, caplog, monkeypatch):
    import pipeline.source

    monkeypatch.setattr(pipeline.source, "_HINTED", [False])
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "x", "sampling_params": {"temperature": 0}}) + "\n")
    with caplog.at_level("WARNING", logger="pipeline"):
        plan(path)
        plan(path)
    hints = [r.getMessage() for r in caplog.records if "sampling_params" in r.getMessage()]
    assert len(hints) == 1 and "data.sampling_params_column=sampling_params" in hints[0]
    caplog.clear()
    monkeypatch.setattr(pipeline.source, "_HINTED", [False])
    with caplog.at_level("WARNING", logger="pipeline"):
        plan(path, sampling_params_column="sampling_params")
    assert not [r for r in caplog.records if "does not read" in r.getMessage()]
