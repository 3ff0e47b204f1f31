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
    at = f"line {line}" if line is not None else f"the line at byte {offset}"
    try:
        record = json.loads(raw)
    except ValueError as err:
        raise JobInputError(f"data.path: {where} {at} is not valid JSON: {err}") from None
    if not isinstance(record, dict):
        raise JobInputError(f"data.path: {where} {at} is a JSON {type(record).__name__}, expected an object")
    return record


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
