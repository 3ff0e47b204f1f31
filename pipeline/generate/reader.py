"""Reading a finished (or partial) output directory back: the rows in input order, and the run's settings.

Not here: writing (`pipeline.generate.output`), the resume policy (`pipeline.generate.manifest`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.generate.manifest import load_manifest
from pipeline.generate.output import MANIFEST_NAME, SETTINGS_METADATA_KEY, output_schema


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
