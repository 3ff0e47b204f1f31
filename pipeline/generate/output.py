"""The output directory's data files: the Parquet row schema (and a row's vLLM fields), part files, `_SUCCESS`,
leftovers.

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

    vLLM's row fields that are not in the first ones: `prompt_token_ids` (the prompt generated from, after
    truncate_prompt_tokens), `stop_token_id` (vLLM's `stop_reason` when a stop token ended the row, an int; Parquet
    has no int-or-string column, so `stop_reason` holds its text and this column the int; null otherwise, as at
    EOS), `prompt_logprobs` (null unless the row asked: per prompt token, null first, its entries as vLLM's dict:
    the prompt token's, then the other top N, each token_id, logprob, rank).

    logprobs: `spectr.logprobs`: true or an int N adds a `completion_logprobs` column and `cumulative_logprob`
    (vLLM's: their sum), N > 0 also `completion_top_logprobs` (per token, N structs of token_id and logprob; a
    row's own logprobs=M keeps M); kept: the `data.keep_columns` (name, Arrow type), last."""
    count = top_count(logprobs)
    top, with_logprobs = count or 0, count is not None
    entry = pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())])
    ranked = pa.struct([("token_id", pa.int32()), ("logprob", pa.float32()), ("rank", pa.int32())])
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
            ("prompt_token_ids", pa.list_(pa.int32())),
            ("stop_token_id", pa.int32()),
            ("prompt_logprobs", pa.list_(pa.list_(ranked))),
            *([("completion_logprobs", pa.list_(pa.float32())), ("cumulative_logprob", pa.float64())]
              if with_logprobs else []),
            *([("completion_top_logprobs", pa.list_(pa.list_(entry)))] if top else []),
            *kept,
        ]
    )
    if settings is not None:
        schema = schema.with_metadata({SETTINGS_METADATA_KEY: json.dumps(settings, sort_keys=True).encode()})
    return schema


def with_vllm_fields(row: dict[str, Any], finished: Any, settings: Any, prompt_ids: list[int],
                     logprobs: Any) -> dict[str, Any]:
    """A generated row (the worker's, its first columns filled) with vLLM's other fields (`output_schema`):
    `prompt_token_ids` / `prompt_tokens` of the prompt generated from (`RowSettings.prompt_ids`), no text with
    detokenize=False, `cumulative_logprob` (the sum of `completion_logprobs`, as cut at a stop string) when
    `logprobs` (`spectr.logprobs`) is on, the row's own logprobs=M (its top M of the job's N), `prompt_logprobs`
    from the engine (`spectr.rows.PromptLogprobs`). settings: the row's `RowSettings` (None: the job's)."""
    row["prompt_token_ids"] = [int(t) for t in prompt_ids]
    row["prompt_tokens"] = len(row["prompt_token_ids"])
    if settings is not None and not settings.detokenize:
        row["completion"] = ""
    if top_count(logprobs) is not None:
        values = row.get("completion_logprobs")
        row["cumulative_logprob"] = None if values is None else float(sum(values))
    if settings is not None and settings.logprobs is not None and row.get("completion_top_logprobs") is not None:
        row["completion_top_logprobs"] = [entries[: settings.logprobs] for entries in row["completion_top_logprobs"]]
    asked = getattr(finished, "prompt_logprobs", None)
    row["prompt_logprobs"] = None if asked is None else prompt_logprob_entries(asked)
    return row


def prompt_logprob_entries(asked: Any) -> list[list[dict[str, Any]] | None]:
    """A `spectr.rows.PromptLogprobs` as the `prompt_logprobs` column: per prompt token (None first, as vLLM's), the
    prompt token's entry, then the top N's others (vLLM's dict {token id: Logprob(logprob, rank)}, as a list)."""
    out: list[list[dict[str, Any]] | None] = []
    for token, value, rank, top in zip(asked.token_ids, asked.logprobs, asked.ranks, asked.top):
        if value is None:
            out.append(None)
            continue
        entries = [{"token_id": token, "logprob": value, "rank": rank}]
        entries += [{"token_id": t, "logprob": v, "rank": r} for r, (t, v) in enumerate(top, start=1) if t != token]
        out.append(entries)
    return out


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
