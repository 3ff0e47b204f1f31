"""The input formats, in one table: their names, file extensions and codecs, and how a worker reads a row
range of each; plus the parsing helpers that the plan (`pipeline.scanners`) and the workers
(`pipeline.prompts`) share, so that neither imports the other.

    FORMATS["jsonl"].extensions          # (".jsonl", ".ndjson", ".json")
    kind_of("a/b.jsonl.zst")             # ("jsonl", "zstd"): the format and the codec its name says
    format_of(name, data.format)         # the format (JobInputError when the name does not say one)

Compressed text inputs (`.jsonl.gz`, `.jsonl.zst`, `.csv.gz`, any codec in `CODECS`, which pyarrow
decompresses) are planned like the plain ones: the driver's scan streams the decompressed bytes and keeps
record offsets in them; a worker cannot seek in a compressed file, so it decompresses in a stream up to its
shard (`pipeline.prompts.ReadCache.text_range`, which keeps its place for the next shard of the same file).
Parquet and Arrow files compress inside; a codec suffix on them is refused.

Each format's scan and read are one `pipeline.readers.FormatReader` (`READERS`, keyed like `FORMATS`).
Not here: the scans (`pipeline.scanners`), reading rows (`pipeline.readers`, `pipeline.prompts`), listing
(`pipeline.source`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from pipeline import fs
from pipeline.errors import JobInputError


@dataclass(frozen=True)
class InputFormat:
    name: str
    extensions: tuple[str, ...]
    reads: str  # how a worker reads a row range: "bytes" (a byte range), "row_groups", "table"
    compressible: bool  # a codec suffix is allowed (text formats)
    by_extension: bool = True  # told from a file's extension (hf_disk: from its directory's state.json)


FORMATS: dict[str, InputFormat] = {
    f.name: f
    for f in (
        InputFormat("parquet", (".parquet", ".pq"), "row_groups", compressible=False),
        InputFormat("jsonl", (".jsonl", ".ndjson", ".json"), "bytes", compressible=True),
        InputFormat("csv", (".csv",), "bytes", compressible=True),
        InputFormat("hf_disk", (".arrow",), "table", compressible=False, by_extension=False),
    )
}
CODECS = {".gz": "gzip", ".gzip": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2", ".lz4": "lz4"}
_BY_EXTENSION = {ext: f.name for f in FORMATS.values() for ext in f.extensions}


def _suffix(name: str) -> str:
    base = name.rsplit("/", 1)[-1]
    return "." + base.rsplit(".", 1)[-1].lower() if "." in base else ""


def codec_of(name: str) -> str | None:
    """The codec a file name says (`x.jsonl.gz` -> "gzip"), None for an uncompressed name."""
    return CODECS.get(_suffix(name))


def kind_of(name: str) -> tuple[str | None, str | None]:
    """(format, codec) that a file name says; (None, codec) when the name says no format we know."""
    codec = codec_of(name)
    inner = name[: -len(_suffix(name))] if codec else name
    found = _BY_EXTENSION.get(_suffix(inner))
    if found is None or (codec and not FORMATS[found].compressible):
        return None, codec
    return found, codec


def format_of(name: str, data_format: str) -> str:
    """The configured format, or the one `name`'s extension says (JobInputError when it says none)."""
    if data_format != "auto":
        return data_format
    found, codec = kind_of(name)
    if found is not None and FORMATS[found].by_extension:
        return found
    known = sorted(ext for f in FORMATS.values() if f.by_extension for ext in f.extensions)
    codecs = sorted(CODECS)
    raise JobInputError(
        f"data.format: cannot tell the format of {name} from its extension '{_suffix(name)}'; known extensions: "
        f"{', '.join(known)}, text ones (.jsonl, .csv) also compressed ({', '.join(codecs)}); or set "
        "data.format to parquet, jsonl, csv or hf_disk"
    )


def open_text_stream(location: fs.Location) -> Any:
    """A stream of a text file's bytes, decompressed when its name says a codec."""
    return location.filesystem.open_input_stream(location.path, compression=codec_of(location.name))


def jsonl_record(
    raw: bytes, where: str, line: int | None = None, offset: int | None = None
) -> dict[str, Any]:
    """One JSON-lines record as a dict; raises JobInputError naming the line (or byte offset)."""
    record, problem = parse_jsonl_record(raw)
    if problem:
        raise JobInputError(record_problem(where, line if line is not None else f"at byte {offset}", problem))
    return record


def record_problem(where: str, line: int | str, problem: str) -> str:
    """The words of every unreadable-record message: 'data.path: p.jsonl line 17 is not valid UTF-8 (...)'."""
    return f"data.path: {where} line {line} {problem}"


def parse_jsonl_record(raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """(record, None) for a usable JSON-lines record, else (what could be read of it, or None; what is wrong):
    not UTF-8 (the record is then read with the bad bytes as lone surrogates, so that a clean id still
    names it: `usable_id`), not JSON, not an object, or text holding a lone surrogate escape ("\\ud800"),
    which no UTF-8 file can store."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        problem = f"is not valid UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1})"
        try:
            record = json.loads(raw.decode("utf-8", "surrogateescape"))
        except ValueError:
            record = None
        return (record if isinstance(record, dict) else None), problem
    try:
        record = json.loads(text)
    except ValueError as err:
        return None, f"is not valid JSON: {err}"
    if not isinstance(record, dict):
        return None, f"is a JSON {type(record).__name__}, expected an object"
    if "\\u" in text and not _is_unicode(record):
        return record, "holds a lone surrogate escape (\\ud800-\\udfff): not valid Unicode text"
    return record, None


def _is_unicode(value: Any) -> bool:
    """No string in `value` (keys included) holds a lone surrogate."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(_is_unicode(k) and _is_unicode(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_is_unicode(v) for v in value)
    return True


def usable_id(record: dict[str, Any] | None, column: str | None) -> Any:
    """The id of a record that could be read at least in part: an int, or a clean string; else None."""
    if record is None or column is None:
        return None
    value = record.get(column)
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not _is_unicode(value):
        return None
    return value


def read_csv_records(data: bytes, read: Any, parse: Any, convert: Any) -> tuple[pa.Table, dict[int, str]]:
    """pyarrow's read of whole CSV records (`csv_options`): (the table of the readable records, {index of an
    unreadable record among `split_records(data, quoted=True)`: what is wrong}). Unreadable: a record with
    another number of fields than the header, or one that is not UTF-8."""
    import pyarrow.csv as pacsv

    from pipeline.linescan import split_records

    invalid: list[Any] = []

    def skip(row: Any) -> str:
        invalid.append(row)
        return "skip"

    parse = pacsv.ParseOptions(
        delimiter=parse.delimiter, quote_char=parse.quote_char, double_quote=parse.double_quote,
        escape_char=parse.escape_char, newlines_in_values=parse.newlines_in_values,
        ignore_empty_lines=parse.ignore_empty_lines, invalid_row_handler=skip,
    )  # fmt: skip
    try:
        table = pacsv.read_csv(pa.BufferReader(data), read_options=read, parse_options=parse, convert_options=convert)
    except pa.ArrowInvalid as err:
        if "utf8" not in str(err).lower():
            raise
        return _without_bad_utf8(data, read, parse, convert)
    if not invalid:
        return table, {}
    records = split_records(data, quoted=True)
    wanted: dict[str, list[Any]] = {}
    for row in invalid:
        wanted.setdefault(row.text, []).append(row)
    problems = {}
    for index, record in enumerate(records):
        text = record.decode("utf-8", "replace")
        found = wanted.get(text) or wanted.get(text.rstrip("\r"))
        if found:
            row = found.pop()
            problems[index] = f"has {row.actual_columns} fields, expected {row.expected_columns}"
    if len(problems) != len(invalid):
        raise ValueError(f"pyarrow skipped {len(invalid)} CSV records, {len(problems)} of which were found again")
    return table, problems


def _without_bad_utf8(data: bytes, read: Any, parse: Any, convert: Any) -> tuple[pa.Table, dict[int, str]]:
    """`read_csv_records` of a block that holds records which are not UTF-8: those are set aside first."""
    from pipeline.linescan import split_records

    records = split_records(data, quoted=True)
    problems: dict[int, str] = {}
    good: list[int] = []
    for index, record in enumerate(records):
        try:
            record.decode("utf-8")
            good.append(index)
        except UnicodeDecodeError as err:
            problems[index] = f"is not valid UTF-8 (byte 0x{record[err.start]:02x} at column {err.start + 1})"
    table, others = read_csv_records(b"".join(records[i] + b"\n" for i in good), read, parse, convert)
    problems.update({good[i]: problem for i, problem in others.items()})
    return table, problems


def csv_options(
    source_header: tuple[str, ...],
    text: str,
    id_column: str | None,
    id_type: pa.DataType | None,
    budget_column: str | None = None,
    extra_columns: tuple[str, ...] = (),
    extra_types: dict[str, pa.DataType | None] | None = None,
):
    """pyarrow.csv options that read header-less records with the file's column names (the budget column
    as text: `pipeline.rowcheck` parses it, and names the row of a value that is not an integer; the
    extra columns of `pipeline.row_columns` as `extra_types` says: a type, None for pyarrow's inference,
    text when absent)."""
    import pyarrow.csv as pacsv

    types = {text: pa.string()}
    if id_column and id_type is not None:
        types[id_column] = id_type
    if budget_column:
        types[budget_column] = pa.string()
    extra = [c for c in extra_columns if c not in types]
    for column in extra:
        chosen = (extra_types or {}).get(column, pa.string())
        if chosen is not None:
            types[column] = chosen
    return (
        pacsv.ReadOptions(column_names=list(source_header), block_size=4 << 20),
        pacsv.ParseOptions(newlines_in_values=True),
        pacsv.ConvertOptions(
            column_types=types,
            include_columns=[text] + ([id_column] if id_column else []) + ([budget_column] if budget_column else [])
            + extra,
            strings_can_be_null=True,
        ),
    )


def read_arrow_table(location: fs.Location) -> pa.Table:
    """A `datasets` Arrow file (IPC stream, or IPC file) as a table: memory-mapped when local."""
    import pyarrow.ipc as ipc

    if location.is_local:
        source: Any = pa.memory_map(location.path)
    else:
        source = pa.BufferReader(fs.read_bytes(location))
    try:
        return ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        source.seek(0)
        return ipc.open_file(source).read_all()
