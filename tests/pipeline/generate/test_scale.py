"""Part files sized for scale, without Ray: the default shard size, contiguous lanes of shards per actor,
re-cutting a scan's record offsets for a larger shard size, and the compacted commit log."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline import fs
from pipeline.config import DataConfig
from pipeline.generate.commit_log import AppendLog, compact_commit_log, read_commit_records
from pipeline.generate.scheduler import ShardQueue
from pipeline.generate.shards import MAX_PARTS, SHARD_GRANULE, auto_shard_size, num_shards, shard_task
from pipeline.prompts import ReadCache, read_rows
from pipeline.readers import scan_source
from pipeline.source import list_source, with_shard_size


def test_the_default_shard_size_gives_several_shards_on_small_jobs_and_bounded_parts_on_large_ones():
    for rows in (1, 40, 64, 1000, 10_000, 100_000, 1_000_000, 100_000_000):
        size = auto_shard_size(rows)
        assert size % SHARD_GRANULE == 0 and size >= SHARD_GRANULE
        assert num_shards(rows, size) <= MAX_PARTS
    assert num_shards(10_000, auto_shard_size(10_000)) >= 60  # several shards per actor
    assert num_shards(1_000_000, auto_shard_size(1_000_000)) <= 2000
    assert auto_shard_size(64) == 16  # small jobs cut as before (the old default)


def drain(queue: ShardQueue, lanes: int) -> list[list[int]]:
    """Each lane pops in turn (as actors ask for shards); the shards each lane got, in order."""
    got: list[list[int]] = [[] for _ in range(lanes)]
    while len(queue):
        for lane in range(lanes):
            task = queue.pop(lane=lane)
            if task is not None:
                got[lane].append(task.index)
    return got


def runs(indices: list[int]) -> int:
    """How many contiguous runs of shard indices (1: one contiguous range)."""
    return 1 + sum(1 for a, b in zip(indices, indices[1:]) if b != a + 1)


def test_shards_are_dealt_in_contiguous_lanes_and_an_idle_lane_takes_half_of_the_fullest():
    make = lambda index: shard_task(index, 1000, 10)  # noqa: E731
    queue = ShardQueue(np.arange(100), make)
    queue.deal(4)
    got = drain(queue, 4)
    assert sorted(i for lane in got for i in lane) == list(range(100))
    assert [runs(lane) for lane in got] == [1, 1, 1, 1] and got[1][0] == 25
    undealt = drain(ShardQueue(np.arange(100), make), 4)  # negative control: round-robin
    assert all(runs(lane) == 25 for lane in undealt)
    queue = ShardQueue(np.arange(20), make)
    queue.deal(2)
    first = [queue.pop(lane=0).index for _ in range(10)]  # lane 0 is done ...
    stolen = queue.pop(lane=0).index  # ... and takes the second half of lane 1 (still untouched)
    assert first == list(range(10)) and stolen == 15 and queue.pop(lane=1).index == 10


def test_a_larger_shard_size_re_cuts_the_scans_offsets_like_a_scan_at_that_size(tmp_path):
    for k, count in enumerate((37, 150)):  # two files: the second starts mid-shard
        with open(tmp_path / f"p{k}.jsonl", "w") as f:
            for i in range(count):
                f.write(json.dumps({"id": f"f{k}r{i}", "prompt": "x " * (i % 7 + 1)}) + "\n")
    data = DataConfig(path=str(tmp_path), id_column="id")
    listing = list_source(data)
    direct = scan_source(data, listing, 48)
    recut = with_shard_size(scan_source(data, listing, SHARD_GRANULE), 48)
    assert [f.offsets.tolist() for f in recut.files] == [f.offsets.tolist() for f in direct.files]
    for start in range(0, direct.num_rows, 48):
        stop = min(start + 48, direct.num_rows)
        assert read_rows(recut, start, stop).ids == read_rows(direct, start, stop).ids
    with pytest.raises(ValueError, match="not a multiple"):
        with_shard_size(direct, 50)


def test_resume_reads_a_compacted_commit_log(tmp_path):
    """Three runs each commit every shard again: compacting keeps one record per shard (the last), so the
    log a resume reads is bounded by the shard count; what it says is unchanged."""
    out = fs.resolve(str(tmp_path), "output_dir")
    log = AppendLog(out)
    for run in range(3):
        for shard in range(50):
            log.append({"shard": shard, "file": f"part-{shard:06d}-r{run}.parquet", "rows": 4, "bytes": 9, "run": run})
    log.close()
    before = {r["shard"]: r for r in read_commit_records(out)}
    size = (tmp_path / "_commits.jsonl").stat().st_size
    assert compact_commit_log(out) == 100  # records dropped
    after = list(read_commit_records(out))
    assert len(after) == 50 and {r["shard"]: r for r in after} == before
    assert (tmp_path / "_commits.jsonl").stat().st_size * 3 == pytest.approx(size, rel=0.01)
    assert compact_commit_log(out) == 0  # nothing to drop: not rewritten


class CountingCache(ReadCache):
    """A worker's real read cache that counts the Parquet row groups it reads from the file."""

    def __init__(self) -> None:
        super().__init__()
        self.groups_read = 0

    def row_group(self, uri, parquet, group, columns):
        self.groups_read += ("group", uri, group, tuple(columns)) not in self._items
        return super().row_group(uri, parquet, group, columns)


def test_actors_dealt_contiguous_lanes_read_each_row_group_about_once(tmp_path):
    """A Parquet input of 8 row groups, 32 shards of 5 rows, 2 actors each with its own read cache (as a
    worker keeps one): dealt in lanes, the two actors read 8 row groups in all (N actors x the input
    before: the round-robin negative control reads every group on both actors)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": f"r{i}", "prompt": "x " * (i % 5 + 1)} for i in range(160)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet", row_group_size=20)
    config = DataConfig(path=str(tmp_path / "p.parquet"), id_column="id")
    source = scan_source(config, list_source(config), 5)
    reads = {}
    for dealt in (True, False):
        queue = ShardQueue(np.arange(32), lambda index: shard_task(index, source.num_rows, 5))
        if dealt:
            queue.deal(2)
        caches = [CountingCache(), CountingCache()]
        ids = []
        for lane, shards in enumerate(drain(queue, 2)):
            for index in shards:
                task = shard_task(index, source.num_rows, 5)
                ids += read_rows(source, task.start, task.stop, caches[lane]).ids
        assert sorted(ids) == sorted(r["id"] for r in rows)
        reads[dealt] = sum(cache.groups_read for cache in caches)
    assert reads == {True: 8, False: 16}
