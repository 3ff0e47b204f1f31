"""`read_output` refuses an output whose manifest lists a shard it cannot find (issue #52, item 2), without
Ray: the fault is a commit record missing from `_commits.jsonl` (a job killed before its last shard, or a log
cut since). Before the fix the short table came back silently."""

from __future__ import annotations

import pytest
from test_output import commit, row

from pipeline import fs
from pipeline.generate.commit_log import AppendLog
from pipeline.generate.manifest import Manifest, incomplete_shards
from pipeline.generate.output import output_schema, write_shard
from pipeline.generate.reader import read_output


def test_an_output_missing_a_listed_shard_is_refused_unless_partial(tmp_path):
    out = fs.resolve(str(tmp_path), "output_dir")
    Manifest("h", {}, num_rows=5, num_shards=3, id_kind="str").save(out)
    log = AppendLog(out)
    for index, rows in ((0, [row(0), row(1)]), (2, [row(4)])):  # shard 1 never committed
        name, size = write_shard(tmp_path, index, rows, output_schema("str"))
        commit(log, index, name, size, rows=len(rows))
    log.close()
    with pytest.raises(ValueError, match="1 of the 3 shards its manifest lists have no committed part \\(shard 1\\)"):
        read_output(tmp_path)
    assert read_output(tmp_path, partial=True).column("id").to_pylist() == ["p0", "p1", "p4"]
    assert incomplete_shards(out, 3) == (1, ["shard 1: no commit record"])


def test_what_the_job_writes_locally_has_no_world_access(tmp_path):
    """Part files hold prompts and completions: created 0o640 (the log and the run records too), the output
    directory 0o750 (before: the umask's default, 0o644 / 0o755 under the usual 022)."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        out = fs.resolve(str(tmp_path / "out"), "output_dir")
        assert fs.make_dirs(out)
        Manifest("h", {}, num_rows=1, num_shards=1, id_kind="str").save(out)
        name, size = write_shard(out, 0, [row(0)], output_schema("str"))
        log = AppendLog(out)
        commit(log, 0, name, size, rows=1)
        log.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o750
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").iterdir()}
    assert modes == {"_manifest.json": 0o640, name: 0o640, "_commits.jsonl": 0o640}


@pytest.mark.parametrize("failed_input", [1, 0])  # 0: the control, a row that failed for another reason
def test_a_shard_whose_rows_failed_for_their_input_is_done_on_a_rerun(tmp_path, failed_input):
    """The light sibling of tests/jobs/test_faults3_rows.py's rerun (slow): a commit record whose failed rows all
    failed for their input (an empty prompt, one over the model's positions: `failed_input`) is done for a rerun
    with `retry_failed`, so nothing is generated again; a row failed otherwise is retried."""
    from pipeline.generate.manifest import load_state

    out = fs.resolve(str(tmp_path), "output_dir")
    log = AppendLog(out)
    rows = [row(0), row(1, "error", "ValueError: prompt 0 is empty")]
    name, size = write_shard(tmp_path, 0, rows, output_schema("str"))
    log.append({"shard": 0, "file": name, "rows": 2, "bytes": size, "failed": 1, "failed_input": failed_input,
                "stats": {"prompts_completed": 1, "prompts_failed": 1}})
    log.close()
    state = load_state(out, 1, retry_failed=True)
    assert (state.done[0], state.shards_retried) == ((1, 0) if failed_input else (0, 1))


def test_the_jobs_last_check_names_the_missing_parts_and_the_shared_storage_rule(tmp_path):
    """The light sibling of tests/jobs/test_faults3_success.py (slow): what the job says instead of writing
    `_SUCCESS` when a committed part is not in the directory as the driver sees it (a part on another node's
    local disk), re-read from the directory itself; nothing when every part is there."""
    from types import SimpleNamespace

    from pipeline.generate.job import _incomplete_messages

    out = fs.resolve(str(tmp_path), "output_dir")
    log = AppendLog(out)
    files = []
    for index in range(2):
        name, size = write_shard(tmp_path, index, [row(index)], output_schema("str"))
        commit(log, index, name, size, rows=1)
        files.append(name)
    log.close()
    plan = SimpleNamespace(output=out, num_shards=2, output_dir=str(tmp_path))
    assert _incomplete_messages(plan) == []
    (tmp_path / files[1]).unlink()
    (message,) = _incomplete_messages(plan)
    assert f"1 of 2 shards have no committed part file in {tmp_path}" in message
    assert f"shard 1: {files[1]} is missing" in message and "storage that every node shares" in message
