"""The driver's pass over the input, per format: row counts, shard offsets, and the up-front row checks.

    result = scan_jsonl(data, listing, shard_size, checks)   # one per format; pipeline.readers dispatches

- Parquet: row counts from the footers; prompt nulls from the column statistics; the id column streamed.
- Arrow (`datasets.save_to_disk`): the record batches' lengths and null counts (memory-mapped when local);
  the id column streamed.
- JSON lines: one streaming pass (`pipeline.linescan`) keeps every `shard_size`-th record's byte offset
  and hands each block to pyarrow's JSON reader for the ids and prompts; a block pyarrow rejects (or
  counts differently, or that is not UTF-8) is read again line by line in Python, which names the exact
  line and row.
- CSV: the same, quote-aware, with pyarrow's CSV reader; the header is the first record of each file.
- An unreadable record (not UTF-8, not JSON, a CSV record with another number of fields, one over
  `data.max_record_bytes`) is still a row, left out of the checks: the worker writes it as an error row
  naming the file and the line (`pipeline.readers`). Only a file with no line break at all is refused.
- With `data.keep_columns`: the kept columns' types for the whole job (`pipeline.row_columns.KeptTypes`):
  each Parquet / Arrow file's schema; for JSON lines and CSV, what the same readers infer for them on each
  block (the JSON reader then infers every field the explicit schema does not name), merged.

Every id goes through `IdChecker` (null, type, mixed, duplicates). What the checks say is in
`pipeline.source`'s docstring. `pipeline.readers` holds the one table of formats that picks a scan
(`scan_source`) and a worker's read. Not here: reading a shard's rows for generation (`pipeline.readers`,
`pipeline.prompts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipeline import fs
from pipeline.config import DataConfig
from pipeline.errors import JobInputError
from pipeline.formats import (
    csv_options,
    jsonl_record,
    open_text_stream,
    parse_jsonl_record,
    read_arrow_table,
    read_csv_records,
    usable_id,
)
from pipeline.linescan import Block, ScanError, scan_records
from pipeline.row_columns import KeptTypes, kept_names
from pipeline.rowcheck import (
    ColumnCheck,
    IdChecker,
    id_kind_of_type,
    id_value_problem,
    prompt_problem,
    row_where,
)
from pipeline.source import (
    ID_BATCH_ROWS,
    InputFile,
    ScanResult,
    SourceListing,
    check_columns,
    scan_error,
    text_column,
)


def _kept(data: DataConfig, names: list[str]) -> KeptTypes | None:
    """With data.keep_columns: the kept columns' types, to be merged over the whole scan."""
    return KeptTypes(kept_names(data, names)) if data.keep_columns else None


def _remaining(data: DataConfig, total: int) -> int | None:
    return None if data.limit is None else max(0, data.limit - total)


def _same_id_presence(before: bool | None, now: bool, where: str, data: DataConfig) -> bool:
    if before is not None and before != now:
        raise JobInputError(
            f"data.id_column: column '{data.id_column}' is in some input files and not in others ({where})"
        )
    return now


def _null_prompt(texts: pa.Array, ids: pa.Array | None, first_row: int, key: str, where: str) -> None:
    """Raise for the first null prompt of a batch."""
    if not texts.null_count:
        return
    position = int(pc.index(pc.is_null(texts), True).as_py())
    row_id = ids[position].as_py() if ids is not None else first_row + position
    raise JobInputError(f"{row_where(key, first_row + position, row_id, where)}: {prompt_problem(None)}")


# --- Parquet -------------------------------------------------------------------------------------------


def _open_parquet(uri: str) -> Any:
    import pyarrow.parquet as pq

    location = fs.resolve(uri, "data.path")
    try:
        return pq.ParquetFile(location.filesystem.open_input_file(location.path))
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise JobInputError(f"data.path: cannot read {uri} as Parquet: {str(err).splitlines()[0]}") from None


def scan_parquet(
    data: DataConfig, listing: SourceListing, shard_size: int, checks: tuple[ColumnCheck, ...] = ()
) -> ScanResult:
    checker = IdChecker(data.id_column, listing.path)
    files: list[InputFile] = []
    total, has_id, kept = 0, None, None
    for f in listing.files:
        remaining = _remaining(data, total)
        if remaining == 0:
            break
        parquet = _open_parquet(f.uri)
        schema = parquet.schema_arrow
        has_id = _same_id_presence(has_id, check_columns(schema.names, schema, data, f.uri), f.uri, data)
        kept = kept or _kept(data, schema.names)
        if kept is not None:
            kept.add_schema(schema, f.uri)
        rows = parquet.metadata.num_rows if remaining is None else min(remaining, parquet.metadata.num_rows)
        if not data.chat:
            _parquet_null_prompts(parquet, data, rows, total, f.uri, has_id)
        if has_id:
            for ids, first in _parquet_ids(parquet, data.id_column, rows, total):
                checker.add(ids, first)
        if checks:
            _parquet_checks(parquet, checks, data.id_column if has_id else None, rows, total, f.uri)
        files.append(dataclasses.replace(f, num_rows=rows, first_row=total))
        total += rows

    def reread() -> Iterator[tuple[pa.Array, int]]:
        for f in files:
            yield from _parquet_ids(_open_parquet(f.uri), data.id_column, f.num_rows, f.first_row)

    if has_id:
        checker.finish(reread)
    return ScanResult(files, total, bool(has_id), checker.kind or "int", kept_types=kept and kept.result())


def _parquet_ids(parquet: Any, column: str, rows: int, first_row: int) -> Iterator[tuple[pa.Array, int]]:
    for batch, first in _parquet_batches(parquet, [column], rows, first_row):
        yield batch.column(0), first


def _parquet_batches(parquet: Any, columns: list[str], rows: int, first_row: int) -> Iterator[tuple[Any, int]]:
    """The file's first `rows` rows of `columns`, in record batches, with each batch's first global row."""
    done = 0
    for batch in parquet.iter_batches(batch_size=ID_BATCH_ROWS, columns=columns):
        take = min(batch.num_rows, rows - done)
        yield batch.slice(0, take), first_row + done
        done += take
        if done >= rows:
            return


def _parquet_checks(
    parquet: Any, checks: tuple[ColumnCheck, ...], id_column: str | None, rows: int, first_row: int, where: str
) -> None:
    columns = list(dict.fromkeys([c.column for c in checks] + ([id_column] if id_column else [])))
    for batch, first in _parquet_batches(parquet, columns, rows, first_row):
        ids = batch.column(columns.index(id_column)) if id_column else None
        for check in checks:
            check.values(batch.column(columns.index(check.column)), ids, first, where)


def _parquet_null_prompts(
    parquet: Any, data: DataConfig, rows: int, first_row: int, where: str, has_id: bool
) -> None:
    """Null prompts, from the row groups' statistics (files without statistics: the workers check)."""
    column, key = text_column(data)
    leaf = next(
        (i for i in range(parquet.metadata.num_columns) if parquet.schema.column(i).path == column), None
    )
    start = 0
    for group in range(parquet.metadata.num_row_groups):
        meta = parquet.metadata.row_group(group)
        if start >= rows or leaf is None:
            return
        stats = meta.column(leaf).statistics
        if stats is not None and stats.has_null_count and stats.null_count:
            table = parquet.read_row_group(group, columns=[column] + ([data.id_column] if has_id else []))
            used = table.slice(0, rows - start)
            ids = used.column(data.id_column).combine_chunks() if has_id else None
            _null_prompt(used.column(column).combine_chunks(), ids, first_row + start, key, where)
        start += meta.num_rows


# --- Arrow (datasets.save_to_disk) ---------------------------------------------------------------------


def scan_arrow(
    data: DataConfig, listing: SourceListing, shard_size: int, checks: tuple[ColumnCheck, ...] = ()
) -> ScanResult:
    checker = IdChecker(data.id_column, listing.path)
    column, key = text_column(data)
    files: list[InputFile] = []
    total, has_id, kept = 0, None, None
    for f in listing.files:
        remaining = _remaining(data, total)
        if remaining == 0:
            break
        table = _arrow_table(f.uri)
        has_id = _same_id_presence(
            has_id, check_columns(table.schema.names, table.schema, data, f.uri), f.uri, data
        )
        kept = kept or _kept(data, table.schema.names)
        if kept is not None:
            kept.add_schema(table.schema, f.uri)
        rows = table.num_rows if remaining is None else min(remaining, table.num_rows)
        for start in range(0, rows, ID_BATCH_ROWS):
            batch = table.slice(start, min(ID_BATCH_ROWS, rows - start))
            ids = batch.column(data.id_column).combine_chunks() if has_id else None
            if not data.chat:
                _null_prompt(batch.column(column).combine_chunks(), ids, total + start, key, f.uri)
            for check in checks:
                check.values(batch.column(check.column), ids, total + start, f.uri)
            if ids is not None:
                checker.add(ids, total + start)
        files.append(dataclasses.replace(f, num_rows=rows, first_row=total))
        total += rows

    def reread() -> Iterator[tuple[pa.Array, int]]:
        for f in files:
            ids = _arrow_table(f.uri).column(data.id_column).slice(0, f.num_rows).combine_chunks()
            yield ids, f.first_row

    if has_id:
        checker.finish(reread)
    return ScanResult(files, total, bool(has_id), checker.kind or "int", kept_types=kept and kept.result())


def _arrow_table(uri: str) -> pa.Table:
    try:
        return read_arrow_table(fs.resolve(uri, "data.path"))
    except Exception as err:  # noqa: BLE001
        raise JobInputError(
            f"data.path: cannot read {uri} as a `datasets` Arrow file: {str(err).splitlines()[0]}"
        ) from None


# --- JSON lines and CSV --------------------------------------------------------------------------------


class _Found(Exception):
    pass


def _first_record(uri: str, quoted: bool, max_record_bytes: int | None = None) -> Block | None:
    """The file's first record: in JSON lines, the first that reads as a JSON object (unreadable ones
    are error rows, not the file's columns)."""
    found: list[Block] = []

    def take(block: Block) -> None:
        if quoted:  # the header
            found.append(block)
            raise _Found
        row = block.first_row
        for offset, raw in enumerate(block.data.split(b"\n")):
            if raw.strip() and parse_jsonl_record(raw)[1] is None:
                found.append(Block(raw + b"\n", row, block.first_line + offset, 1))
                raise _Found
            row += bool(raw.strip())

    location = fs.resolve(uri, "data.path")
    with open_text_stream(location) as stream:
        try:
            scan_records(stream, every=1, limit=1 if quoted else None, quoted=quoted, on_block=take,
                         block_bytes=1 << 16, max_record_bytes=max_record_bytes)  # fmt: skip
        except _Found:
            pass
        except ScanError as err:
            raise scan_error(uri, err) from None
    return found[0] if found else None


def _scan_text_files(
    data: DataConfig,
    listing: SourceListing,
    shard_size: int,
    quoted: bool,
    check: Callable[[Block, str], None],
) -> tuple[list[InputFile], int]:
    """One streaming pass per file: record offsets, each block to `check(block, uri)`."""
    files: list[InputFile] = []
    total = 0
    for f in listing.files:
        remaining = _remaining(data, total)
        if remaining == 0:
            break
        location = fs.resolve(f.uri, "data.path")
        with open_text_stream(location) as stream:
            try:
                scan = scan_records(
                    stream, every=shard_size, first_row=total, limit=remaining, quoted=quoted, header=quoted,
                    on_block=lambda block, uri=f.uri: check(block, uri), max_record_bytes=data.max_record_bytes,
                )  # fmt: skip
            except ScanError as err:
                raise scan_error(f.uri, err) from None
        long_records = tuple(dataclasses.replace(r, row=r.row - total) for r in scan.long_records)
        files.append(
            dataclasses.replace(
                f, num_rows=scan.rows, first_row=total, data_start=scan.data_start, data_end=scan.data_end,
                offsets=scan.offsets, lines=scan.lines, first_line=scan.first_line, long_records=long_records,
            )
        )  # fmt: skip
        total += scan.rows
    return files, total


def _reread_text(
    files: list[InputFile], quoted: bool, ids_of: Callable[[Block, str], pa.Array], max_record_bytes: int
):
    """The id batches of every file again (only after a duplicate hash: the error path)."""
    for f in files:
        blocks: list[Block] = []
        location = fs.resolve(f.uri, "data.path")
        with open_text_stream(location) as stream:
            scan_records(stream, every=1 << 40, first_row=f.first_row, limit=f.num_rows, quoted=quoted,
                         header=quoted, on_block=blocks.append, max_record_bytes=max_record_bytes)  # fmt: skip
        for block in blocks:
            yield ids_of(block, f.uri), block.first_row


class JsonlChecker:
    """Each JSONL block: ids and prompts through pyarrow's JSON reader, or line by line when it objects; with
    kept columns, the reader also infers the other fields, and the kept ones' types go to `kept`."""

    def __init__(
        self, data: DataConfig, checker: IdChecker, has_id: bool, id_kind: str | None,
        checks: tuple[ColumnCheck, ...] = (), kept: KeptTypes | None = None,
    ):  # fmt: skip
        self.data, self.checker, self.has_id, self.checks, self.kept = data, checker, has_id, checks, kept
        self.column, self.key = text_column(data)
        fields = [(data.id_column, pa.int64() if id_kind == "int" else pa.string())] if has_id else []
        if not data.chat:
            fields.append((self.column, pa.string()))
        fields += [(c.column, c.json_type) for c in checks if c.json_type is not None]
        self.schema = pa.schema(fields)
        # the reader infers the fields the schema does not name: the kept columns, a check's untyped column
        self.infer = kept is not None or any(c.json_type is None for c in checks)

    def parse(self, block: Block) -> pa.Table | None:
        """The block through pyarrow, or None (then `python_ids`): pyarrow's reader does not check UTF-8."""
        import pyarrow.json as pj

        try:
            block.data.decode("utf-8")
        except UnicodeDecodeError:
            return None
        try:
            table = pj.read_json(
                pa.BufferReader(block.data),
                read_options=pj.ReadOptions(block_size=4 << 20),
                parse_options=pj.ParseOptions(
                    explicit_schema=self.schema, unexpected_field_behavior="infer" if self.infer else "ignore"
                ),
            )
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None
        return table if table.num_rows == block.rows else None

    def __call__(self, block: Block, where: str) -> None:
        table = self.parse(block)
        if table is None:
            ids = self.python_ids(block, where)
        else:
            ids = table.column(self.data.id_column).combine_chunks() if self.has_id else None
            if self.kept is not None:
                self.kept.add_table(table)
            if not self.data.chat:
                _null_prompt(
                    table.column(self.column).combine_chunks(), ids, block.first_row, self.key, where
                )
            for check in self.checks:
                if check.column in table.column_names:  # an inferred column no record of the block has: none
                    check.values(table.column(check.column), ids, block.first_row, where)
        if self.has_id:
            self.checker.add(ids, block.first_row)

    def ids(self, block: Block, where: str) -> pa.Array:
        table = self.parse(block)
        return (
            table.column(self.data.id_column).combine_chunks()
            if table is not None
            else self.python_ids(block, where)
        )

    def python_ids(self, block: Block, where: str) -> pa.Array:
        """The block line by line, with the exact line and row of the first problem. A record that cannot be
        read is left out (the worker writes its error row); its id, when it has a clean one, is counted."""
        ids: list[Any] = []
        kept: dict[str, list[Any]] = {name: [] for name in (self.kept.types if self.kept else ())}
        row = block.first_row
        for raw in block.data.split(b"\n"):
            if not raw.strip():
                continue
            record, unreadable = parse_jsonl_record(raw)
            if unreadable:
                row_id = usable_id(record, self.data.id_column if self.has_id else None)
                if row_id is not None:
                    self._check_id(row_id, row, where)
                    ids.append(row_id)
                row += 1
                continue
            for name, values in kept.items():
                values.append(record.get(name))
            row_id = record.get(self.data.id_column) if self.has_id else row
            if self.has_id:
                self._check_id(row_id, row, where)
                ids.append(row_id)
            problem = None if self.data.chat else prompt_problem(record.get(self.column))
            if problem:
                raise JobInputError(f"{row_where(self.key, row, row_id, where)}: {problem}")
            for check in self.checks:
                check.value(record.get(check.column), row, row_id, where)
            row += 1
        for name, values in kept.items():
            self.kept.add_json_values(name, values)
        return pa.array(ids, type=self.schema.field(0).type) if self.has_id else pa.array([], pa.int64())

    def _check_id(self, value: Any, row: int, where: str) -> None:
        kind = check_id_value(value, row, where, self.data.id_column)
        if kind != ("int" if self.schema.field(0).type == pa.int64() else "str"):
            self.checker.mixed()


def check_id_value(value: Any, row: int, where: str, column: str) -> str:
    """'int' or 'str' for a valid id; raises JobInputError for a null or non-int, non-string one."""
    problem = id_value_problem(value)
    if problem == "null":
        raise JobInputError(f"data.id_column: row {row} of {where} has a null id in column '{column}'")
    if problem:
        raise JobInputError(
            f"data.id_column: row {row} of {where}: id {problem}, expected an int or a string"
        )
    return "str" if isinstance(value, str) else "int"


def scan_jsonl(
    data: DataConfig, listing: SourceListing, shard_size: int, checks: tuple[ColumnCheck, ...] = ()
) -> ScanResult:
    first = _first_record(listing.files[0].uri, quoted=False, max_record_bytes=data.max_record_bytes)
    if first is None:
        raise JobInputError(f"data.path: {listing.path} holds no rows (none that reads as a JSON object)")
    record = jsonl_record(first.data.rstrip(b"\r\n"), listing.files[0].uri, line=first.first_line)
    has_id = check_columns(list(record), None, data, listing.files[0].uri)
    id_kind = None
    if has_id:
        id_kind = check_id_value(
            record[data.id_column], first.first_row, listing.files[0].uri, data.id_column
        )
    checker = IdChecker(data.id_column, listing.path)
    kept = _kept(data, list(record))
    check = JsonlChecker(data, checker, has_id, id_kind, checks, kept)
    files, total = _scan_text_files(data, listing, shard_size, quoted=False, check=check)
    if has_id:
        checker.finish(lambda: _reread_text(files, False, check.ids, data.max_record_bytes))
    return ScanResult(files, total, has_id, id_kind or "int", kept_types=kept and kept.result())


class CsvChecker:
    """Each CSV block through pyarrow's CSV reader with the header's names; the first block decides
    whether the ids are ints or strings, as pyarrow's own type inference would."""

    def __init__(
        self, data: DataConfig, checker: IdChecker, header: tuple[str, ...], has_id: bool,
        checks: tuple[ColumnCheck, ...] = (), kept: KeptTypes | None = None,
    ):  # fmt: skip
        self.data, self.checker, self.header, self.has_id, self.checks = data, checker, header, has_id, checks
        self.kept = kept
        self.column, self.key = text_column(data)
        self.id_type: pa.DataType | None = None

    def table(self, block: Block, where: str) -> pa.Table:
        id_column = self.data.id_column if self.has_id else None
        inferred = tuple(self.kept.types) if self.kept else ()
        text = tuple(c.column for c in self.checks if c.column not in inferred)  # each check parses its text
        read, parse, convert = csv_options(self.header, self.column, id_column, self.id_type, None,
                                           inferred + text, dict.fromkeys(inferred))
        try:
            table, unreadable = read_csv_records(block.data, read, parse, convert)  # error rows: the worker's
        except (pa.ArrowInvalid, ValueError) as err:
            if self.id_type is not None and "conversion error" in str(err).lower():
                self.checker.mixed()
            raise JobInputError(
                f"data.path: cannot read {where} as CSV near line {block.first_line}: {err}"
            ) from None
        if table.num_rows + len(unreadable) != block.rows:
            raise JobInputError(
                f"data.path: cannot read {where} as CSV near line {block.first_line}: pyarrow read {table.num_rows} "
                f"rows where {block.rows} records were found"
            )
        return table

    def __call__(self, block: Block, where: str) -> None:
        table = self.table(block, where)
        if self.kept is not None:
            self.kept.add_table(table)
        ids = table.column(self.data.id_column).combine_chunks() if self.has_id else None
        if ids is not None and self.id_type is None:
            self.id_type = ids.type if id_kind_of_type(ids.type) else None
        if not self.data.chat:
            _null_prompt(table.column(self.column).combine_chunks(), ids, block.first_row, self.key, where)
        for check in self.checks:
            check.values(table.column(check.column), ids, block.first_row, where, text=True)
        if ids is not None:
            self.checker.add(ids, block.first_row)

    def ids(self, block: Block, where: str) -> pa.Array:
        return self.table(block, where).column(self.data.id_column).combine_chunks()


def _csv_header(uri: str, max_record_bytes: int | None = None) -> tuple[str, ...]:
    import pyarrow.csv as pacsv

    first = _first_record(uri, quoted=True, max_record_bytes=max_record_bytes)
    if first is None:
        raise JobInputError(f"data.path: {uri} holds no rows")
    try:
        names = pacsv.read_csv(
            pa.BufferReader(first.data), read_options=pacsv.ReadOptions(block_size=4 << 20)
        ).column_names
    except pa.ArrowInvalid as err:
        raise JobInputError(f"data.path: cannot read {uri} as CSV: {err}") from None
    return tuple(names)


def scan_csv(
    data: DataConfig, listing: SourceListing, shard_size: int, checks: tuple[ColumnCheck, ...] = ()
) -> ScanResult:
    header = _csv_header(listing.files[0].uri, data.max_record_bytes)
    for f in listing.files[1:]:
        if _csv_header(f.uri, data.max_record_bytes) != header:
            raise JobInputError(f"data.path: {f.uri} has other CSV columns than {listing.files[0].uri}")
    has_id = check_columns(list(header), None, data, listing.files[0].uri)
    checker = IdChecker(data.id_column, listing.path)
    kept = _kept(data, list(header))
    check = CsvChecker(data, checker, header, has_id, checks, kept)
    files, total = _scan_text_files(data, listing, shard_size, quoted=True, check=check)
    if has_id:
        checker.finish(lambda: _reread_text(files, True, check.ids, data.max_record_bytes))
    return ScanResult(files, total, has_id, checker.kind or "int", csv_header=header,
                      kept_types=kept and kept.result())
