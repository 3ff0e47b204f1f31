"""Record boundaries of a JSON-lines or CSV file, found in one streaming pass, in memory O(shards).

    scan = scan_records(stream, every=16, quoted=False)   # JSONL; quoted=True, header=True for CSV
    scan.rows, scan.offsets                               # records; byte offset of every 16th record

The file is read in blocks of `BLOCK_BYTES`. A record ends at a newline; in CSV only at a newline outside
double quotes (RFC 4180: quotes inside a field are doubled, so an even count of quotes so far means "outside"),
so prompts with newlines in them stay one record. Blank records are skipped: JSONL lines of ASCII whitespace
only, empty CSV lines. For every record whose global index (`first_row` + its index here) is a multiple of
`every`, the byte offset where it starts is kept: that is where a worker seeks to read a shard. Each block's
whole records also go to `on_block` (the caller's validation parses them there), so the file is read once.

A record longer than `max_record_bytes` is never held: the scan reads on to its end without keeping it (in
memory O(block), time linear) and lists it in `long_records` (its row, bytes and line); it is still a row,
and never reaches `on_block`: the worker writes an error row for it without reading it. A file that has no
line break at all and is longer than `max_record_bytes` is not one record per line: `ScanError`.

Not here: parsing records (`pipeline.prompts`), validating them (`pipeline.idcheck`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

BLOCK_BYTES = 1 << 20  # the per-block work arrays are a few bytes per input byte: keep blocks small
_NEWLINE, _QUOTE, _CR = 10, 34, 13
_ASCII_WHITESPACE = np.frombuffer(b" \t\r\n\x0b\x0c", dtype=np.uint8)


@dataclass
class Block:
    """Whole records of one block: `data` starts at a record; `rows` non-blank records, the first of which
    has global index `first_row` and starts on physical line `first_line` (1-based)."""

    data: bytes
    first_row: int
    first_line: int
    rows: int


@dataclass
class RecordScan:
    rows: int  # non-blank records (after the header, up to the limit)
    data_start: int  # byte offset of the first of them
    data_end: int  # byte offset just past the last of them (its newline included)
    offsets: np.ndarray  # int64: start of every record whose global index is a multiple of `every`
    header: bytes | None  # CSV: the header record, without its line ending
    lines: np.ndarray | None = None  # int64: the (1-based) line of each of `offsets`
    first_line: int = 1  # the line of the record at `data_start`
    long_records: tuple[LongRecord, ...] = ()  # records over max_record_bytes, in order


@dataclass(frozen=True)
class LongRecord:
    """A record over `max_record_bytes`, skipped unread: bytes [start, stop) (its line ending excluded),
    starting on line `line`, the next record on line `next_line` (a CSV record may hold line breaks)."""

    row: int  # global index (the caller makes it local to its file)
    start: int
    stop: int
    line: int
    next_line: int

    @property
    def size(self) -> int:
        return self.stop - self.start


class ScanError(ValueError):
    """The bytes cannot be cut into records (e.g. a quote that is never closed)."""


def scan_records(
    stream: Any,
    *,
    every: int,
    first_row: int = 0,
    limit: int | None = None,
    quoted: bool = False,
    header: bool = False,
    on_block: Callable[[Block], None] | None = None,
    block_bytes: int = BLOCK_BYTES,
    max_record_bytes: int | None = None,
) -> RecordScan:
    """Scan a readable binary stream (`.read(n)`); see the module docstring."""
    state = _ScanState(every, first_row, limit, quoted, header, on_block, max_record_bytes)
    carry, eof = b"", False
    while not eof and not state.full:
        chunk = stream.read(block_bytes)
        eof = not chunk
        buf = carry + bytes(chunk)
        if not buf:
            break
        consumed = state.feed(buf, final=eof)
        carry = buf[consumed:]
        if eof and carry and quoted:
            raise ScanError(f"a double quote opened near byte {state.position} is never closed")
        if max_record_bytes is not None and len(carry) > max_record_bytes and not state.full:
            carry, eof = state.skip_long(carry, stream, block_bytes)
    return state.result()


class _ScanState:
    def __init__(self, every, first_row, limit, quoted, header, on_block, max_record_bytes=None):
        self.every, self.first_row, self.limit = every, first_row, limit
        self.max_record_bytes = max_record_bytes
        self.quoted, self.want_header, self.on_block = quoted, header, on_block
        self.rows = 0
        self.position = 0  # absolute offset of the current buffer's first byte
        self.lines = 0  # newlines before the current buffer
        self.offsets: list[np.ndarray] = []
        self.lines_of: list[np.ndarray] = []  # the line of each offset
        self.first_line = 1
        self.long: list[LongRecord] = []
        self.header: bytes | None = None
        self.data_start: int | None = None
        self.data_end = 0

    @property
    def full(self) -> bool:
        return self.limit is not None and self.rows >= self.limit

    def feed(self, buf: bytes, final: bool) -> int:
        """Take the whole records of `buf`; returns how many bytes they span."""
        arr = np.frombuffer(buf, dtype=np.uint8)
        newlines = np.flatnonzero(arr == _NEWLINE)
        starts, ends, consumed = _records(arr, newlines, self.quoted, final)
        if not len(starts):
            return 0
        keep = np.flatnonzero(~self._blank(arr, starts, ends))
        if self.want_header and self.header is None and len(keep):
            first = keep[0]
            self.header = _strip_cr(buf[starts[first] : ends[first]])
            keep = keep[1:]
        if self.limit is not None:
            keep = keep[: self.limit - self.rows]
        long = np.zeros(len(keep), dtype=bool)
        if self.max_record_bytes is not None:
            long = ends[keep] - starts[keep] > self.max_record_bytes
        if long.any():
            self._take_runs(buf, newlines, starts[keep], ends[keep], long, final)
        elif len(keep):
            self._take(buf, newlines, starts[keep], ends[keep])
        if self.full and len(keep):
            consumed = int(ends[keep[-1]]) + 1
        self.lines += int(np.searchsorted(newlines, consumed))
        self.position += consumed
        return consumed

    def _blank(self, arr: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        if self.quoted:  # CSV: only empty lines are skipped (as pyarrow's reader does)
            lengths = ends - starts
            last = np.where(lengths > 0, arr[np.maximum(ends - 1, 0)], 0)
            return (lengths == 0) | ((lengths == 1) & (last == _CR))
        non_blank = np.zeros(len(arr) + 1, dtype=_count_type(arr))
        np.cumsum(~np.isin(arr, _ASCII_WHITESPACE), dtype=non_blank.dtype, out=non_blank[1:])
        return non_blank[ends] - non_blank[starts] == 0

    def _take(self, buf: bytes, newlines: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        count = len(starts)
        indices = self.first_row + self.rows + np.arange(count, dtype=np.int64)
        kept = starts[indices % self.every == 0].astype(np.int64)
        self.offsets.append(self.position + kept)
        self.lines_of.append(self.lines + np.searchsorted(newlines, kept).astype(np.int64) + 1)
        if self.data_start is None:
            self.data_start = self.position + int(starts[0])
            self.first_line = self.lines + int(np.searchsorted(newlines, starts[0])) + 1
        stop = min(int(ends[-1]) + 1, len(buf))
        self.data_end = self.position + stop
        if self.on_block is not None:
            first = int(starts[0])
            line = self.lines + int(np.searchsorted(newlines, first)) + 1
            self.on_block(Block(buf[first:stop], self.first_row + self.rows, line, count))
        self.rows += count

    def _take_runs(
        self, buf: bytes, newlines: np.ndarray, starts: np.ndarray, ends: np.ndarray, long: np.ndarray, final: bool
    ) -> None:
        """Records of one buffer some of which are over max_record_bytes: those are listed, the runs of
        others between them taken as usual."""
        if final and self.lines == 0 and not len(newlines):
            raise ScanError(self._no_line_break(int(ends[0] - starts[0])))
        run = 0
        for i in np.flatnonzero(long).tolist():
            if i > run:
                self._take(buf, newlines, starts[run:i], ends[run:i])
            start, end = int(starts[i]), int(ends[i])
            line = self.lines + int(np.searchsorted(newlines, start)) + 1
            next_line = self.lines + int(np.searchsorted(newlines, end)) + 2
            ending = 1 if end < len(buf) else 0
            self._take_long(self.position + start, self.position + end, line, next_line, ending)
            run = i + 1
        if run < len(starts):
            self._take(buf, newlines, starts[run:], ends[run:])

    def _take_long(self, start: int, stop: int, line: int, next_line: int, ending: int) -> None:
        """One record over max_record_bytes, bytes [start, stop) of the file, as a row no block holds."""
        row = self.first_row + self.rows
        if row % self.every == 0:
            self.offsets.append(np.array([start], dtype=np.int64))
            self.lines_of.append(np.array([line], dtype=np.int64))
        if self.data_start is None:
            self.data_start, self.first_line = start, line
        self.long.append(LongRecord(row, start, stop, line, next_line))
        self.data_end = stop + ending
        self.rows += 1

    def _no_line_break(self, size: int) -> str:
        return f"no line break in its {size} bytes, over data.max_record_bytes={self.max_record_bytes}: not one record per line"

    def skip_long(self, head: bytes, stream: Any, block_bytes: int) -> tuple[bytes, bool]:
        """The record `head` starts is over max_record_bytes: read on to its end, keeping none of it; list it
        as a row. Returns (the bytes after its line ending, end of file)."""
        if self.want_header and self.header is None:
            raise ScanError(f"the header record is longer than data.max_record_bytes={self.max_record_bytes}")
        start, line = self.position, self.lines + 1
        size = newlines = quotes = 0
        chunk, rest, eof = head, b"", False
        while True:
            arr = np.frombuffer(chunk, dtype=np.uint8)
            breaks = np.flatnonzero(arr == _NEWLINE)
            ends = breaks
            if self.quoted and len(breaks):
                parity = (np.cumsum(arr == _QUOTE, dtype=_count_type(arr)) + quotes) & 1
                ends = breaks[parity[breaks] == 0]
            if len(ends):
                end = int(ends[0])
                newlines += int(np.searchsorted(breaks, end))
                size, rest = size + end, chunk[end + 1 :]
                break
            size, newlines = size + len(chunk), newlines + len(breaks)
            quotes += int(np.count_nonzero(arr == _QUOTE)) if self.quoted else 0
            chunk = bytes(stream.read(block_bytes))
            if not chunk:
                eof = True
                break
        if eof and self.quoted and quotes & 1:
            raise ScanError(f"a double quote opened near byte {start} is never closed")
        if eof and self.lines == 0 and newlines == 0:
            raise ScanError(self._no_line_break(size))
        ending = 0 if eof else 1
        self._take_long(start, start + size, line, line + newlines + ending, ending)
        self.position = start + size + ending
        self.lines += newlines + ending
        return rest, eof

    def result(self) -> RecordScan:
        offsets = np.concatenate(self.offsets) if self.offsets else np.zeros(0, dtype=np.int64)
        lines = np.concatenate(self.lines_of) if self.lines_of else np.zeros(0, dtype=np.int64)
        start = self.data_start if self.data_start is not None else self.position
        return RecordScan(
            self.rows, start, max(self.data_end, start), offsets, self.header, lines, self.first_line,
            tuple(self.long),
        )


def _records(
    arr: np.ndarray, newlines: np.ndarray, quoted: bool, final: bool
) -> tuple[np.ndarray, np.ndarray, int]:
    """(starts, ends, consumed) of the whole records in `arr`: record i is arr[starts[i]:ends[i]] (its
    newline excluded). At the end of the file the last record needs no newline."""
    if quoted and len(newlines):
        quotes = np.cumsum(arr == _QUOTE, dtype=_count_type(arr))
        newlines = newlines[(quotes[newlines] & 1) == 0]
    ends = newlines.astype(np.int64)
    consumed = int(ends[-1]) + 1 if len(ends) else 0
    if final and consumed < len(arr):
        if quoted and int(np.count_nonzero(arr[consumed:] == _QUOTE)) % 2:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), 0  # an unclosed quote: the caller raises
        ends = np.append(ends, len(arr))
        consumed = len(arr)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64) if len(ends) else ends
    return starts, ends, consumed


def _count_type(arr: np.ndarray) -> type:
    return np.int32 if len(arr) < 2**31 - 1 else np.int64


def _strip_cr(record: bytes) -> bytes:
    return record[:-1] if record.endswith(b"\r") else record


def split_records(data: bytes, quoted: bool = False) -> list[bytes]:
    """The non-blank records of `data` (whole records, as a worker reads one shard's byte range)."""
    return [record for record, _ in split_records_with_lines(data, quoted)]


def split_records_with_lines(data: bytes, quoted: bool = False) -> list[tuple[bytes, int]]:
    """The non-blank records of `data`, each with the line it starts on (0: the first line of `data`)."""
    arr = np.frombuffer(data, dtype=np.uint8)
    newlines = np.flatnonzero(arr == _NEWLINE)
    starts, ends, _ = _records(arr, newlines, quoted, final=True)
    state = _ScanState(1, 0, None, quoted, False, None)
    blank = state._blank(arr, starts, ends) if len(starts) else np.zeros(0, bool)
    lines = np.searchsorted(newlines, starts).tolist()
    return [
        (data[s:e], line)
        for s, e, b, line in zip(starts.tolist(), ends.tolist(), blank.tolist(), lines)
        if not b
    ]
