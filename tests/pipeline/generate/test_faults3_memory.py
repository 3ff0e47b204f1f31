"""Memory (issue #52, item 1), in the actor's feed without Ray: one long row costs its row, not the pool.

- `spectr.max_row_tokens`: a row whose prompt + max_tokens exceeds it is an error row counted as an input
  failure, and the pool is never sized for it (before: one long row sized the whole pool, batch x its
  positions).
- A pool grown for one long row that does not fit in memory: injected from outside the code under test, by
  an engine batcher class whose allocation raises torch's OutOfMemoryError above 32 positions. The row that
  needs it fails alone (an input failure), the pool is rebuilt at its former size and the shard's other rows
  are generated (before: the shard that held the turn failed, its neighbours were stopped, and every retry
  did the same).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_feed import alone, generator_for, prompts_of, shards_of

import spectr


def test_a_row_over_max_row_tokens_is_an_input_failure_and_never_sizes_the_pool(tiny_pair):
    generator = generator_for(tiny_pair, batch_size=4)
    generator.feed.spectr = dataclasses.replace(generator.feed.spectr, max_row_tokens=24)
    shard = shards_of(tiny_pair, prompts_of(4, seed=3), 4, [2, 2, 40, 2])[0]
    result = generator(shard)
    errors = [row["error"] for row in result.rows]
    assert [i for i, e in enumerate(errors) if e] == [2] and "over spectr.max_row_tokens=24" in errors[2]
    assert result.failed == result.failed_input == 1
    assert generator.feed.allocations == 1 and generator.feed.batcher.max_length <= 24
    for i in (0, 1, 3):
        assert result.rows[i]["completion_token_ids"] == alone(generator, shard, i, 2)


class SmallMemoryBatcher(spectr.ContinuousBatcher):
    """The engine's batcher on a device with room for 32 positions per row, no more."""

    def __init__(self, *args, max_length, **kwargs):
        if max_length > 32:
            raise torch.OutOfMemoryError(f"out of memory: a pool of {max_length} positions per row (injected)")
        super().__init__(*args, max_length=max_length, **kwargs)


@pytest.mark.parametrize("injected", [True, False])  # False: the control, where the pool fits
def test_a_grown_pool_that_does_not_fit_fails_only_the_row_that_needs_it(tiny_pair, monkeypatch, injected):
    if injected:
        monkeypatch.setattr(spectr, "ContinuousBatcher", SmallMemoryBatcher)
    generator = generator_for(tiny_pair, batch_size=4)
    first, second = shards_of(tiny_pair, prompts_of(8, seed=8), 4, [2] * 4 + [2, 2, 40, 2])
    generator(first)
    result = generator(second)
    errors = [row["error"] for row in result.rows]
    if injected:
        assert [i for i, e in enumerate(errors) if e] == [2] and "does not fit in memory" in errors[2]
        assert result.failed == result.failed_input == 1 and generator.feed.batcher.max_length <= 32
    else:
        assert errors == [None] * 4 and generator.feed.batcher.max_length > 32
    for i in (0, 1, 3):
        assert result.rows[i]["completion_token_ids"] == alone(generator, second, i, 2)


# --- on CUDA: rows admitted against the GPU's free memory (pipeline.generate.memory), the values injected ---


def test_memory_row_cap_is_the_largest_pool_capacity_that_fits():
    """The pool is batch x (capacity + tree + 2) x KV bytes: the cap is the largest power of two whose pool fits in
    free - 10% of total; None when the models' every position fits; 0 when nothing does."""
    from pipeline.generate.memory import memory_row_cap

    kv, batch, tree, total = 1000, 4, 16, 10**9
    budget = lambda capacity: total // 10 + batch * (capacity + tree + 2) * kv  # noqa: E731 - free bytes exactly fitting
    assert memory_row_cap(budget(64), total, kv, batch, tree, model_positions=4096) == 64
    assert memory_row_cap(budget(64) - 1, total, kv, batch, tree, model_positions=4096) == 32
    assert memory_row_cap(budget(127), total, kv, batch, tree, model_positions=4096) == 64  # capacities: powers of 2
    assert memory_row_cap(budget(100), total, kv, batch, tree, model_positions=100) is None  # every row fits
    assert memory_row_cap(budget(99), total, kv, batch, tree, model_positions=100) == 64
    assert memory_row_cap(budget(1), total, kv, batch, tree, model_positions=4096) == 0  # no row fits
    assert memory_row_cap(budget(1024), total, kv, batch, tree) == 1024  # the models declare no limit
    assert memory_row_cap(budget(64), total, kv, batch * 2, tree, model_positions=4096) == 16  # twice the rows


def test_kv_bytes_per_position_is_what_the_engine_allocates(tiny_pair):
    """kv_bytes_per_position of both models x slots x positions is the pool the engine's batcher really holds."""
    from pipeline.generate.memory import kv_bytes_per_position

    generator = generator_for(tiny_pair, batch_size=4)
    batcher = spectr.ContinuousBatcher(generator.target, generator.draft, batch_size=4, max_length=32,
                                       method="spectr", num_drafts=2, draft_length=3)
    batcher.admit([[3, 4, 5]], max_new_tokens=2)
    batcher.step()  # the buffers are allocated at the first forward
    tree = 2 * 3
    held = batcher.target_cache.rows.nbytes + batcher.rows.drafter.cache.rows.nbytes  # buffers + lengths
    lengths = 2 * 4 * 8  # two [B] int64 lengths
    kv = kv_bytes_per_position(generator.target), kv_bytes_per_position(generator.draft)
    assert held - lengths == 4 * (32 + 1 + tree) * kv[0] + 4 * (32 + 2 + tree) * kv[1]


@pytest.mark.parametrize("free_for", [32, None])  # None: the control, a GPU with room for every row
def test_a_row_that_can_never_fit_the_gpu_is_an_error_row_of_its_shard(tiny_pair, free_for):
    """An actor told by mem_get_info (injected) that its GPU holds a pool of 32 positions per row: the row that
    needs 40+ is an error row naming the memory (an input failure: its shard is not charged, a rerun does not
    redo it), the pool is never sized for it, and the shard's other rows are generated."""
    from pipeline.generate.memory import HEADROOM, kv_bytes_per_position

    generator = generator_for(tiny_pair, batch_size=4)
    kv = kv_bytes_per_position(generator.target) + kv_bytes_per_position(generator.draft)
    tree = generator.spectr.num_drafts * generator.spectr.draft_length
    total = 8 * 2**30
    free = math.ceil(HEADROOM * total) + 4 * ((free_for or 64) + tree + 2) * kv
    generator.device_memory(free, total)
    assert generator.memory_cap == free_for
    shard = shards_of(tiny_pair, prompts_of(4, seed=3), 4, [2, 2, 40, 2])[0]
    result = generator(shard)
    errors = [row["error"] for row in result.rows]
    if free_for:
        assert [i for i, e in enumerate(errors) if e] == [2] and "MemoryError" in errors[2]
        assert "GiB free on the actor's GPU" in errors[2] and "rows of at most 32 positions fit" in errors[2]
        assert result.failed == result.failed_input == 1 and generator.feed.batcher.max_length <= 32
    else:
        assert errors == [None] * 4 and result.failed == 0
    for i in (0, 1, 3):
        assert result.rows[i]["completion_token_ids"] == alone(generator, shard, i, 2)


def test_rows_the_engine_refuses_are_input_failures_of_their_shard(tiny_pair):
    """The light sibling of tests/jobs/test_faults3_rows.py (slow): an empty prompt and one over the model's 64
    positions, refused by the engine at admission, are error rows counted as the input's failures (a rerun does
    not redo them: test_faults3_output.py), and the shard's other rows are generated."""
    from pipeline.generate.shards import cut_shards

    generator = generator_for(tiny_pair, batch_size=4)
    prompts = ["the data", "", " ".join(["the"] * 70), "a value"]
    tokens = [[5, 6], [], [5] * 70, [7, 8]]  # a tokenizer without BOS gives an empty prompt no token
    shard = cut_shards([f"r{i}" for i in range(4)], prompts, tokens, 4, 0, [2, 2, 2, 2])[0]
    result = generator(shard)
    errors = [row["error"] for row in result.rows]
    assert [i for i, e in enumerate(errors) if e] == [1, 2]
    assert "empty" in errors[1] and "positions" in errors[2]
    assert result.failed == result.failed_input == 2
    for i in (0, 3):
        assert result.rows[i]["completion_token_ids"] == alone(generator, shard, i, 2)
