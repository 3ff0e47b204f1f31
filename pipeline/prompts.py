"""Reading the prompt dataset: Parquet, JSONL, CSV, or a `datasets.save_to_disk` directory.

`read_prompts` returns a validated `PromptTable` (ids, prompt texts or chat messages), and raises
`JobInputError` naming the file, the column and the row for anything wrong: a missing file, an unknown
format, a missing column, a prompt that is not a string, a duplicate or null id, an empty dataset.

It does not tokenize (see `pipeline.models`) and does not write anything (see `pipeline.generate.output`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import DataConfig
from pipeline.errors import JobInputError

_EXTENSIONS = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".csv": "csv",
}


@dataclass(frozen=True)
class PromptTable:
    """The rows to generate for, in file order. Exactly one of `prompts` / `messages` is set."""

    ids: list[Any]  # int or str, unique
    id_kind: str  # "int" or "str": the Parquet type of the output `id` column
    prompts: list[str] | None
    messages: list[list[dict[str, str]]] | None
    source: str
    format: str

    def __len__(self) -> int:
        return len(self.ids)


def detect_format(path: Path, data_format: str) -> str:
    """The concrete format: the configured one, or one read from the extension when 'auto'."""
    if data_format != "auto":
        return data_format
    if path.is_dir():
        if (path / "state.json").exists() or (path / "dataset_info.json").exists():
            return "hf_disk"
        if (path / "dataset_dict.json").exists():
            return "hf_disk"
        raise JobInputError(
            f"data.path: cannot tell the format of directory {path}: it is not a `datasets.save_to_disk` "
            "directory (no state.json); set data.format or point data.path at a file"
        )
    suffix = path.suffix.lower()
    if suffix in _EXTENSIONS:
        return _EXTENSIONS[suffix]
    raise JobInputError(
        f"data.format: cannot tell the format of {path} from its extension '{suffix}'; "
        f"known extensions: {', '.join(sorted(_EXTENSIONS))}; or set data.format to parquet, jsonl, csv or hf_disk"
    )


def read_prompts(data: DataConfig) -> PromptTable:
    """Read, cut to `data.limit`, and validate the prompt rows."""
    path = Path(data.path).expanduser()
    if not path.exists():
        raise JobInputError(f"data.path: no such file or directory: {path}")
    data_format = detect_format(path, data.format)
    text_column = data.messages_column if data.chat else data.prompt_column
    text_key = "data.messages_column" if data.chat else "data.prompt_column"

    columns, num_rows = _read_columns(path, data_format, wanted=(text_column, data.id_column), data=data)
    if num_rows == 0:
        raise JobInputError(f"data.path: {path} holds no rows")
    if text_column not in columns:
        available = ", ".join(sorted(columns.get("__all__", []))) or "(none)"
        raise JobInputError(
            f"{text_key}: column '{text_column}' not found in {path}; columns are: {available}"
        )
    texts = columns[text_column]

    if data.id_column in columns:
        ids, id_kind = _validate_ids(columns[data.id_column], data.id_column, path)
    else:
        ids, id_kind = list(range(num_rows)), "int"

    if data.chat:
        messages = [_validate_messages(m, row, ids[row], text_column, path) for row, m in enumerate(texts)]
        return PromptTable(ids, id_kind, None, messages, str(path), data_format)
    for row, text in enumerate(texts):
        if not isinstance(text, str):
            raise JobInputError(
                f"{text_key}: row {row} (id {ids[row]!r}) of {path}: prompt is "
                f"{'null' if text is None else type(text).__name__ + ' ' + _short(text)}, expected a string"
            )
    return PromptTable(ids, id_kind, list(texts), None, str(path), data_format)


def _read_columns(
    path: Path, data_format: str, wanted: tuple[str, ...], data: DataConfig
) -> tuple[dict[str, list[Any]], int]:
    """Columns in `wanted` that exist (as Python lists, first `limit` rows), plus '__all__' = all names."""
    limit = data.limit
    if data_format == "jsonl":
        return _read_jsonl(path, wanted, limit)
    if data_format == "parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as err:  # pyarrow raises several types for a bad file
            raise JobInputError(f"data.path: cannot read {path} as Parquet: {err}") from None
        return _arrow_columns(table, wanted, limit)
    if data_format == "csv":
        import pyarrow as pa
        import pyarrow.csv as pacsv

        try:
            # prompts are text even when they look like numbers
            table = pacsv.read_csv(
                path,
                convert_options=pacsv.ConvertOptions(
                    column_types={data.prompt_column: pa.string()}, strings_can_be_null=True
                ),
            )
        except Exception as err:
            raise JobInputError(f"data.path: cannot read {path} as CSV: {err}") from None
        return _arrow_columns(table, wanted, limit)
    if data_format == "hf_disk":
        import datasets

        try:
            dataset = datasets.load_from_disk(str(path))
        except Exception as err:
            raise JobInputError(
                f"data.path: cannot load {path} with datasets.load_from_disk: {err}"
            ) from None
        if isinstance(dataset, datasets.DatasetDict):
            raise JobInputError(
                f"data.path: {path} holds a DatasetDict with splits {', '.join(dataset)}; "
                "point data.path at one split's directory"
            )
        if limit is not None:
            dataset = dataset.select(range(min(limit, len(dataset))))
        names = list(dataset.column_names)
        columns: dict[str, list[Any]] = {"__all__": names}
        for name in wanted:
            if name in names:
                columns[name] = list(dataset[name])
        return columns, len(dataset)
    raise JobInputError(f"data.format: unknown format {data_format!r}")


def _arrow_columns(
    table: Any, wanted: tuple[str, ...], limit: int | None
) -> tuple[dict[str, list[Any]], int]:
    if limit is not None:
        table = table.slice(0, limit)
    columns: dict[str, list[Any]] = {"__all__": list(table.column_names)}
    for name in wanted:
        if name in table.column_names:
            columns[name] = table.column(name).to_pylist()
    return columns, table.num_rows


def _read_jsonl(path: Path, wanted: tuple[str, ...], limit: int | None) -> tuple[dict[str, list[Any]], int]:
    records: list[dict[str, Any]] = []
    seen_names: dict[str, None] = {}
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if limit is not None and len(records) >= limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise JobInputError(
                    f"data.path: {path} line {line_number} is not valid JSON: {err}"
                ) from None
            if not isinstance(record, dict):
                raise JobInputError(
                    f"data.path: {path} line {line_number} is a JSON {type(record).__name__}, expected an object"
                )
            seen_names.update(dict.fromkeys(record))
            records.append(record)
    columns: dict[str, list[Any]] = {"__all__": list(seen_names)}
    for name in wanted:
        if name in seen_names:
            columns[name] = [r.get(name) for r in records]
    return columns, len(records)


def _validate_ids(values: list[Any], column: str, path: Path) -> tuple[list[Any], str]:
    kinds = set()
    for row, value in enumerate(values):
        if value is None:
            raise JobInputError(f"data.id_column: row {row} of {path} has a null id in column '{column}'")
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise JobInputError(
                f"data.id_column: row {row} of {path}: id {_short(value)} is {type(value).__name__}, "
                "expected an int or a string"
            )
        kinds.add("str" if isinstance(value, str) else "int")
    if len(kinds) > 1:
        raise JobInputError(f"data.id_column: column '{column}' of {path} mixes int and string ids")
    first_row: dict[Any, int] = {}
    duplicates = []
    for row, value in enumerate(values):
        if value in first_row:
            duplicates.append((value, first_row[value], row))
        else:
            first_row[value] = row
    if duplicates:
        value, first, again = duplicates[0]
        raise JobInputError(
            f"data.id_column: duplicate ids in column '{column}' of {path}: {value!r} at rows {first} and {again}"
            f" ({len(duplicates)} duplicate row(s) in all); ids must be unique"
        )
    return list(values), (kinds.pop() if kinds else "int")


def _validate_messages(value: Any, row: int, row_id: Any, column: str, path: Path) -> list[dict[str, str]]:
    where = f"data.messages_column: row {row} (id {row_id!r}) of {path}"
    if isinstance(value, str):  # CSV / some JSONL writers store the list as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise JobInputError(
                f"{where}: '{column}' is a string that is not a JSON list of messages"
            ) from None
    if not isinstance(value, list) or not value:
        raise JobInputError(f"{where}: '{column}' must be a non-empty list of {{role, content}} messages")
    messages = []
    for i, message in enumerate(value):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise JobInputError(
                f"{where}: message {i} must have string 'role' and 'content', got {_short(message)}"
            )
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


def _short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."
