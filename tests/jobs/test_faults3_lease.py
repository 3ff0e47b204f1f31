"""A job whose output_dir holds an empty `_lease.json` takes it over after lease_timeout_s and finishes
(issue #52, item 2). The fault is injected from outside: the file a crash or a full disk leaves between the
lease's creation and its write. Before the fix every taker put it back, and the job was refused ("other jobs
keep taking it") until someone deleted the file."""

from __future__ import annotations

import json

import pytest
from tiny_pair_support import job_config

from pipeline.generate.config import from_dict
from pipeline.generate.job import run_generate
from pipeline.generate.reader import read_output


@pytest.mark.slow  # a whole job; the default suite's sibling: tests/pipeline/generate/test_faults3_lease_file.py
def test_a_job_takes_over_an_empty_lease_file_and_finishes(tiny_pair, prompts_jsonl, tmp_path, ray_local):
    out = tmp_path / "out"
    out.mkdir()
    (out / "_lease.json").write_bytes(b"")
    report = run_generate(from_dict(job_config(tiny_pair, prompts_jsonl, out, lease_timeout_s=1)))
    assert report.exit_code == 0 and (out / "_SUCCESS").exists()
    ids = [json.loads(line)["id"] for line in prompts_jsonl.read_text().splitlines()]
    assert read_output(out).column("id").to_pylist() == ids
    assert not (out / "_lease.json").exists()  # released at the end
