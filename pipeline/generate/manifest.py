"""The manifest and the resume policy of an output directory.

`_manifest.json` is written once, when a job starts the directory: the config hash, the settings that
decide the rows (the input files' identity and the models' identity among them), the row and shard
counts. `check_output_dir` decides, before anything is written, whether a run starts fresh, resumes, or
is refused: another config's results, an input file or a model that changed since, a non-empty directory
without a manifest. `load_state` reads the commit log and says which shards are done: listed, and the part
file there with the listed size (and, with `retry_failed`, without error rows other than those that failed
for their input: an unreadable record fails again on the same input). Its memory is a few bytes per shard;
the statistics of done shards are summed as they are read.

Not here: writing part files (`pipeline.generate.output`), the log format (`pipeline.generate.commit_log`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow.fs as pafs

from pipeline import fs
from pipeline.config import flatten
from pipeline.errors import JobInputError
from pipeline.generate.commit_log import read_commit_records
from pipeline.generate.output import MANIFEST_NAME, SUCCESS_NAME
from pipeline.generate.stats import empty_stats, merge_stats

MANIFEST_VERSION = 2
_OWN_FILES = (MANIFEST_NAME, SUCCESS_NAME, "_commits.jsonl", "_commits", "_lease.json")


@dataclass
class Manifest:
    config_hash: str
    settings: dict[str, Any]
    num_rows: int
    num_shards: int
    part_digits: int = 6
    id_kind: str = "int"
    shard_size: int | None = None  # rows per shard (None in manifests older than shard_size=null)
    samples_per_shard: int | None = None  # samples of each prompt per shard (None: all of them; `ShardLayout`)
    # {role: {file: sha256}} covering every tensor (`pipeline.hashing.tensor_fingerprint`), not in the config hash:
    # the pair every actor must have loaded (None: a manifest written before it)
    model_fingerprints: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "version": MANIFEST_VERSION,
            "config_hash": self.config_hash,
            "settings": self.settings,
            "num_rows": self.num_rows,
            "num_shards": self.num_shards,
            "part_digits": self.part_digits,
            "id_kind": self.id_kind,
            "shard_size": self.shard_size,
            **({"samples_per_shard": self.samples_per_shard} if self.samples_per_shard else {}),
            **({"model_fingerprints": self.model_fingerprints} if self.model_fingerprints else {}),
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Manifest:
        return cls(
            config_hash=raw["config_hash"],
            settings=raw["settings"],
            num_rows=int(raw["num_rows"]),
            num_shards=int(raw["num_shards"]),
            part_digits=int(raw.get("part_digits", 6)),
            id_kind=str(raw.get("id_kind", "int")),
            shard_size=raw.get("shard_size"),
            samples_per_shard=raw.get("samples_per_shard"),
            model_fingerprints=raw.get("model_fingerprints"),
        )

    def save(self, output: fs.Location) -> None:
        fs.write_bytes(output.child(MANIFEST_NAME), json.dumps(self.to_json(), indent=1).encode())


def load_manifest(output: fs.Location) -> Manifest | None:
    location = output.child(MANIFEST_NAME)
    if not fs.exists(location):
        return None
    try:
        return Manifest.from_json(json.loads(fs.read_bytes(location)))
    except (ValueError, KeyError, TypeError) as err:
        raise JobInputError(
            f"output_dir: {location.uri} is not a valid manifest ({err}); use another output_dir"
        ) from None


def check_output_dir(output: fs.Location, config_hash: str, settings: dict[str, Any]) -> Manifest | None:
    """The manifest to continue from (None: a fresh directory). Refuses with JobInputError; writes nothing."""
    found = fs.info(output, "output_dir")
    if found.type == pafs.FileType.File:
        raise JobInputError(f"output_dir: {output.uri} exists and is not a directory")
    existing = load_manifest(output)
    if existing is None:
        leftovers = [
            info.base_name
            for info in fs.list_files(output, "output_dir")
            if not info.base_name.startswith(".") and info.base_name not in _OWN_FILES
        ]
        if leftovers:
            raise JobInputError(
                f"output_dir: {output.uri} is not empty ({', '.join(sorted(leftovers)[:5])}) and holds no "
                f"{MANIFEST_NAME}; choose a new or empty directory"
            )
        return None
    if existing.config_hash != config_hash:
        raise JobInputError(_refusal(output, existing.settings, settings))
    return existing


def _refusal(output: fs.Location, old: dict[str, Any], new: dict[str, Any]) -> str:
    changed_input = _changed_files(old.get("inputs", []), new.get("inputs", []))
    if changed_input and old.get("data") == new.get("data"):
        return (
            f"data.path: the input changed since {output.uri} was started ({'; '.join(changed_input[:3])}); "
            "restore it to resume, or choose another output_dir"
        )
    for role in ("target", "draft"):
        before, now = old.get("models", {}).get(role), new.get("models", {}).get(role)
        if old.get("model", {}).get(role) == new.get("model", {}).get(role) and before != now:
            changed = _changed_models(before or {}, now or {})
            return (
                f"model.{role}: the model at {new['model'][role]} changed since {output.uri} was started "
                f"({'; '.join(changed[:3])}); restore it to resume, or choose another output_dir"
            )
    changed = _differences(old, new)
    detail = "; ".join(changed[:6]) if changed else "the prompts or the data file changed"
    return (
        f"output_dir: {output.uri} holds results of a different config ({detail}); "
        "re-run with the same config to resume, or choose another output_dir"
    )


def _changed_files(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[str]:
    before = {f["path"]: f for f in old}
    now = {f["path"]: f for f in new}
    changed = [f"{path}: gone" for path in before if path not in now]
    changed += [f"{path}: new" for path in now if path not in before]
    for path in sorted(set(before) & set(now)):
        a, b = before[path], now[path]
        if a["size"] != b["size"]:
            changed.append(f"{path}: size {a['size']} then, {b['size']} now")
        elif a.get("mtime_ns") != b.get("mtime_ns"):
            changed.append(f"{path}: modified since")
    return changed


def _changed_models(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    names = sorted(set(before) | set(now))
    return [f"{name}: {'content differs' if name in before and name in now else 'added or removed'}"
            for name in names if before.get(name) != now.get(name)]  # fmt: skip


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    old_flat, new_flat = flatten(old), flatten(new)
    return [
        f"{key}: {old_flat.get(key)!r} there, {new_flat.get(key)!r} now"
        for key in sorted(set(old_flat) | set(new_flat))
        if old_flat.get(key) != new_flat.get(key) and not key.startswith(("inputs", "models"))
    ]


@dataclass
class OutputState:
    """Which shards are done (one byte each), and the statistics of those done shards, summed."""

    done: bytearray
    listed: bytearray = field(default_factory=bytearray)  # shards any commit record names (their retries are fenced)
    rows_done: int = 0
    shards_retried: int = 0  # listed with error rows, regenerated because of retry_failed
    earlier_stats: dict[str, Any] = field(default_factory=empty_stats)
    has_success: bool = False
    first_errors: list[tuple[int, Any, str]] = field(default_factory=list)  # (shard, id, error) of done shards' first

    def __post_init__(self) -> None:
        if len(self.listed) != len(self.done):
            self.listed = bytearray(len(self.done))

    @property
    def shards_done(self) -> int:
        return sum(self.done)


def incomplete_shards(output: fs.Location, num_shards: int, limit: int = 5) -> tuple[int, list[str]]:
    """Re-read from the directory itself: (how many of the job's shards have no committed part there with its
    listed size, what is wrong with the first `limit`). `_SUCCESS` is written only when the count is 0."""
    records = {record["shard"]: record for record in read_commit_records(output)}
    sizes = {info.base_name: info.size for info in fs.list_files(output, "output_dir")}
    count, first = 0, []
    for shard in range(num_shards):
        record = records.get(shard)
        if record is not None and sizes.get(record["file"]) == record["bytes"]:
            continue
        count += 1
        if len(first) < limit:
            if record is None:
                first.append(f"shard {shard}: no commit record")
            else:
                found = "missing" if record["file"] not in sizes else f"{sizes[record['file']]} bytes"
                first.append(f"shard {shard}: {record['file']} is {found}, its commit lists {record['bytes']} bytes")
    return count, first


JOB_FIRST_ERRORS = 3  # failed rows a failed job's last lines name


def keep_first_errors(kept: list[tuple[int, Any, str]], shard: int, errors: Any) -> None:
    """Add a shard's first failed rows ([id, error] each) to `kept`, which holds the job's first
    `JOB_FIRST_ERRORS` by shard: its size stays bounded however many rows fail."""
    kept.extend((shard, row_id, error) for row_id, error in errors)
    kept.sort(key=lambda failure: failure[0])
    del kept[JOB_FIRST_ERRORS:]


def load_state(output: fs.Location, num_shards: int, retry_failed: bool) -> OutputState:
    """Read the commit log: a shard is done when its last record's file is present with the listed size."""
    latest = np.full(num_shards, -1, dtype=np.int64)  # position of each shard's last record
    sizes = np.zeros(num_shards, dtype=np.int64)
    failed = np.zeros(num_shards, dtype=np.int64)
    names: dict[int, str] = {}
    for position, record in enumerate(read_commit_records(output)):
        shard = record["shard"]
        if 0 <= shard < num_shards:
            # rows that failed for their input fail again: retry_failed does not regenerate them
            failed[shard] = record.get("failed", 0) - record.get("failed_input", 0)
            latest[shard], sizes[shard] = position, record["bytes"]
            names[shard] = record["file"]
    state = OutputState(done=bytearray(num_shards), has_success=fs.exists(output.child(SUCCESS_NAME)))
    if not names:
        return state
    for shard in names:
        state.listed[shard] = 1
    present = {info.base_name: info.size for info in fs.list_files(output, "output_dir")}
    for shard, name in names.items():
        if present.get(name) == sizes[shard]:
            if retry_failed and failed[shard]:
                state.shards_retried += 1
            else:
                state.done[shard] = 1
    del names, present
    for position, record in enumerate(read_commit_records(output)):
        shard = record["shard"]
        if 0 <= shard < num_shards and state.done[shard] and latest[shard] == position:
            merge_stats(state.earlier_stats, record["stats"])
            keep_first_errors(state.first_errors, shard, record.get("errors", ()))
            state.rows_done += int(record["rows"])
    return state
