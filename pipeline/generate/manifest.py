"""The manifest and the resume policy of an output directory.

`_manifest.json` holds the config hash, the settings that decide the rows, and each finished shard with
its row count and stats. `open_output_dir` decides, before anything is written, whether a run starts
fresh, resumes, or is refused because the directory holds another config's results; `finished_shards`
says which shards a resumed run can skip.

Not here: writing the Parquet files (`pipeline.generate.output`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from pipeline.config import flatten
from pipeline.errors import JobInputError
from pipeline.generate.output import MANIFEST_NAME, atomic_write_bytes, shard_file_name

MANIFEST_VERSION = 1


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
        atomic_write_bytes(output_dir / MANIFEST_NAME, json.dumps(self.to_json(), indent=1).encode())

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
