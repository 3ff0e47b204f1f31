"""The driver's progress bar (`pipeline.generate.progress.ProgressBar`) never goes back.

Driven as the scheduler drives it: polls of the rows in flight, then shard commits, whose rows move from in
flight to written while the other shards' rows in flight are only known again at the next poll.
"""

from __future__ import annotations

from pipeline.generate.progress import ProgressBar, rows_in_flight
from pipeline.generate.shards import Shard


def stats(tokens: int = 10, calls: int = 5) -> dict:
    return {"generated_tokens": tokens, "target_calls": calls}


def test_the_shown_count_never_decreases_through_shard_commits():
    shown: list[int] = []
    bar = ProgressBar(total=32, done=0, enabled=False, on_progress=shown.append)
    bar.show(in_flight=7 + 5)  # shard A: 7 of 8 rows, shard B: 5 of 8
    bar.shard_written(8, stats())  # A commits: written 8, B's 5 unknown until the next poll
    bar.show(in_flight=6)  # B: 6
    bar.show(in_flight=8 + 1)  # B done, C starts
    bar.shard_written(8, stats())  # B commits
    bar.shard_written(8, stats())  # C commits early (its rows were 1 in flight)
    bar.show(in_flight=0)
    bar.shard_written(8, stats())
    bar.close()
    assert shown == sorted(shown) and shown[-1] == 32, shown
    assert shown[0] == 12 and 8 not in shown  # the commit did not drop the bar to 8


def test_control_the_unguarded_count_would_have_gone_back():
    """Without the guard the count shown at A's commit is written alone (8), below the 12 shown before it."""
    bar = ProgressBar(total=32, done=0, enabled=False)
    bar.show(in_flight=12)
    assert min(bar.written + 8, bar.total) == 8 < bar.bar.n  # what the commit alone would show
    bar.close()


def test_rows_in_flight_caps_each_shard_at_its_length():
    shards = [Shard(index=i, ids=list(range(4)), prompts=["p"] * 4, prompt_token_ids=[[1]] * 4, seeds=[0] * 4)
              for i in range(2)]
    assert rows_in_flight({0: 9, 1: 2}, shards) == 4 + 2
