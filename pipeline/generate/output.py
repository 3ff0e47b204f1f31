"""The output directory's data files: the Parquet row schema, part files, `_SUCCESS`, leftovers.

Layout (docs/architecture.md, "Output directory"):

    part-000000-<run>-<attempt>.parquet ...  one per shard, one row per prompt, written by the worker that
                             generated it, named for its run and attempt (`ShardTask.fence`)
    _manifest.json           config hash + settings, written once when the directory is started
    _commits.jsonl           one line per finished shard (`_commits/` segments on object stores)
    _lease.json              the job writing the directory now (removed when it ends)
    _SUCCESS                 written only when the job succeeded

A part file is written whole (`pipeline.fs.write_bytes`: a temporary name then a rename on local disks and
HDFS, one upload on object stores), so a run killed at any moment leaves each part complete or absent;
a shard counts as done only once the commit log lists it with its size (`pipeline.generate.manifest`).

Not here: the commit log (`pipeline.generate.commit_log`), the lease (`pipeline.generate.lease`), reading
results back (`pipeline.generate.reader`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import fs
from pipeline.generate.config import top_count
from pipeline.generate.shards import MIN_PART_DIGITS, part_name

MANIFEST_NAME = "_manifest.json"
SUCCESS_NAME = "_SUCCESS"
SETTINGS_METADATA_KEY = b"spectr.settings"
FINISH_REASONS = ("stop", "length", "error")  # vLLM's; "stop": end-of-sequence, a stop token or a stop string
_OWN_TEMPORARIES = (".part-", f".{MANIFEST_NAME}", f".{SUCCESS_NAME}", "._lease.json")


def output_schema(id_kind: str, settings: dict[str, Any] | None = None, logprobs: Any = False,
                  kept: tuple[tuple[str, Any], ...] = ()) -> pa.Schema:
    """The Parquet row of the contract; run-level `settings` go into the schema metadata as JSON.

    logprobs: `spectr.logprobs`: true or an int N adds a `completion_logprobs` column, N > 0 also
    `completion_top_logprobs` (per token, N structs of token_id and logprob); kept: the `data.keep_columns`
    (name, Arrow type), last."""
    count = top_count(logprobs)
    top, with_logprobs = count or 0, count is not None
    entry = pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())])
    schema = pa.schema(
        [
            ("id", pa.int64() if id_kind == "int" else pa.string()),
            ("prompt", pa.string()),
            ("completion", pa.string()),
            ("completion_token_ids", pa.list_(pa.int32())),
            ("prompt_tokens", pa.int32()),
            ("completion_tokens", pa.int32()),
            ("finish_reason", pa.string()),
            ("stop_reason", pa.string()),
            ("target_calls", pa.int32()),
            ("block_efficiency", pa.float64()),
            ("seed", pa.int64()),
            ("error", pa.string()),
            ("sample_index", pa.int32()),
            ("time_taken_s", pa.float64()),
            *([("completion_logprobs", pa.list_(pa.float32()))] if with_logprobs else []),
            *([("completion_top_logprobs", pa.list_(pa.list_(entry)))] if top else []),
            *kept,
        ]
    )
    if settings is not None:
        schema = schema.with_metadata({SETTINGS_METADATA_KEY: json.dumps(settings, sort_keys=True).encode()})
    return schema


def encode_part(index: int, rows: list[dict[str, Any]], schema: pa.Schema) -> bytes:
    """One shard's rows as the bytes of a Parquet file."""
    for row in rows:
        if row["finish_reason"] not in FINISH_REASONS:
            raise ValueError(f"shard {index}: row {row['id']!r} has finish_reason {row['finish_reason']!r}")
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), sink)
    return sink.getvalue().to_pybytes()


def write_shard(
    output: fs.Location | str | Path,
    index: int,
    rows: list[dict[str, Any]],
    schema: pa.Schema,
    digits: int = MIN_PART_DIGITS,
    fence: str = "",
) -> tuple[str, int]:
    """Write one shard's part file whole (named for its attempt, `ShardTask.fence`); returns (file name, size)."""
    if not isinstance(output, fs.Location):
        output = fs.resolve(str(output), "output_dir")
    data = encode_part(index, rows, schema)
    name = part_name(index, digits, fence)
    fs.write_bytes(output.child(name), data)
    return name, len(data)


def remove_stale_temporaries(output: fs.Location) -> list[str]:
    """Delete temporary files a killed run left behind (our own `.<name>.tmp-...` names only)."""
    if not output.renames_atomically:
        return []  # object stores: nothing is written under a temporary name
    removed = []
    for info in fs.list_files(output, "output_dir"):
        name = info.base_name
        if ".tmp-" in name and name.startswith(_OWN_TEMPORARIES):
            fs.delete(fs.Location(output.filesystem, info.path, output.child(name).uri))
            removed.append(name)
    return sorted(removed)


def remove_uncommitted_parts(output: fs.Location, committed: set[str]) -> list[str]:
    """Delete part files the commit log does not name (attempts the driver gave up on, whose actors are
    gone); called under the lease before `_SUCCESS`, so that the directory holds exactly the committed parts."""
    removed = []
    for info in fs.list_files(output, "output_dir"):
        name = info.base_name
        if name.startswith("part-") and name.endswith(".parquet") and name not in committed:
            fs.delete(output.child(name))
            removed.append(name)
    return sorted(removed)


def write_success(output: fs.Location) -> None:
    fs.write_bytes(output.child(SUCCESS_NAME), b"")


def remove_success(output: fs.Location) -> None:
    """A job that has shards to (re)generate is not a success until it ends as one."""
    fs.delete(output.child(SUCCESS_NAME))
