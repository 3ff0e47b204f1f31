"""Progress of the generation job: batch-level counts from the actors, and the driver's progress bar.

Actors report rows as they finish (per batch step, per shard) to a small `ShardProgress` Ray actor (fire
and forget, through `BatchReporter`); the driver polls it while it waits for shards (`rows_in_flight`) and draws a tqdm bar
(`ProgressBar`) that moves row by row inside a shard. Progress is best effort: it never stops
generation.

Not here: scheduling (`pipeline.generate.scheduler`), statistics (`pipeline.generate.summary`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pipeline.generate.shards import Shard, ShardTask

PROGRESS_POLL_S = 0.5  # how often the driver reads the actors' batch-level progress while it waits


class ShardProgress:
    """Rows generated so far in each in-flight shard, reported as they finish by the actors (a Ray actor).

    The driver's progress bar reads it while it waits for shards, so a large shard moves the bar batch
    by batch rather than once at its end. A retried shard's count can overshoot (its first attempt's
    batches were reported too); `rows_in_flight` caps each shard at its length, and the bar is exact
    again when the shard's result arrives.
    """

    def __init__(self) -> None:
        self.rows: dict[int, int] = {}

    def add(self, shard_index: int, rows: int) -> None:
        self.rows[shard_index] = self.rows.get(shard_index, 0) + rows

    def forget(self, shard_index: int) -> None:
        self.rows.pop(shard_index, None)

    def snapshot(self) -> dict[int, int]:
        return dict(self.rows)


class BatchReporter:
    """`ShardGenerator`'s on_batch callback: one fire-and-forget call to the `ShardProgress` actor."""

    def __init__(self, progress: Any):
        self.progress = progress

    def __call__(self, shard_index: int, rows: int) -> None:
        self.progress.add.remote(shard_index, rows)


def rows_in_flight(snapshot: dict[int, int], shards: list[ShardTask] | list[Shard]) -> int:
    """Output rows generated so far in `shards` according to `snapshot`, each capped at its shard's output
    rows (prompts x samples)."""
    return sum(min(snapshot.get(shard.index, 0), getattr(shard, "output_rows", len(shard))) for shard in shards)


class ProgressBar:
    """The driver's tqdm bar over output rows (prompts x samples): whole shards as they are written, plus the
    rows in flight.

    It redraws only when the count changes (a log file gets a line per redraw), never goes back (a retried
    shard's overshoot waits for the count to catch up), and shows the run's tokens/s and block efficiency so
    far. `on_progress` (a test hook) sees every shown count.
    """

    def __init__(
        self,
        total: int,
        done: int,
        enabled: bool,
        on_progress: Callable[[int], None] | None = None,
    ):
        from tqdm import tqdm

        self.total = total
        self.written = done  # output rows in written shards
        self.on_progress = on_progress
        self.bar = tqdm(total=total, initial=done, unit="row", disable=not enabled, dynamic_ncols=True)
        self.started = time.perf_counter()
        self.tokens = 0
        self.calls = 0

    def show(self, in_flight: int = 0, redraw: bool = False) -> None:
        # never back: at a shard's commit its rows move from in flight to written, and the other shards' rows
        # in flight are only known again at the next poll
        shown = max(self.bar.n, min(self.written + in_flight, self.total))
        if shown == self.bar.n and not redraw:
            return  # nothing new since the last poll: no redraw (a log file gets a line per redraw)
        self.bar.n = shown
        self.bar.refresh()
        if self.on_progress:
            self.on_progress(shown)

    def shard_written(self, rows: int, stats: dict[str, Any]) -> None:
        self.tokens += stats["generated_tokens"]
        self.calls += stats["target_calls"]
        elapsed = time.perf_counter() - self.started
        self.bar.set_postfix(
            tok_per_s=f"{self.tokens / elapsed:.0f}" if elapsed > 0 else "-",
            block_eff=f"{self.tokens / self.calls:.2f}" if self.calls else "-",
            refresh=False,
        )
        self.written += rows
        self.show(redraw=True)

    def close(self) -> None:
        self.bar.close()
