"""Shards are row ranges cut in row order; a row's seed depends only on the job seed and its id."""

from __future__ import annotations

import pytest

from pipeline.generate.shards import cut_shards, num_shards, row_seed, shard_task


def test_fixed_shards_in_row_order():
    ids = list(range(10))
    shards = cut_shards(ids, [str(i) for i in ids], [[i] for i in ids], shard_size=4, base_seed=0)
    assert [s.index for s in shards] == [0, 1, 2] and num_shards(10, 4) == 3
    assert [s.ids for s in shards] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [t for s in shards for t in s.prompt_token_ids] == [[i] for i in ids]
    tasks = [shard_task(i, 10, 4) for i in range(3)]
    assert [(t.start, t.stop, len(t)) for t in tasks] == [(0, 4, 4), (4, 8, 4), (8, 10, 2)]


def test_seed_is_stable_across_shardings_and_distinct_per_row():
    ids = [f"row{i}" for i in range(50)]
    by_4 = [seed for s in cut_shards(ids, ids, [[0]] * 50, 4, base_seed=7) for seed in s.seeds]
    by_9 = [seed for s in cut_shards(ids, ids, [[0]] * 50, 9, base_seed=7) for seed in s.seeds]
    assert by_4 == by_9 == [row_seed(7, i) for i in ids]
    assert len(set(by_4)) == 50 and all(0 <= s < 2**63 for s in by_4)
    assert row_seed(8, "row0") != row_seed(7, "row0")
    assert row_seed(7, 5) != row_seed(7, "5")


def test_mismatched_lengths():
    with pytest.raises(ValueError, match="same length"):
        cut_shards([1, 2], ["a"], [[1], [2]], 1, 0)
