"""One reader per input format, used by both the plan and the workers: the only format-dispatch table.

    source = scan_source(data, list_source(data), shard_size)    # the driver: READERS[format].scan
    READERS[source.format].read(source, piece, cache)            # a worker (pipeline.prompts.read_rows)

A `FormatReader` holds what the job does with one format of `pipeline.formats.FORMATS`: the driver's
pass (`scan`: row counts, shard offsets and the up-front checks, in `pipeline.scanners`), the column
names (and schema, where the format has one) of a file (`columns`, for `pipeline.row_columns`), and a
worker's read of one piece of a shard (`read`: a JSON-lines or CSV byte range, decompressed in a stream
for a compressed file; the Parquet row groups or the Arrow file that hold it). A new format is one
entry of `FORMATS` and one `FormatReader` here.

A JSON-lines or CSV record that cannot be read (not UTF-8, not JSON, another number of CSV fields, or over
`data.max_record_bytes`: then the worker never reads its bytes, the scan listed where it is) is a row
whose problem names the file and the line; its id is its clean id where one can be read, else None (the
row number stands in: `pipeline.prompts`). Parquet and Arrow rows are converted per column, and per value
only when a column fails: a value that is not valid UTF-8 costs its row alone (a problem naming the row, its
id, the column and the byte); a Parquet row group that fails every read (`GROUP_READS`, afresh after the
first: a corrupt page) costs its rows in the piece, named as a row range with the reason.

Imports point one way, `prompts -> readers -> scanners -> source -> formats`: nothing below imports
this module. Not here: listing files (`pipeline.source`), the per-format scans themselves
(`pipeline.scanners`), checking and shaping rows (`pipeline.prompts`), the formats' names, extensions
and codecs (`pipeline.formats`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from pipeline.config import DataConfig
from pipeline.errors import JobInputError
from pipeline.formats import (
    FORMATS,
    InputFormat,
    csv_options,
    jsonl_record,
    parse_jsonl_record,
    read_csv_records,
    record_problem,
    usable_id,
)
from pipeline.linescan import split_records_with_lines
from pipeline.row_columns import RowColumns, SampleCounts, resolve_columns
from pipeline.rowcheck import BudgetCheck, ColumnCheck
from pipeline.scanners import (
    _arrow_table,
    _first_record,
    _open_parquet,
    scan_arrow,
    scan_csv,
    scan_jsonl,
    scan_parquet,
)
from pipeline.source import Piece, ScanResult, Source, SourceListing, text_column

# (ids or None, prompt values, budget values or None, the extra columns' values, each row's problem or None
# when none has one) of one piece
PieceValues = tuple[list[Any] | None, list[Any], list[Any] | None, dict[str, list[Any]], list[str | None] | None]


@dataclass(frozen=True)
class FormatReader:
    """What the plan and the workers do with one input format.

    scan(data, listing, shard_size, checks) -> ScanResult: the driver's pass over every file (`checks`: the
    column checks that read one more column on the way: `pipeline.rowcheck.ColumnCheck`).
    columns(uri, result) -> (names, schema or None): a file's column names, for the kept/stop/params columns.
    read(source, piece, cache) -> PieceValues: a worker's read of one piece (`cache`: a
    `pipeline.prompts.ReadCache`, which keeps footers, row groups and decompressing streams between shards).
    """

    format: InputFormat
    scan: Callable[[DataConfig, SourceListing, int, tuple[ColumnCheck, ...]], ScanResult]
    columns: Callable[[str, ScanResult], tuple[list[str], pa.Schema | None]]
    read: Callable[[Source, Piece, Any], PieceValues]


# --- the workers' reads ---------------------------------------------------------------------------------


def _piece_records(
    source: Source, piece: Piece, cache: Any, quoted: bool
) -> tuple[list[bytes | None], list[int], list[str | None]]:
    """The piece's records in order, the line each starts on, and the problem of each record over
    data.max_record_bytes (its bytes are never read: None in the records)."""
    f = source.files[piece.file]
    records: list[bytes | None] = []
    lines: list[int] = []
    problems: list[str | None] = []
    position, line = piece.byte_start, piece.first_line
    for long in [r for r in f.long_records if piece.start <= r.row < piece.stop] + [None]:
        stop = piece.byte_stop if long is None else long.start
        data = cache.text_range(f.uri, position, stop) if stop > position else b""
        for raw, offset in split_records_with_lines(data, quoted):
            records.append(raw)
            lines.append(line + offset)
            problems.append(None)
        if long is not None:
            records.append(None)
            lines.append(long.line)
            problems.append(record_problem(f.uri, long.line, f"is {long.size} bytes long, over data.max_record_bytes"))
            position, line = long.stop + 1, long.next_line
    return records, lines, problems


def _read_jsonl(source: Source, piece: Piece, cache: Any) -> PieceValues:
    uri = source.files[piece.file].uri
    raws, lines, problems = _piece_records(source, piece, cache, quoted=False)
    records: list[dict[str, Any]] = []
    for i, raw in enumerate(raws):
        record, problem = parse_jsonl_record(raw) if raw is not None else (None, None)
        if problem:
            problems[i] = record_problem(uri, lines[i], problem)
        if problems[i]:  # an unreadable record: only a clean id of it is kept
            record = {source.id_column: usable_id(record, source.id_column)} if source.id_column else None
        records.append(record or {})
    values = [record.get(source.text_column) for record in records]
    ids = [record.get(source.id_column) for record in records] if source.id_column else None
    budgets = [record.get(source.budget_column) for record in records] if source.budget_column else None
    extras = {c: [record.get(c) for record in records] for c in source.columns.read}
    good = [i for i, problem in enumerate(problems) if not problem]
    typed = _typed_jsonl_columns(source, b"".join(raws[i] + b"\n" for i in good), len(good), uri) if good else {}
    for column, values_read in typed.items():
        extras[column] = _spread(values_read, good, len(records))
    return ids, values, budgets, extras, problems if len(good) < len(records) else None


def _spread(values: list[Any], positions: list[int], size: int) -> list[Any]:
    """`values` at `positions` of a list of `size` Nones (the readable rows among all of a piece's)."""
    spread: list[Any] = [None] * size
    for position, value in zip(positions, values):
        spread[position] = value
    return spread


def _typed_jsonl_columns(source: Source, data: bytes, rows: int, where: str) -> dict[str, list[Any]]:
    """The kept columns the scan typed (not as strings) through pyarrow's JSON reader with those types, so
    that a value converts as pyarrow converts it (a date string to a timestamp, an int to a double)."""
    import pyarrow.json as pj

    typed = [(c, t) for c, t in source.columns.kept if not (pa.types.is_string(t) or pa.types.is_large_string(t))]
    if not typed:
        return {}
    table = pj.read_json(
        pa.BufferReader(data), read_options=pj.ReadOptions(block_size=max(1 << 20, len(data) + 1)),
        parse_options=pj.ParseOptions(explicit_schema=pa.schema(typed), unexpected_field_behavior="ignore"),
    )  # fmt: skip
    if table.num_rows != rows:
        raise ValueError(f"{where}: pyarrow read {table.num_rows} JSON records where {rows} were found")
    return {c: table.column(c).to_pylist() for c, _ in typed}


def _read_csv(source: Source, piece: Piece, cache: Any) -> PieceValues:
    uri = source.files[piece.file].uri
    raws, lines, problems = _piece_records(source, piece, cache, quoted=True)
    id_type = pa.int64() if source.id_kind == "int" else pa.string()
    read, parse, convert = csv_options(
        source.csv_header or (), source.text_column, source.id_column, id_type, source.budget_column,
        source.columns.read, dict(source.columns.kept),
    )
    good = [i for i, raw in enumerate(raws) if raw is not None]
    if not good:  # every record is over max_record_bytes
        nothing = [None] * len(raws)
        return (nothing if source.id_column else None), nothing, (nothing if source.budget_column else None), {
            c: nothing for c in source.columns.read}, problems
    table, unreadable = read_csv_records(b"".join(raws[i] + b"\n" for i in good), read, parse, convert)
    for index, problem in unreadable.items():
        problems[good[index]] = record_problem(uri, lines[good[index]], problem)
    ids, values, budgets, extras, _ = _split(source, table)
    read_rows = [i for i, problem in enumerate(problems) if not problem]
    if len(read_rows) == len(raws):
        return ids, values, budgets, extras, None
    return (
        None if ids is None else _spread(ids, read_rows, len(raws)), _spread(values, read_rows, len(raws)),
        None if budgets is None else _spread(budgets, read_rows, len(raws)),
        {c: _spread(v, read_rows, len(raws)) for c, v in extras.items()}, problems,
    )  # fmt: skip


def _columns(source: Source) -> list[str]:
    return (
        [source.text_column]
        + ([source.id_column] if source.id_column else [])
        + ([source.budget_column] if source.budget_column else [])
        + [c for c in source.columns.read if c not in (source.text_column, source.id_column, source.budget_column)]
    )


def _read_parquet(source: Source, piece: Piece, cache: Any) -> PieceValues:
    """The piece's rows from the row groups that hold them; a row group that cannot be decoded (a corrupt
    page: it fails again when read afresh) is error rows naming its row range and the reason."""
    f = source.files[piece.file]
    parquet, starts = cache.parquet(f.uri)
    first = bisect.bisect_right(starts, piece.start) - 1
    last = bisect.bisect_right(starts, piece.stop - 1) - 1
    parts: list[PieceValues] = []
    for group in range(first, last + 1):
        lo, hi = max(piece.start, int(starts[group])), min(piece.stop, int(starts[group + 1]))
        table, problem = _row_group(cache, f.uri, parquet, group, _columns(source))
        if table is None:
            where = f"data.path: rows {f.first_row + lo}-{f.first_row + hi - 1} of {f.uri} (row group {group})"
            parts.append(_unreadable(source, hi - lo, f"{where} cannot be read: {problem}"))
        else:
            parts.append(_split(source, table.slice(lo - int(starts[group]), hi - lo), f.first_row + lo, f.uri))
    return parts[0] if len(parts) == 1 else _joined(parts)


GROUP_READS = 3  # a row group that fails this many reads in a row (the later ones afresh) is corrupt, not unlucky


def _row_group(cache: Any, uri: str, parquet: Any, group: int, columns: list[str]) -> tuple[pa.Table | None, str]:
    """(the row group, "") or (None, why it cannot be read): a read that fails is tried again on a freshly
    opened file (a transient read error passes; a corrupt page or group fails every time)."""
    import pyarrow.parquet as pq

    from pipeline import fs

    problem = ""
    for attempt in range(GROUP_READS):
        try:
            if attempt == 0:
                return cache.row_group(uri, parquet, group, columns), ""
            location = fs.resolve(uri, "data.path")
            return pq.ParquetFile(location.filesystem.open_input_file(location.path)).read_row_group(
                group, columns=columns), ""
        except (OSError, pa.ArrowException) as err:
            text = "".join(c if c.isprintable() else " " for c in str(err))
            problem = f"{type(err).__name__}: {' '.join(text.split())[:200]}"
    return None, problem


def _unreadable(source: Source, rows: int, problem: str) -> PieceValues:
    """`rows` rows that could not be read: no values, each with `problem`."""
    nothing: list[Any] = [None] * rows
    return (
        list(nothing) if source.id_column else None, list(nothing),
        list(nothing) if source.budget_column else None, {c: list(nothing) for c in source.columns.read},
        [problem] * rows,
    )  # fmt: skip


def _joined(parts: list[PieceValues]) -> PieceValues:
    """Consecutive parts of one piece as one."""
    ids = None if parts[0][0] is None else [v for part in parts for v in part[0]]
    values = [v for part in parts for v in part[1]]
    budgets = None if parts[0][2] is None else [v for part in parts for v in part[2]]
    extras = {c: [v for part in parts for v in part[3][c]] for c in parts[0][3]}
    problems = None
    if any(part[4] for part in parts):
        problems = [p for part in parts for p in (part[4] or [None] * len(part[1]))]
    return ids, values, budgets, extras, problems


def _read_arrow(source: Source, piece: Piece, cache: Any) -> PieceValues:
    f = source.files[piece.file]
    table = cache.arrow(f.uri)
    rows = table.slice(piece.start, piece.stop - piece.start).select(_columns(source))
    return _split(source, rows, f.first_row + piece.start, f.uri)


def _split(source: Source, table: pa.Table, first_row: int = 0, where: str = "") -> PieceValues:
    """The rows' values by column; a value that cannot be converted (a string that is not valid UTF-8) is a
    problem of its row alone, naming the row, its id when readable, the column and the reason."""
    found: dict[int, str] = {}  # row of the table -> its first problem
    ids = _values(table, source.id_column, found) if source.id_column else None
    values = _values(table, source.text_column, found)
    budgets = _values(table, source.budget_column, found) if source.budget_column else None
    extras = {c: _values(table, c, found) for c in source.columns.read}
    if not found:
        return ids, values, budgets, extras, None
    problems: list[str | None] = [None] * table.num_rows
    for row, problem in found.items():
        row_id = ids[row] if ids is not None else first_row + row
        problems[row] = f"data.path: row {first_row + row} (id {row_id!r}) of {where}: {problem}"
        values[row] = None
        if budgets is not None:
            budgets[row] = None
        for column in extras.values():
            column[row] = None
    return ids, values, budgets, extras, problems


def _values(table: pa.Table, name: str, found: dict[int, str]) -> list[Any]:
    """A column as Python values; a value that cannot be converted is None, its row's problem in `found`."""
    column = table.column(name)
    try:
        return column.to_pylist()
    except (UnicodeDecodeError, pa.ArrowException):  # per value, to find which (the rare case)
        pass
    values: list[Any] = []
    for row, scalar in enumerate(s for chunk in column.chunks for s in chunk):
        try:
            values.append(scalar.as_py())
        except UnicodeDecodeError as err:
            values.append(None)
            found.setdefault(row, f"column '{name}' is not valid UTF-8 (byte 0x{err.object[err.start]:02x} at "
                                  f"position {err.start + 1} of the value)")
        except (ValueError, pa.ArrowException) as err:
            values.append(None)
            found.setdefault(row, f"column '{name}' cannot be read ({type(err).__name__}: {err})")
    return values


# --- a file's columns ----------------------------------------------------------------------------------


def _parquet_columns(uri: str, result: ScanResult) -> tuple[list[str], pa.Schema | None]:
    schema = _open_parquet(uri).schema_arrow
    return list(schema.names), schema


def _arrow_columns(uri: str, result: ScanResult) -> tuple[list[str], pa.Schema | None]:
    schema = _arrow_table(uri).schema
    return list(schema.names), schema


def _jsonl_columns(uri: str, result: ScanResult) -> tuple[list[str], pa.Schema | None]:
    first = _first_record(uri, quoted=False)
    return (list(jsonl_record(first.data.rstrip(b"\r\n"), uri, line=first.first_line)) if first else []), None


def _csv_columns(uri: str, result: ScanResult) -> tuple[list[str], pa.Schema | None]:
    return list(result.csv_header or ()), None


READERS: dict[str, FormatReader] = {
    "parquet": FormatReader(FORMATS["parquet"], scan_parquet, _parquet_columns, _read_parquet),
    "hf_disk": FormatReader(FORMATS["hf_disk"], scan_arrow, _arrow_columns, _read_arrow),
    "jsonl": FormatReader(FORMATS["jsonl"], scan_jsonl, _jsonl_columns, _read_jsonl),
    "csv": FormatReader(FORMATS["csv"], scan_csv, _csv_columns, _read_csv),
}
assert set(READERS) == set(FORMATS), "every format of pipeline.formats.FORMATS has one reader"


def reader_of(name: str) -> FormatReader:
    if name not in READERS:
        raise JobInputError(f"data.format: unknown format {name!r}")
    return READERS[name]


# --- the plan -----------------------------------------------------------------------------------------


def scan_source(
    data: DataConfig, listing: SourceListing, shard_size: int, max_new_tokens_limit: int | None = None,
    samples: SampleCounts | None = None,
) -> Source:
    """Row counts, shard offsets and every up-front check (`pipeline.scanners`' docstring says which).

    max_new_tokens_limit: the most new tokens the models take (with `data.max_new_tokens_column`).
    samples: counts each row's n from `data.sampling_params_column` on the same pass (the plan's)."""
    reader = reader_of(listing.format)
    column = data.max_new_tokens_column
    budgets = None if column is None else BudgetCheck(column, max_new_tokens_limit)
    checks = tuple(c for c in (budgets, samples) if c is not None)
    result = reader.scan(data, listing, shard_size, checks)
    if result.num_rows == 0:
        raise JobInputError(f"data.path: {listing.path} holds no rows")
    column, _ = text_column(data)
    files = tuple(f for f in result.files if f.num_rows)
    return Source(
        path=listing.path,
        format=listing.format,
        files=files,
        num_rows=result.num_rows,
        shard_size=shard_size,
        text_column=column,
        id_column=data.id_column if result.has_id else None,
        id_kind=result.id_kind if result.has_id else "int",
        chat=data.chat,
        csv_header=result.csv_header,
        first_rows=tuple(f.first_row for f in files),
        budget_column=data.max_new_tokens_column,
        max_budget=None if budgets is None else budgets.largest,
        columns=_row_columns(data, listing, result, reader),
    )


def _row_columns(data: DataConfig, listing: SourceListing, result: ScanResult, reader: FormatReader) -> RowColumns:
    """The kept / stop / sampling-params columns against the first file's columns (and types, where it has some)."""
    if not (data.keep_columns or data.stop_column or data.sampling_params_column):
        return RowColumns()
    uri = listing.files[0].uri
    names, schema = reader.columns(uri, result)
    return resolve_columns(data, names, schema, listing.format, uri, result.kept_types)


def input_rows(listing: SourceListing, max_bytes: int = 64 << 20) -> int | None:
    """Every row of the input, ignoring data.limit (for the first line's "first N of M rows"): from the metadata
    (Parquet footers, saved datasets) or, for JSON lines / CSV of at most `max_bytes` in all, one count of their
    records; None when counting would mean reading a large text input."""
    from pipeline import fs
    from pipeline.formats import open_text_stream
    from pipeline.linescan import scan_records
    from pipeline.scanners import _arrow_table, _open_parquet

    if listing.format == "parquet":
        return sum(_open_parquet(f.uri).metadata.num_rows for f in listing.files)
    if listing.format == "hf_disk":
        return sum(_arrow_table(f.uri).num_rows for f in listing.files)
    if sum(f.size for f in listing.files) > max_bytes:
        return None
    quoted = listing.format == "csv"
    rows = 0
    for f in listing.files:
        with open_text_stream(fs.resolve(f.uri, "data.path")) as stream:
            rows += scan_records(stream, every=1 << 40, quoted=quoted, header=quoted).rows
    return rows


def limit_note(data: DataConfig, listing: SourceListing, num_rows: int) -> str:
    """"first N of M rows (data.limit)" when data.limit left rows of the input out, else ""."""
    if data.limit is None or num_rows < data.limit:
        return ""
    total = input_rows(listing)
    if total is None:
        return f"first {num_rows:,} rows of a larger input (data.limit)"
    return f"first {num_rows:,} of {total:,} rows (data.limit)" if total > num_rows else ""
