"""Reading prompt rows: a row range as a worker reads it for one shard, and a whole small input.

    rows = read_rows(source, start, stop, cache)   # ids, texts or chat messages, and per-row problems
    table = read_prompts(data)                       # every row of a small input, validated (benchmark job)

`read_rows` reads only what the range needs, through `pipeline.fs`: a JSON-lines or CSV byte range (the
driver's scan found where the range starts; a compressed file is decompressed in a stream up to it, see
`pipeline.formats`), or the Parquet row groups / Arrow file that hold it, kept in a
small per-worker cache (`ReadCache`) because neighbouring shards share row groups. A row whose prompt or
chat messages cannot be used gets a problem ("row 3 (id 'b') of p.parquet: prompt is null, expected a
string"), as does a record that cannot be read ("p.jsonl line 17 is not valid UTF-8 (...)"; its id is its
row number when it has no clean one): the worker writes it as an error row, `read_prompts` raises it as a
`JobInputError`.

Each format's read of a piece is its reader's (`pipeline.readers.READERS`, the table the plan uses too).
It does not tokenize (`pipeline.models`), plan (`pipeline.source`, `pipeline.scanners`) or write anything.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline import busy, fs
from pipeline.config import DataConfig
from pipeline.errors import JobInputError
from pipeline.formats import (
    codec_of,
    csv_options,
    format_of,
    jsonl_record,
    open_text_stream,
    read_arrow_table,
)
from pipeline.readers import reader_of, scan_source
from pipeline.rowcheck import BUDGET_KEY, budget_problem, messages_problem, prompt_problem, row_where
from pipeline.source import Source, list_source

__all__ = [
    "PromptRows", "PromptTable", "ReadCache", "csv_options", "detect_format", "jsonl_record",
    "read_arrow_table", "read_prompts", "read_rows",
]

CACHE_BYTES = 256 << 20
MAX_STREAMS = 4  # open decompressing streams a worker keeps (one per compressed file it reads)
SKIP_BYTES = 1 << 22  # a compressed stream is skipped ahead in reads of this many bytes, each one progress


class InputChangedError(RuntimeError):
    """A worker found rows other than the plan said (the input changed while the job ran)."""


@dataclass
class PromptRows:
    """Rows of one range, in input order; `problems[i]` says why row i cannot be generated (else None)."""

    ids: list[Any]
    texts: list[str | None] | None  # outside chat mode
    messages: list[list[dict[str, str]] | None] | None  # in chat mode
    problems: list[str | None]
    budgets: list[int | None] | None = None  # with data.max_new_tokens_column: each row's max_new_tokens
    extras: dict[str, list[Any]] | None = None  # the source's extra columns (pipeline.row_columns), as read

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class PromptTable:
    """The rows of a whole input, in file order. Exactly one of `prompts` / `messages` is set."""

    ids: list[Any]  # int or str, unique
    id_kind: str  # "int" or "str": the Parquet type of the output `id` column
    prompts: list[str] | None
    messages: list[list[dict[str, str]]] | None
    source: str
    format: str

    def __len__(self) -> int:
        return len(self.ids)


def detect_format(path: str, data_format: str) -> str:
    """The concrete format of a file: the configured one, or the one its extension says."""
    return format_of(path, data_format)


def read_prompts(data: DataConfig) -> PromptTable:
    """Every row of `data.path` (up to `data.limit`), validated; for inputs that fit in memory."""
    source = scan_source(data, list_source(data), shard_size=1 << 40)
    rows = read_rows(source, 0, source.num_rows)
    for problem in rows.problems:
        if problem:
            raise JobInputError(problem)
    return PromptTable(rows.ids, source.id_kind, rows.texts, rows.messages, source.path, source.format)


def read_rows(source: Source, start: int, stop: int, cache: ReadCache | None = None) -> PromptRows:
    """Rows [start, stop) of the source (global row numbers), with each row's problem if it has one."""
    cache = cache or ReadCache()
    reader = reader_of(source.format)
    ids: list[Any] = []
    values: list[Any] = []
    budgets: list[Any] = []
    extras: dict[str, list[Any]] = {c: [] for c in source.columns.read}
    wheres: list[str] = []
    unreadable: list[str | None] = []
    for piece in source.pieces(start, stop):
        piece_ids, piece_values, piece_budgets, piece_extras, piece_problems = reader.read(source, piece, cache)
        if len(piece_values) != piece.stop - piece.start:
            raise InputChangedError(
                f"data.path: {source.files[piece.file].uri}: expected {piece.stop - piece.start} rows from row "
                f"{piece.start}, found {len(piece_values)}; the input changed since the job was planned"
            )
        first = source.files[piece.file].first_row + piece.start
        positions = range(first, first + len(piece_values))
        if piece_ids is None:
            ids.extend(positions)
        else:  # an unreadable record without a clean id: its row number (as text for string ids)
            kind = int if source.id_kind == "int" else str
            ids.extend(kind(row) if row_id is None else row_id for row_id, row in zip(piece_ids, positions))
        unreadable.extend(piece_problems or [None] * len(piece_values))
        values.extend(piece_values)
        budgets.extend(piece_budgets or [])
        for column, values_read in piece_extras.items():
            extras[column].extend(values_read)
        wheres.extend([source.files[piece.file].uri] * len(piece_values))
    rows = _checked(source, start, ids, values, wheres)
    rows.problems = [found or problem for found, problem in zip(unreadable, rows.problems)]
    if source.budget_column is not None:
        rows.budgets = _checked_budgets(source, start, rows, budgets, wheres)
    rows.extras = extras if extras else None
    return rows


def _checked(source: Source, start: int, ids: list[Any], values: list[Any], wheres: list[str]) -> PromptRows:
    problems: list[str | None] = []
    key = "data.messages_column" if source.chat else "data.prompt_column"
    checked: list[Any] = []
    for offset, (row_id, value, where) in enumerate(zip(ids, values, wheres)):
        if source.chat:
            value, problem = messages_problem(value, source.text_column)
        else:
            problem = prompt_problem(value)
            value = None if problem else value
        checked.append(value)
        problems.append(f"{row_where(key, start + offset, row_id, where)}: {problem}" if problem else None)
    if source.chat:
        return PromptRows(ids, None, checked, problems)
    return PromptRows(ids, checked, None, problems)


def _checked_budgets(
    source: Source, start: int, rows: PromptRows, values: list[Any], wheres: list[str]
) -> list[int | None]:
    """Each row's max_new_tokens (the driver's scan checked them; a row that no longer passes gets a problem)."""
    budgets: list[int | None] = []
    for offset, (value, where) in enumerate(zip(values, wheres)):
        budget, problem = budget_problem(value, None, text=source.format == "csv")
        budgets.append(budget)
        if problem and not rows.problems[offset]:
            at = row_where(BUDGET_KEY, start + offset, rows.ids[offset], where)
            rows.problems[offset] = f"{at}: column '{source.budget_column}': {problem}"
    return budgets


class ReadCache:
    """What a worker keeps between shards: open Parquet footers, and recently read row groups and Arrow
    files, least recently used first out once they pass `max_bytes` (memory-mapped files count nothing)."""

    def __init__(self, max_bytes: int = CACHE_BYTES):
        self.max_bytes = max_bytes
        self._items: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._streams: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # compressed file -> (stream, place)

    def _get(self, key: Any, load, size_of) -> Any:
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key][0]
        value = load()
        size = size_of(value)
        self._items[key] = (value, size)
        self._bytes += size
        while self._bytes > self.max_bytes and len(self._items) > 1:
            _, (_, dropped) = self._items.popitem(last=False)
            self._bytes -= dropped
        return value

    def parquet(self, uri: str) -> tuple[Any, np.ndarray]:
        def load():
            import pyarrow.parquet as pq

            location = fs.resolve(uri, "data.path")
            parquet = pq.ParquetFile(location.filesystem.open_input_file(location.path))
            counts = [parquet.metadata.row_group(i).num_rows for i in range(parquet.metadata.num_row_groups)]
            return parquet, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

        return self._get(("parquet", uri), load, lambda value: 0)

    def row_group(self, uri: str, parquet: Any, group: int, columns: list[str]) -> pa.Table:
        return self._get(
            ("group", uri, group, tuple(columns)),
            lambda: parquet.read_row_group(group, columns=columns),
            lambda table: table.nbytes,
        )

    def text_range(self, uri: str, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of a JSON-lines or CSV file: one ranged read, or, for a compressed file (offsets
        in its decompressed bytes), read on from where this worker's stream of it stopped (from the start
        again only for an earlier range), so that the shards of one file in order cost one decompression."""
        location = fs.resolve(uri, "data.path")
        if codec_of(location.name) is None:
            return fs.read_range(location, start, stop)
        stream, place = self._streams.pop(uri, (None, 0))
        if stream is None or place > start:
            if stream is not None:
                stream.close()
            stream, place = open_text_stream(location), 0
        while place < start:
            skipped = len(stream.read(min(start - place, SKIP_BYTES)))
            if not skipped:
                break
            place += skipped
            busy.advance()  # a long skip is work, not a hang (the stall watchdog: pipeline.busy)
        data = stream.read(stop - start)
        self._streams[uri] = (stream, place + len(data))
        while len(self._streams) > MAX_STREAMS:
            self._streams.popitem(last=False)[1][0].close()
        return data

    def arrow(self, uri: str) -> pa.Table:
        location = fs.resolve(uri, "data.path")

        def load() -> pa.Table:
            return read_arrow_table(location)

        return self._get(("arrow", uri), load, lambda table: 0 if location.is_local else table.nbytes)
