"""A late writer of a killed earlier run never replaces a committed part (issue #40 finding 5).

Run A was killed while one of its actors was writing shard 1 (its first attempt at a shard no run had listed:
attempt 0, named for A's run). This job (run B) generates shard 1 again and commits it; then A's part lands,
written as A's worker writes a part (`write_shard` with the fence of A's task: `ShardTask.fence`), with every
completion marked LATE. Parts carry their run's tag, so it lands beside B's instead of over it; B's cleanup
(before `_SUCCESS`) removes every part the commit log does not name, so `read_output` and a plain
`pyarrow.dataset` over the folder read every id once and none of A's rows. Before the fix a first attempt
was `part-000001.parquet` in every run, and A's part replaced the committed one.

On the session's real local Ray with the tiny pair; the late write is made by the driver's hook right after
shard 1's commit (Ray kills a killed driver's actors, so the late writer here is simulated where it lands).

The window left is narrower still: a worker checks, right before it writes a part, that its job still holds
the directory's lease, so a late writer whose job lost it writes nothing (the second test, on a worker).
"""

from __future__ import annotations

import json

import pyarrow.dataset as ds
import pyarrow.parquet as pq
from tiny_pair_support import job_config

from pipeline import fs
from pipeline.generate import output
from pipeline.generate.config import from_dict
from pipeline.generate.job import run_generate
from pipeline.generate.manifest import load_manifest
from pipeline.generate.reader import committed_files, read_output
from pipeline.generate.scheduler import RunHooks
from pipeline.generate.shards import ShardTask


def test_a_late_writer_of_a_killed_earlier_run_never_replaces_a_committed_part(
    tiny_pair, prompts_jsonl, tmp_path, ray_local
):
    out = tmp_path / "out"
    raw = job_config(tiny_pair, prompts_jsonl, out, shard_size=20,
                     **{"spectr.max_new_tokens": 4, "ray.num_actors": 1})  # fmt: skip
    late: dict[str, str] = {}

    def on_shard_written(result):  # shard 1 is committed (its record is in the log): A's part lands now
        if result.index != 1:
            return
        location = fs.resolve(str(out), "output_dir")
        run_a = ShardTask(1, 20, 40, attempt=0, run="0a0a0a0a", fresh=True)  # what A's plan sent its worker
        rows = pq.read_table(out / result.file).to_pylist()
        marked = [dict(row, completion="LATE " + (row["completion"] or "")) for row in rows]
        schema = pq.read_schema(out / result.file)
        late["name"], _ = output.write_shard(location, 1, marked, schema, load_manifest(location).part_digits,
                                             run_a.fence)  # fmt: skip
        late["committed"] = result.file

    report = run_generate(from_dict(raw), RunHooks(on_shard_written=on_shard_written))
    assert report.exit_code == 0 and (out / "_SUCCESS").exists() and late
    assert late["name"] != late["committed"]  # the run's tag: another name than the committed part's
    ids = [json.loads(line)["id"] for line in prompts_jsonl.read_text().splitlines()]
    committed = {index: record["file"] for index, record in committed_files(out).items()}
    assert sorted(p.name for p in out.glob("part-*")) == sorted(committed.values())  # A's part removed
    for table in (read_output(out), ds.dataset(str(out), format="parquet").to_table()):
        assert sorted(table.column("id").to_pylist()) == sorted(ids)  # every id once
        assert not any(c.startswith("LATE") for c in table.column("completion").to_pylist() if c)


def test_a_worker_of_a_job_that_lost_the_directory_writes_no_part(tiny_pair, prompts_jsonl, tmp_path):
    """The narrower window: a worker checks the lease right before it writes (`check_holder`), so a late writer
    whose job no longer holds the directory (here: another job's lease is on it) writes nothing at all, even
    after that job's `_SUCCESS`. The control: the same shard with the holder's own token is written."""
    import pytest

    from pipeline.generate.lease import Lease, LeaseLostError
    from pipeline.generate.output import output_schema
    from pipeline.generate.plan import prepare
    from pipeline.generate.worker import ShardGenerator, WorkerJob

    out = tmp_path / "out"
    plan = prepare(from_dict(job_config(tiny_pair, prompts_jsonl, out, shard_size=20,
                                        **{"spectr.max_new_tokens": 2})))  # fmt: skip
    out.mkdir()
    generator = ShardGenerator(plan.config.model, plan.config.spectr, num_threads=1)
    with Lease.acquire(fs.resolve(str(out), "output_dir"), timeout_s=60) as holder:  # another job's lease
        job = WorkerJob(plan.config.data, plan.source, str(out), 6, output_schema(plan.id_kind))
        generator.job = WorkerJob(**{**job.__dict__, "lease_token": "a-killed-run"})
        with pytest.raises(LeaseLostError, match="no longer held by the job that sent this shard"):
            generator.generate_shard(plan.shard(1))
        assert not list(out.glob("part-*"))
        generator.job = WorkerJob(**{**job.__dict__, "lease_token": holder.holder.token})
        assert (out / generator.generate_shard(plan.shard(1)).file).exists()
