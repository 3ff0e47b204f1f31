"""`_SUCCESS` only over a complete output, and `read_output` refuses a short one (issue #52, item 2).

Faults injected from outside the code under test, in the output directory, on the session's local Ray:
- a committed part file deleted while the job runs (what a driver sees when the actors wrote their parts on
  their own nodes' local disks, or a part lost since): before the fix the job wrote `_SUCCESS` over the
  short directory; now it exits 1 without `_SUCCESS` and names the shard;
- a commit record cut from `_commits.jsonl`: `read_output` refuses the output (its manifest lists a shard
  it cannot find) unless asked for `partial=True`.
"""

from __future__ import annotations

import json

import pytest
from tiny_pair_support import job_config

from pipeline.generate.config import from_dict
from pipeline.generate.job import run_generate
from pipeline.generate.reader import read_output
from pipeline.generate.scheduler import RunHooks


@pytest.mark.slow  # a whole job; the default suite's siblings: tests/pipeline/generate/test_faults3_output.py
def test_a_part_that_vanished_means_no_success_and_read_output_refuses(tiny_pair, prompts_jsonl, tmp_path, ray_local):
    """(A rerun regenerates a shard whose part is missing: tests/jobs/test_generate_resume.py.)"""
    out = tmp_path / "out"
    deleted: list[tuple[int, str]] = []

    def delete_first(result) -> None:  # another node's disk, as the driver sees it: the part is not there
        if not deleted:
            (out / result.file).unlink()
            deleted.append((result.index, f"shard {result.index}: {result.file} is missing"))

    report = run_generate(from_dict(job_config(tiny_pair, prompts_jsonl, out)), RunHooks(on_shard_written=delete_first))
    assert report.exit_code == 1 and not (out / "_SUCCESS").exists()
    shard, named = deleted[0]
    assert "1 of 5 shards have no committed part file" in report.messages[-1] and named in report.messages[-1]
    with pytest.raises(ValueError, match="is missing"):
        read_output(out)

    # its commit record lost too (a log cut since): the manifest's shard has none; refused unless partial
    commits = out / "_commits.jsonl"
    lines = commits.read_text().splitlines(keepends=True)
    commits.write_text("".join(line for line in lines if json.loads(line)["shard"] != shard))
    with pytest.raises(ValueError, match=f"1 of the 5 shards its manifest lists have no committed part \\(shard {shard}\\)"):
        read_output(out)
    ids = [json.loads(line)["id"] for line in prompts_jsonl.read_text().splitlines()]
    assert read_output(out, partial=True).column("id").to_pylist() == ids[: 8 * shard] + ids[8 * shard + 8 :]
