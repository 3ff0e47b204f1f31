"""The prompt dataset as the driver plans it: its files, their identity, row counts and shard offsets.

    listing = list_source(data)      # the files and their identity (path, size, mtime); reads no rows
    source.pieces(start, stop)       # the files, rows and bytes that hold rows [start, stop)

`data.path` is a file, a directory of files of one format, or a `datasets.save_to_disk` directory, on any
filesystem `pipeline.fs` opens. Row counts come from metadata where there is some: Parquet footers (and
their null counts), the record batches of Arrow files. JSON-lines and CSV files (plain, or compressed:
`pipeline.formats`) get one streaming pass
(`pipeline.linescan`) that keeps the byte offset of every `shard_size`-th record, so a worker seeks straight
to its shard. The same pass parses the id and prompt fields in C++ (pyarrow) to check them; the id column of
every format is streamed once through `pipeline.rowcheck.IdChecker` (8 bytes per row). Driver memory is
O(number of shards) plus those 8 bytes per row; no prompt text is kept.

Checks here, before anything is written: a missing file or bucket, an unknown format, an empty input, a
missing prompt or messages column, a prompt column that is not text, null/typed/mixed/duplicate ids, for
JSONL and CSV every readable row's prompt, a file with no line break over `data.max_record_bytes`, and with
`data.max_new_tokens_column` every row's budget (an
integer >= 1 within the models' positions, `pipeline.rowcheck.BudgetCheck`). Left to the workers (error rows): Parquet prompts that are
null when the file has no statistics, chat messages that are malformed, prompts the model cannot take, and
records that cannot be read (not UTF-8, not JSON, another number of CSV fields, over `data.max_record_bytes`:
the scan lists where those are, `InputFile.long_records`, so that no worker reads them whole).

This module holds the listing and the types; the per-format scans that fill in a `Source` are in
`pipeline.scanners`. Not here: reading a shard's rows (`pipeline.prompts`).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from pipeline import fs
from pipeline.config import DataConfig
from pipeline.errors import JobInputError
from pipeline.formats import format_of, kind_of
from pipeline.linescan import LongRecord, ScanError
from pipeline.row_columns import RowColumns
from pipeline.rowcheck import id_kind_of_type, is_text_type

_HF_MARKERS = ("state.json", "dataset_info.json")
ID_BATCH_ROWS = 1 << 16


@dataclass(frozen=True)
class InputFile:
    uri: str
    size: int
    mtime_ns: int | None
    num_rows: int = 0  # rows the job uses from it (after data.limit)
    first_row: int = 0  # global index of its first row
    data_start: int = 0  # JSONL/CSV: byte offset of its first record
    data_end: int = 0  # JSONL/CSV: just past its last record used
    offsets: np.ndarray | None = None  # JSONL/CSV: start of each record whose global index % shard_size == 0
    lines: np.ndarray | None = None  # JSONL/CSV: the line each of `offsets` starts on (1-based)
    first_line: int = 1  # JSONL/CSV: the line of its first record
    long_records: tuple[LongRecord, ...] = ()  # JSONL/CSV: records over data.max_record_bytes (local rows)

    def identity(self) -> dict[str, Any]:
        return {"path": self.uri, "size": self.size, "mtime_ns": self.mtime_ns}


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of files[file] (local row numbers); bytes [byte_start, byte_stop) for JSONL/CSV,
    the first of which is on line `first_line`."""

    file: int
    start: int
    stop: int
    byte_start: int = 0
    byte_stop: int = 0
    first_line: int = 1


@dataclass(frozen=True)
class SourceListing:
    path: str  # data.path as resolved (for messages)
    format: str
    files: tuple[InputFile, ...]
    extra: tuple[InputFile, ...] = ()  # files that are part of the identity but hold no rows (state.json)

    def identity(self) -> list[dict[str, Any]]:
        return [f.identity() for f in (*self.files, *self.extra)]


@dataclass(frozen=True)
class Source:
    """What a worker needs to read any row range: the files, the columns, the id rule."""

    path: str
    format: str
    files: tuple[InputFile, ...]
    num_rows: int
    shard_size: int
    text_column: str
    id_column: str | None  # None: the row number is the id
    id_kind: str  # 'int' or 'str': the Parquet type of the output `id` column
    chat: bool
    csv_header: tuple[str, ...] | None = None
    first_rows: tuple[int, ...] = field(default=())
    budget_column: str | None = None  # data.max_new_tokens_column (checked by the scan)
    max_budget: int | None = None  # the largest of its values (the workers size their cache pools with it)
    columns: RowColumns = field(default_factory=RowColumns)  # kept / stop / sampling-params columns (the scan's)

    def pieces(self, start: int, stop: int) -> list[Piece]:
        found = []
        i = max(0, bisect.bisect_right(self.first_rows, start) - 1)
        while i < len(self.files) and self.files[i].first_row < stop:
            f = self.files[i]
            local_start, local_stop = (
                max(start, f.first_row) - f.first_row,
                min(stop, f.first_row + f.num_rows) - f.first_row,
            )
            if local_stop > local_start:
                found.append(Piece(i, local_start, local_stop, *self._bytes(f, local_start, local_stop)))
            i += 1
        return found

    def _bytes(self, f: InputFile, start: int, stop: int) -> tuple[int, int, int]:
        if f.offsets is None:
            return 0, 0, 1
        first = (-f.first_row) % self.shard_size  # the local row of offsets[0]

        def offset(row: int) -> int:
            if row == 0:
                return f.data_start
            if row == f.num_rows:
                return f.data_end
            return int(f.offsets[(row - first) // self.shard_size])

        line = f.first_line if start == 0 or f.lines is None else int(f.lines[(start - first) // self.shard_size])
        return offset(start), offset(stop), line


def with_shard_size(source: Source, size: int) -> Source:
    """The same source cut into shards of `size` rows, a multiple of its scan's `shard_size`: the JSONL/CSV
    record offsets it keeps are those at the new shard starts (no second pass over the input)."""
    if size == source.shard_size:
        return source
    if size % source.shard_size:
        raise ValueError(f"shard size {size} is not a multiple of the scan's {source.shard_size}")
    files = []
    for f in source.files:
        if f.offsets is not None:
            first = (-f.first_row) % source.shard_size  # the local row of offsets[0]
            rows = f.first_row + first + source.shard_size * np.arange(len(f.offsets), dtype=np.int64)
            keep = rows % size == 0
            f = dataclasses.replace(f, offsets=f.offsets[keep], lines=None if f.lines is None else f.lines[keep])
        files.append(f)
    return dataclasses.replace(source, files=tuple(files), shard_size=size)


def text_column(data: DataConfig) -> tuple[str, str]:
    """(column, config key) of the prompt text, or of the chat messages in chat mode."""
    return (
        (data.messages_column, "data.messages_column")
        if data.chat
        else (data.prompt_column, "data.prompt_column")
    )


def list_source(data: DataConfig) -> SourceListing:
    """The input files and their identity; reads no rows. Raises JobInputError naming data.path."""
    location = fs.resolve(data.path, "data.path")
    fs.check_bucket(location, "data.path")
    found = fs.info(location, "data.path")
    if found.type == pafs.FileType.NotFound:
        raise JobInputError(f"data.path: no such file or directory: {location.uri}")
    if found.type == pafs.FileType.File:
        data_format = format_of(location.name, data.format)
        if data_format == "hf_disk":
            raise JobInputError(
                f"data.format: hf_disk needs a `datasets.save_to_disk` directory, {location.uri} is a file"
            )
        return SourceListing(location.uri, data_format, (_input_file(location.uri, found),))
    return _list_directory(location, data)


def _input_file(uri: str, info: pafs.FileInfo) -> InputFile:
    return InputFile(uri=uri, size=int(info.size or 0), mtime_ns=info.mtime_ns)


def _uri_of(location: fs.Location, info: pafs.FileInfo) -> str:
    relative = info.path[len(location.path) :].lstrip("/")
    return location.child(relative).uri


def _list_directory(location: fs.Location, data: DataConfig) -> SourceListing:
    names = {f.base_name: f for f in fs.list_files(location, "data.path")}
    if "dataset_dict.json" in names:
        splits = json.loads(fs.read_bytes(location.child("dataset_dict.json"))).get("splits", [])
        raise JobInputError(
            f"data.path: {location.uri} holds a DatasetDict with splits {', '.join(splits)}; "
            "point data.path at one split's directory"
        )
    if data.format == "hf_disk" or (data.format == "auto" and any(m in names for m in _HF_MARKERS)):
        return _list_hf_disk(location, names)
    files = [
        f
        for f in fs.list_files(location, "data.path", recursive=True)
        if not any(part.startswith((".", "_")) for part in f.path[len(location.path) :].split("/"))
    ]
    formats = {kind_of(f.base_name)[0] for f in files}
    formats.discard(None)
    formats.discard("hf_disk")
    wanted = data.format if data.format != "auto" else (formats.pop() if len(formats) == 1 else None)
    if wanted is None:
        what = (
            f"holds files of several formats ({', '.join(sorted(formats))})"
            if formats
            else (
                "is not a `datasets.save_to_disk` directory (no state.json) and holds no .parquet, .jsonl or .csv files"
            )
        )
        raise JobInputError(
            f"data.path: cannot tell the format of directory {location.uri}: it {what}; set data.format or point data.path at a file"
        )
    chosen = [
        f for f in files if kind_of(f.base_name)[0] == wanted
    ]
    if not chosen:
        raise JobInputError(f"data.path: directory {location.uri} holds no {wanted} files")
    return SourceListing(location.uri, wanted, tuple(_input_file(_uri_of(location, f), f) for f in chosen))


def _list_hf_disk(location: fs.Location, names: dict[str, pafs.FileInfo]) -> SourceListing:
    if "state.json" not in names:
        raise JobInputError(
            f"data.path: {location.uri} has no state.json; expected a `datasets.save_to_disk` directory"
        )
    state = json.loads(fs.read_bytes(location.child("state.json")))
    data_files = [entry["filename"] for entry in state.get("_data_files", [])]
    missing = [name for name in data_files if name not in names]
    if missing or not data_files:
        raise JobInputError(
            f"data.path: {location.uri} lists data files it does not hold: {', '.join(missing) or '(none)'}"
        )
    files = tuple(_input_file(location.child(n).uri, names[n]) for n in data_files)
    extra = tuple(_input_file(location.child(n).uri, names[n]) for n in _HF_MARKERS if n in names)
    return SourceListing(location.uri, "hf_disk", files, extra)


@dataclass
class ScanResult:
    files: list[InputFile]
    num_rows: int
    has_id: bool
    id_kind: str
    csv_header: tuple[str, ...] | None = None
    kept_types: tuple[tuple[str, pa.DataType], ...] | None = None  # data.keep_columns' types for the whole job


def check_columns(names: list[str], schema: pa.Schema | None, data: DataConfig, where: str) -> bool:
    """The text column is there (and is text, outside chat mode), and the budget column when one is set
    (integers, where the file has a schema); returns whether the id column is."""
    column, key = text_column(data)
    if column not in names:
        raise JobInputError(
            f"{key}: column '{column}' not found in {where}; columns are: {', '.join(sorted(names)) or '(none)'}"
        )
    if schema is not None and not data.chat and not is_text_type(schema.field(column).type):
        raise JobInputError(
            f"{key}: column '{column}' of {where} holds {schema.field(column).type}, expected strings"
        )
    _hint_unread_sampling_params(names, data, where)
    budget = data.max_new_tokens_column
    if budget is not None and budget not in names:
        raise JobInputError(
            f"data.max_new_tokens_column: column '{budget}' not found in {where}; columns are: "
            f"{', '.join(sorted(names)) or '(none)'}"
        )
    if budget is not None and schema is not None and not pa.types.is_integer(schema.field(budget).type):
        raise JobInputError(
            f"data.max_new_tokens_column: column '{budget}' of {where} holds {schema.field(budget).type}, "
            "expected integers"
        )
    if (
        schema is not None
        and data.id_column in names
        and id_kind_of_type(schema.field(data.id_column).type) is None
    ):
        raise JobInputError(
            f"data.id_column: column '{data.id_column}' of {where} holds {schema.field(data.id_column).type}, expected ints or strings"
        )
    return data.id_column in names


_HINTED = [False]  # the hint below, said once per process (not once per input file)


def _hint_unread_sampling_params(names: list[str], data: DataConfig, where: str) -> None:
    """A column named as vLLM's and the Ray Data stage's per-row settings, which the job reads only when told
    (`data.sampling_params_column`): say so once, rather than run every row with the job's settings silently."""
    if data.sampling_params_column is None and "sampling_params" in names and not _HINTED[0]:
        _HINTED[0] = True
        logging.getLogger("pipeline").warning(
            "%s has a column 'sampling_params' that this job does not read: every row uses the job's settings "
            "(data.sampling_params_column=sampling_params reads each row's own)", where)


def scan_error(where: str, err: Exception) -> JobInputError:
    kind = "cannot split into records" if isinstance(err, ScanError) else "cannot read"
    return JobInputError(
        f"data.path: {kind} {where}: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
    )
