"""The shard predictor, called directly (no Ray): contract rows, per-row failures, batch independence.
(Its continuous batch across shards: test_feed.py.)"""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.config import ModelConfig
from pipeline.generate.config import SpectrConfig
from pipeline.generate.feed import ShardFeed
from pipeline.generate.shards import cut_shards
from pipeline.generate.worker import ShardGenerator
from pipeline.models import load_tokenizer, tokenize

PROMPTS = ["def x", "return the value", "for item in list", "import data", "class self", "if x is none"]


@pytest.fixture(scope="module")
def generator(tiny_pair):
    model = ModelConfig(target=str(tiny_pair["target"]), draft=str(tiny_pair["draft"]))
    spectr = SpectrConfig(method="spectr", num_drafts=2, draft_length=3, max_new_tokens=10, batch_size=4, seed=0)
    return ShardGenerator(model, spectr, num_threads=1)


def shard_of(tiny_pair, prompts, seed=0):
    tokenizer = load_tokenizer(tiny_pair["target"], "model.target", False)
    token_ids = tokenize(tokenizer, prompts, add_special_tokens=True)
    return cut_shards([f"id{i}" for i in range(len(prompts))], prompts, token_ids, 100, seed)[0]


def test_rows_follow_the_contract(generator, tiny_pair):
    shard = shard_of(tiny_pair, PROMPTS)
    result = generator(shard)
    assert result.index == 0 and [r["id"] for r in result.rows] == shard.ids
    for r, prompt, seed in zip(result.rows, PROMPTS, shard.seeds):
        assert r["prompt"] == prompt and r["seed"] == seed and r["error"] is None
        assert r["finish_reason"] in ("stop", "length")
        assert r["completion_tokens"] == len(r["completion_token_ids"]) <= 10
        assert r["finish_reason"] == "stop" or r["completion_tokens"] == 10
        assert r["block_efficiency"] == pytest.approx(r["completion_tokens"] / r["target_calls"])
        assert r["completion"] == generator.tokenizer.decode(
            r["completion_token_ids"], skip_special_tokens=True
        )
    stats = result.stats
    assert stats["generated_tokens"] == sum(r["completion_tokens"] for r in result.rows)
    assert stats["target_calls"] == sum(r["target_calls"] for r in result.rows)
    assert stats["prompts_completed"] == 6 and stats["prompts_failed"] == 0
    assert len(stats["accepted_per_position"]) == 3 and stats["tested_positions"] >= sum(
        stats["accepted_per_position"]
    )


def test_a_failing_row_does_not_sink_its_batch(tiny_pair):
    model = ModelConfig(target=str(tiny_pair["target"]), draft=str(tiny_pair["draft"]))
    greedy = SpectrConfig(method="spectr", num_drafts=2, draft_length=3, max_new_tokens=10, temperature=0.0, batch_size=8)
    generator = ShardGenerator(model, greedy, num_threads=1)
    too_long = " ".join(["x"] * 60)  # 61 tokens + 10 new > the tiny model's 64 positions
    result = generator(shard_of(tiny_pair, PROMPTS[:3] + [too_long] + PROMPTS[3:]))
    bad = result.rows[3]
    assert bad["finish_reason"] == "error" and bad["completion_token_ids"] == [] and bad["target_calls"] == 0
    assert "ValueError" in bad["error"] and "exceeds" in bad["error"] and bad["prompt_tokens"] == 61
    assert result.stats["prompts_failed"] == 1 and result.stats["prompts_completed"] == 6
    good = [r for r in result.rows if r["error"] is None]
    alone = generator(shard_of(tiny_pair, PROMPTS)).rows  # the same rows without the bad one
    assert [r["completion_token_ids"] for r in good] == [r["completion_token_ids"] for r in alone]


def test_rows_do_not_depend_on_batch_size(tiny_pair, generator):
    shard = shard_of(tiny_pair, PROMPTS)
    one_by_one = ShardGenerator.__new__(ShardGenerator)
    one_by_one.__dict__.update(generator.__dict__)
    one_by_one.spectr = dataclasses.replace(generator.spectr, batch_size=1)
    one_by_one.feed = ShardFeed(generator.target, generator.draft, one_by_one.spectr, generator.eos_token_id)
    assert [r["completion_token_ids"] for r in generator(shard).rows] == [
        r["completion_token_ids"] for r in one_by_one(shard).rows
    ]


def test_finished_rows_are_reported_and_a_failing_report_changes_nothing(tiny_pair, generator):
    """on_batch(shard index, rows) as rows finish (the driver's progress bar), every row once; a report
    that raises is logged, and the shard's rows come out the same."""
    shard = shard_of(tiny_pair, PROMPTS)  # 6 prompts, batch_size 4
    reports = []
    generator.on_batch = lambda index, rows: reports.append((index, rows))
    try:
        def untimed(rows):  # time_taken_s is a measurement, not part of what must come out the same
            return [{k: v for k, v in row.items() if k != "time_taken_s"} for row in rows]

        expected = untimed(generator(shard).rows)
        assert {index for index, _ in reports} == {0} and sum(rows for _, rows in reports) == 6
        assert len(reports) >= 2  # rows finish at different iterations (budget 10, EOS), not all at the end

        def broken(index, rows):
            raise ConnectionError("progress actor gone")

        generator.on_batch = broken
        assert untimed(generator(shard).rows) == expected
    finally:
        generator.on_batch = None


def test_progress_counts_cap_each_shard_at_its_length():
    from pipeline.generate.progress import ShardProgress, rows_in_flight

    progress = ShardProgress()
    progress.add(3, 4)
    progress.add(3, 4)
    progress.add(4, 2)
    progress.add(3, 4)  # a retried shard's batches, reported again
    shards = {s.index: s for s in cut_shards([f"i{k}" for k in range(40)], ["p"] * 40, [[1]] * 40, 8, 0)}
    assert rows_in_flight(progress.snapshot(), [shards[3], shards[4]]) == 8 + 2
    progress.forget(3)
    assert progress.snapshot() == {4: 2}
