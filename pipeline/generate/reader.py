"""Reading a finished (or partial) output directory back: the rows in input order, and the run's settings.

`read_output` takes a local path or a URI, reads the commit log, and concatenates the committed part files
in shard (= input row) order (every shard the manifest lists, unless `partial=True`); a shard committed twice (a retried one) counts once, its last commit. Parts
that are not in the log (a run killed between writing and committing, an attempt the driver gave up on)
are not read, and each committed part must have the size its record lists (else `ValueError`).

Not here: writing (`pipeline.generate.output`), the resume policy (`pipeline.generate.manifest`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import fs
from pipeline.generate.commit_log import read_commit_records
from pipeline.generate.manifest import load_manifest
from pipeline.generate.output import MANIFEST_NAME, SETTINGS_METADATA_KEY, output_schema


def committed_files(output_dir: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """Shard index -> its last commit record."""
    output = fs.resolve(os.fspath(output_dir), "output_dir")
    return {record["shard"]: record for record in read_commit_records(output)}


def read_output(output_dir: str | os.PathLike[str], partial: bool = False) -> pa.Table:
    """All committed shards, concatenated in shard (= input row) order. An output that misses shards its
    manifest lists (a job not finished, or finished short) is refused (`ValueError`) unless `partial`: then
    the committed shards only."""
    output = fs.resolve(os.fspath(output_dir), "output_dir")
    manifest = load_manifest(output)
    if manifest is None:
        raise FileNotFoundError(f"{output.uri} has no {MANIFEST_NAME}")
    records = {record["shard"]: record for record in read_commit_records(output)}
    absent = [shard for shard in range(manifest.num_shards) if shard not in records]
    if absent and not partial:
        raise ValueError(
            f"{output.uri}: {len(absent)} of the {manifest.num_shards} shards its manifest lists have no committed "
            f"part (shard {', '.join(map(str, absent[:5]))}{', ...' if len(absent) > 5 else ''}): the job did not "
            "finish; re-run it to complete the output, or read_output(..., partial=True) for the committed shards"
        )
    sizes = {info.base_name: info.size for info in fs.list_files(output, "output_dir")} if records else {}
    tables = []
    for index in sorted(records):
        name, listed = records[index]["file"], records[index]["bytes"]
        if sizes.get(name) != listed:
            found = "missing" if name not in sizes else f"{sizes[name]} bytes"
            raise ValueError(f"{output.uri}: shard {index}'s part {name} is {found}, its commit lists {listed} bytes")
        location = output.child(name)
        with location.filesystem.open_input_file(location.path) as f:
            tables.append(pq.read_table(f))
    return pa.concat_tables(tables) if tables else output_schema(manifest.id_kind).empty_table()


def read_settings(parquet_path: str | os.PathLike[str]) -> dict[str, Any]:
    """The run-level settings stored in one shard's schema metadata."""
    location = fs.resolve(os.fspath(parquet_path), "path")
    with location.filesystem.open_input_file(location.path) as f:
        metadata = pq.read_schema(f).metadata or {}
    return json.loads(metadata[SETTINGS_METADATA_KEY])


def read_plan(parquet_path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """method=auto: the planner's choice recorded in one shard's schema metadata (None for a fixed method)."""
    location = fs.resolve(os.fspath(parquet_path), "path")
    with location.filesystem.open_input_file(location.path) as f:
        metadata = pq.read_schema(f).metadata or {}
    raw = metadata.get(b"spectr.plan")
    return None if raw is None else json.loads(raw)
