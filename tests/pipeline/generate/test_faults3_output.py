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
