"""Checks of prompt rows, and their messages: ids over the whole input, prompt and chat values per row.

`IdChecker` takes the id column batch by batch (as the driver streams it) and raises `JobInputError` for a
null id, an id that is neither an int nor a string, a column that mixes both, or duplicate ids anywhere in
the input. It keeps one 64-bit hash per row (8 bytes a row: the only per-row state the driver holds) and,
only when two hashes are equal, reads the ids again to name the rows and confirm that the values are equal.

`prompt_problem` and `messages_problem` say what is wrong with one row's prompt or chat messages, in the
words every message of this project uses ("row 3 (id 'b') of p.jsonl: prompt is int 7, expected a string").
`budget_problem` and `BudgetCheck` do the same for a row's `data.max_new_tokens_column` value (an
integer >= 1, within the models' limit), one value or an Arrow batch at a time.

Not here: reading files (`pipeline.prompts`, `pipeline.source`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.errors import JobInputError

MAX_DUPLICATES_LOCATED = 1000  # hashes looked up again to name the first duplicate


def short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def id_kind_of_type(arrow_type: pa.DataType) -> str | None:
    """'int' or 'str' for an Arrow id column type; None when it is neither."""
    if pa.types.is_dictionary(arrow_type):
        arrow_type = arrow_type.value_type
    if pa.types.is_integer(arrow_type):
        return "int"
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or _is_string_view(arrow_type):
        return "str"
    return None


def is_text_type(arrow_type: pa.DataType) -> bool:
    return id_kind_of_type(arrow_type) == "str"


def _is_string_view(arrow_type: pa.DataType) -> bool:
    check = getattr(pa.types, "is_string_view", None)
    return bool(check and check(arrow_type))


def id_value_problem(value: Any) -> str | None:
    if value is None:
        return "null"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return f"{short(value)} is {type(value).__name__}"
    return None


class IdChecker:
    """Null, type and duplicate checks of the id column over the whole input (see the module docstring)."""

    def __init__(self, column: str, where: str):
        self.column = column
        self.where = where  # data.path, for the messages
        self.kind: str | None = None
        self._hashes: list[np.ndarray] = []
        self.rows = 0

    def add(self, ids: pa.Array | pa.ChunkedArray, first_row: int) -> None:
        """One batch of ids whose first row has global index `first_row`."""
        if isinstance(ids, pa.ChunkedArray):
            ids = ids.combine_chunks()
        if pa.types.is_dictionary(ids.type):
            ids = ids.dictionary_decode()
        if ids.null_count:
            row = first_row + int(pc.index(pc.is_null(ids), True).as_py())
            raise JobInputError(
                f"data.id_column: row {row} of {self.where} has a null id in column '{self.column}'"
            )
        self._check_kind(ids, first_row)
        self._hashes.append(hash_ids(ids, self.kind))
        self.rows += len(ids)

    def _check_kind(self, ids: pa.Array, first_row: int) -> None:
        kind = id_kind_of_type(ids.type)
        if kind is None and len(ids):
            valid = pc.drop_null(ids)
            value = valid[0].as_py() if len(valid) else None
            raise JobInputError(
                f"data.id_column: row {first_row} of {self.where}: id {short(value)} is "
                f"{type(value).__name__} (column type {ids.type}), expected an int or a string"
            )
        if kind is not None and self.kind not in (None, kind):
            self.mixed()
        self.kind = self.kind or kind

    def mixed(self) -> None:
        raise JobInputError(
            f"data.id_column: column '{self.column}' of {self.where} mixes int and string ids"
        )

    def finish(self, reread: Callable[[], Iterable[tuple[pa.Array, int]]]) -> None:
        """Raise for duplicate ids; `reread()` yields the same (ids, first_row) batches again."""
        if not self._hashes:
            return
        hashes = np.concatenate(self._hashes)
        self._hashes = []
        hashes.sort()
        repeated = hashes[1:] == hashes[:-1]
        if not repeated.any():
            return
        suspects = set(np.unique(hashes[1:][repeated])[:MAX_DUPLICATES_LOCATED].tolist())
        del hashes
        first_seen: dict[Any, int] = {}
        duplicates = 0
        found: tuple[Any, int, int] | None = None
        for ids, first_row in reread():
            if pa.types.is_dictionary(ids.type):
                ids = ids.dictionary_decode()
            batch_hashes = hash_ids(ids, self.kind)
            for position in np.flatnonzero(np.isin(batch_hashes, list(suspects))).tolist():
                value, row = ids[position].as_py(), first_row + position
                if value in first_seen:
                    duplicates += 1
                    found = found or (value, first_seen[value], row)
                else:
                    first_seen[value] = row
        if found is not None:
            value, first, again = found
            raise JobInputError(
                f"data.id_column: duplicate ids in column '{self.column}' of {self.where}: {value!r} at rows "
                f"{first} and {again} ({duplicates} duplicate row(s) in all); ids must be unique"
            )


def hash_ids(ids: pa.Array, kind: str | None) -> np.ndarray:
    """One 64-bit value per id: the int itself, or the string's hash (equal ids, equal values)."""
    if kind == "int":
        return np.asarray(ids.cast(pa.int64()).to_numpy(zero_copy_only=False), dtype=np.int64).view(np.uint64)
    return np.fromiter((hash(s) for s in ids.to_pylist()), dtype=np.int64, count=len(ids)).view(np.uint64)


def row_where(key: str, row: int, row_id: Any, where: str) -> str:
    return f"{key}: row {row} (id {row_id!r}) of {where}"


def prompt_problem(value: Any) -> str | None:
    """What is wrong with a prompt value, or None."""
    if isinstance(value, str):
        return None
    shown = "null" if value is None else f"{type(value).__name__} {short(value)}"
    return f"prompt is {shown}, expected a string"


def messages_problem(value: Any, column: str) -> tuple[list[dict[str, str]] | None, str | None]:
    """(messages, None) for valid chat messages, else (None, what is wrong)."""
    if isinstance(value, str):  # CSV / some JSONL writers store the list as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None, f"'{column}' is a string that is not a JSON list of messages"
    if not isinstance(value, list) or not value:
        return None, f"'{column}' must be a non-empty list of {{role, content}} messages"
    messages = []
    for i, message in enumerate(value):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            return None, f"message {i} must have string 'role' and 'content', got {short(message)}"
        messages.append({"role": message["role"], "content": message["content"]})
    return messages, None


BUDGET_KEY = "data.max_new_tokens_column"
_INT_TEXT = re.compile(r"[+-]?\d+")


def budget_problem(value: Any, limit: int | None, text: bool = False) -> tuple[int | None, str | None]:
    """(the budget, None) for a usable max_new_tokens value, else (None, what is wrong).

    limit: the most new tokens the models can take (their positions - 1: a prompt has a token), or None;
    text: the value is a CSV field, where digits are an integer."""
    if text and isinstance(value, str) and _INT_TEXT.fullmatch(value.strip()):
        value = int(value.strip())
    if value is None:
        return None, "max_new_tokens is null, expected an integer >= 1"
    if isinstance(value, bool) or not isinstance(value, int):
        return None, f"max_new_tokens is {type(value).__name__} {short(value)}, expected an integer >= 1"
    if value < 1:
        return None, f"max_new_tokens is {value}, expected an integer >= 1"
    if limit is not None and value > limit:
        return None, (
            f"max_new_tokens is {value}, over the models' limit of {limit} new tokens "
            f"({limit + 1} positions, a prompt token included)"
        )
    return value, None


def first_budget_problem(values: pa.Array | pa.ChunkedArray, limit: int | None, text: bool = False) -> tuple[int, str] | None:
    """(offset, what is wrong) of the first unusable max_new_tokens of an Arrow array, or None.

    Integer columns are checked in C++ (nulls, values < 1, values over `limit`); a text column (CSV) is
    parsed there too; anything else, or text that does not parse, is looked at value by value."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    if text and is_text_type(values.type):
        try:
            values = pc.cast(pc.utf8_trim_whitespace(values), pa.int64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
    if not pa.types.is_integer(values.type):
        for offset, value in enumerate(values.to_pylist()):
            problem = budget_problem(value, limit, text)[1]
            if problem:
                return offset, problem
        return None
    bad = pc.or_kleene(pc.is_null(values), pc.less(values, 1))
    if limit is not None:
        bad = pc.or_kleene(bad, pc.greater(values, limit))
    if not pc.any(bad).as_py():
        return None
    offset = int(pc.index(bad, True).as_py())
    return offset, budget_problem(values[offset].as_py(), limit)[1]


class ColumnCheck(Protocol):
    """What the scan hands one more column's values to (`BudgetCheck`, `pipeline.row_columns.SampleCounts`): per
    batch (`values`: pyarrow's read; `text`: a CSV column read as text) or per row (`value`: the line-by-line
    path of a JSON-lines block pyarrow rejects). `json_type`: the column's type in the JSON reader's explicit
    schema, None to let it infer."""

    column: str
    json_type: Any

    def values(self, values: Any, ids: pa.Array | None, first_row: int, where: str, text: bool = False) -> None: ...

    def value(self, value: Any, row: int, row_id: Any, where: str) -> None: ...


@dataclass
class BudgetCheck:
    """The up-front check of `data.max_new_tokens_column`: `JobInputError` naming the column, the row (and
    its id) and the file for the first value that is not an integer in [1, limit]. `largest`: the largest
    budget seen (the workers size their cache pools with it)."""

    column: str
    limit: int | None
    largest: int = 0
    json_type: Any = pa.int64()  # its type for pyarrow's JSON reader (the scan's explicit schema)

    def values(self, values: pa.Array | pa.ChunkedArray, ids: pa.Array | None, first_row: int, where: str,
               text: bool = False) -> None:
        """A batch of values whose first row has global index `first_row` (ids: the batch's, or None)."""
        found = first_budget_problem(values, self.limit, text)
        if found is not None:
            offset, problem = found
            row_id = ids[offset].as_py() if ids is not None else first_row + offset
            self._raise(problem, first_row + offset, row_id, where)
        if len(values):
            if text and is_text_type(values.type):
                values = pc.cast(pc.utf8_trim_whitespace(values), pa.int64())
            self.largest = max(self.largest, int(pc.max(values).as_py()))

    def value(self, value: Any, row: int, row_id: Any, where: str) -> None:
        budget, problem = budget_problem(value, self.limit)
        if problem:
            self._raise(problem, row, row_id, where)
        self.largest = max(self.largest, budget)

    def _raise(self, problem: str, row: int, row_id: Any, where: str) -> None:
        raise JobInputError(f"{row_where(BUDGET_KEY, row, row_id, where)}: column '{self.column}': {problem}")
