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
