"""The output directory's files: per-shard Parquet (schema and atomic writer) and `_SUCCESS`.

Layout (docs/architecture.md, "Output directory"):

    part-00000.parquet ...   one per shard, one row per prompt, written to a temporary name then renamed
    _manifest.json           config hash + settings + each finished shard with its row count and stats
    _SUCCESS                 written once every prompt has a row

Only the driver writes here. Every write is atomic (temporary file, fsync, `os.replace`), so a run killed
at any moment leaves each file either complete or absent; a shard counts as done only once the manifest
lists it (`pipeline.generate.manifest`). Reading results back: `pipeline.generate.reader`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

MANIFEST_NAME = "_manifest.json"
SUCCESS_NAME = "_SUCCESS"
SETTINGS_METADATA_KEY = b"spectr.settings"
FINISH_REASONS = ("eos", "length", "stop", "error")


def shard_file_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def output_schema(id_kind: str, settings: dict[str, Any] | None = None) -> pa.Schema:
    """The Parquet row of the contract; run-level `settings` go into the schema metadata as JSON."""
    schema = pa.schema(
        [
            ("id", pa.int64() if id_kind == "int" else pa.string()),
            ("prompt", pa.string()),
            ("completion", pa.string()),
            ("completion_token_ids", pa.list_(pa.int32())),
            ("prompt_tokens", pa.int32()),
            ("completion_tokens", pa.int32()),
            ("finish_reason", pa.string()),
            ("target_calls", pa.int32()),
            ("block_efficiency", pa.float64()),
            ("seed", pa.int64()),
            ("error", pa.string()),
        ]
    )
    if settings is not None:
        schema = schema.with_metadata({SETTINGS_METADATA_KEY: json.dumps(settings, sort_keys=True).encode()})
    return schema


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_shard(output_dir: Path, index: int, rows: list[dict[str, Any]], schema: pa.Schema) -> Path:
    """Write one shard's rows atomically; returns the final path."""
    for row in rows:
        if row["finish_reason"] not in FINISH_REASONS:
            raise ValueError(f"shard {index}: row {row['id']!r} has finish_reason {row['finish_reason']!r}")
    table = pa.Table.from_pylist(rows, schema=schema)
    final = output_dir / shard_file_name(index)
    tmp = output_dir / f".{final.name}.tmp-{os.getpid()}"
    pq.write_table(table, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(output_dir)
    return final


def remove_stale_temporaries(output_dir: Path) -> list[str]:
    """Delete temporary files a killed run left behind (our own `.<name>.tmp-<pid>` names only)."""
    removed = []
    for path in output_dir.glob(".*.tmp-*"):
        if path.name.startswith((".part-", f".{MANIFEST_NAME}", f".{SUCCESS_NAME}")):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def write_success(output_dir: Path) -> None:
    atomic_write_bytes(output_dir / SUCCESS_NAME, b"")


