"""The output directory: per-shard Parquet files, the manifest, and `_SUCCESS`.

Layout (DESIGN.md, "Job contract"):

    part-00000.parquet ...   one per shard, one row per prompt, written to a temporary name then renamed
    _manifest.json           config hash + settings + each finished shard with its row count and stats
    _SUCCESS                 written once every prompt has a row

Only the driver writes here. Every write is atomic (temporary file, fsync, `os.replace`), so a run killed
at any moment leaves each file either complete or absent; a shard counts as done only once the manifest
lists it. `open_output_dir` decides, before anything is written, whether a run starts fresh, resumes, or
is refused because the directory holds another config's results.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import flatten
from pipeline.errors import JobInputError

MANIFEST_NAME = "_manifest.json"
SUCCESS_NAME = "_SUCCESS"
SETTINGS_METADATA_KEY = b"spectr.settings"
FINISH_REASONS = ("eos", "length", "stop", "error")
MANIFEST_VERSION = 1


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


def _atomic_write_bytes(path: Path, data: bytes) -> None:
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


@dataclass
class Manifest:
    config_hash: str
    settings: dict[str, Any]
    num_rows: int
    num_shards: int
    shards: dict[int, dict[str, Any]] = field(default_factory=dict)  # index -> {file, rows, stats}

    def to_json(self) -> dict[str, Any]:
        return {
            "version": MANIFEST_VERSION,
            "config_hash": self.config_hash,
            "settings": self.settings,
            "num_rows": self.num_rows,
            "num_shards": self.num_shards,
            "shards": {f"{i:05d}": self.shards[i] for i in sorted(self.shards)},
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Manifest:
        return cls(
            config_hash=raw["config_hash"],
            settings=raw["settings"],
            num_rows=int(raw["num_rows"]),
            num_shards=int(raw["num_shards"]),
            shards={int(k): v for k, v in raw.get("shards", {}).items()},
        )

    def save(self, output_dir: Path) -> None:
        _atomic_write_bytes(output_dir / MANIFEST_NAME, json.dumps(self.to_json(), indent=1).encode())

    def record_shard(
        self,
        output_dir: Path,
        index: int,
        rows: int,
        stats: dict[str, Any],
        worker: dict[str, Any] | None = None,
    ) -> None:
        self.shards[index] = {
            "file": shard_file_name(index),
            "rows": rows,
            "stats": stats,
            "worker": worker or {},
        }
        self.save(output_dir)

    @property
    def complete(self) -> bool:
        return (
            len(self.shards) == self.num_shards
            and sum(s["rows"] for s in self.shards.values()) == self.num_rows
        )


def load_manifest(output_dir: Path) -> Manifest | None:
    path = output_dir / MANIFEST_NAME
    if not path.exists():
        return None
    try:
        return Manifest.from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as err:
        raise JobInputError(
            f"output_dir: {path} is not a valid manifest ({err}); use another output_dir"
        ) from None


def open_output_dir(
    output_dir: Path, config_hash: str, settings: dict[str, Any], num_rows: int, shards: int
) -> Manifest:
    """The manifest to continue from: a fresh one, or the existing one when the config matches.

    Refuses (JobInputError) a non-empty directory that holds another config's results or no manifest.
    Writes nothing.
    """
    if output_dir.exists() and not output_dir.is_dir():
        raise JobInputError(f"output_dir: {output_dir} exists and is not a directory")
    existing = load_manifest(output_dir) if output_dir.exists() else None
    if existing is None:
        leftovers = (
            [p.name for p in output_dir.iterdir() if not p.name.startswith(".")]
            if output_dir.exists()
            else []
        )
        if leftovers:
            raise JobInputError(
                f"output_dir: {output_dir} is not empty ({', '.join(sorted(leftovers)[:5])}) and holds no "
                f"{MANIFEST_NAME}; choose a new or empty directory"
            )
        return Manifest(config_hash=config_hash, settings=settings, num_rows=num_rows, num_shards=shards)
    if existing.config_hash != config_hash:
        changed = _differences(existing.settings, settings)
        detail = "; ".join(changed[:6]) if changed else "the prompts or the data file changed"
        raise JobInputError(
            f"output_dir: {output_dir} holds results of a different config ({detail}); "
            "re-run with the same config to resume, or choose another output_dir"
        )
    return existing


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    old_flat, new_flat = flatten(old), flatten(new)
    return [
        f"{key}: {old_flat.get(key)!r} there, {new_flat.get(key)!r} now"
        for key in sorted(set(old_flat) | set(new_flat))
        if old_flat.get(key) != new_flat.get(key)
    ]


def finished_shards(output_dir: Path, manifest: Manifest) -> set[int]:
    """Shards the manifest lists whose file is present with the listed row count."""
    done = set()
    for index, entry in manifest.shards.items():
        path = output_dir / entry["file"]
        if path.exists() and pq.ParquetFile(path).metadata.num_rows == entry["rows"]:
            done.add(index)
    return done


def remove_stale_temporaries(output_dir: Path) -> list[str]:
    """Delete temporary files a killed run left behind (our own `.<name>.tmp-<pid>` names only)."""
    removed = []
    for path in output_dir.glob(".*.tmp-*"):
        if path.name.startswith((".part-", f".{MANIFEST_NAME}", f".{SUCCESS_NAME}")):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def write_success(output_dir: Path) -> None:
    _atomic_write_bytes(output_dir / SUCCESS_NAME, b"")


def read_output(output_dir: str | os.PathLike[str]) -> pa.Table:
    """All shards listed in the manifest, concatenated in shard (= input row) order."""
    directory = Path(output_dir)
    manifest = load_manifest(directory)
    if manifest is None:
        raise FileNotFoundError(f"{directory} has no {MANIFEST_NAME}")
    tables = [pq.read_table(directory / manifest.shards[i]["file"]) for i in sorted(manifest.shards)]
    return pa.concat_tables(tables) if tables else output_schema("int").empty_table()


def read_settings(parquet_path: str | os.PathLike[str]) -> dict[str, Any]:
    """The run-level settings stored in one shard's schema metadata."""
    metadata = pq.read_schema(parquet_path).metadata or {}
    return json.loads(metadata[SETTINGS_METADATA_KEY])
