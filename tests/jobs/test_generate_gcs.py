"""Output on a GCS JSON API: gcp-storage-emulator on 127.0.0.1 with the test-only generation check (a
stand-in for GCS, `tests/gcs_support.py`), reached over HTTP through `STORAGE_EMULATOR_HOST`.

The driver takes the lease with generation preconditions (google-cloud-storage) and writes its manifest and
commit log through pyarrow's `GcsFileSystem` on the emulator; the actors (which get `STORAGE_EMULATOR_HOST`
forwarded) write the parts there. Slow: a whole job; the default suite covers the GCS lease in
`tests/pipeline/generate/test_lease.py`.
"""

from __future__ import annotations

import json
import re

import pytest
from gcs_support import gcs_emulator
from tiny_pair_support import job_config

from pipeline import fs
from pipeline.generate.config import from_dict
from pipeline.generate.job import run_generate
from pipeline.generate.reader import read_output


@pytest.mark.slow
def test_a_job_writes_its_output_to_gs(tiny_pair, prompts_jsonl, tmp_path, ray_local):
    rows = [json.loads(line) for line in prompts_jsonl.read_text().splitlines()]
    with gcs_emulator(tmp_path, "results", preconditions=True):
        raw = job_config(tiny_pair, prompts_jsonl, "gs://results/run1", shard_size=8)
        report = run_generate(from_dict(raw))
        assert report.exit_code == 0 and report.summary.prompts_completed == 40
        table = read_output("gs://results/run1")
        assert sorted(table.column("id").to_pylist()) == sorted(r["id"] for r in rows)  # every id once
        out = fs.resolve("gs://results/run1", "output_dir")
        names = [f.path.rsplit("/", 1)[-1] for f in fs.list_files(out, "output_dir")]
        assert "_SUCCESS" in names and "_lease.json" not in names, names  # complete; the lease released
        parts = sorted(n for n in names if n.startswith("part-"))
        assert [n.split("-")[1] for n in parts] == [f"{i:06d}" for i in range(5)], parts  # one part per shard
    requests = (tmp_path / "gcs-preconditions.log").read_text()
    assert "ifGenerationMatch=0" in requests  # the lease was created with a generation precondition
    assert re.search(r"DELETE \S*_lease.json\?ifGenerationMatch=[1-9]", requests)  # and released with one
