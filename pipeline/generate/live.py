"""Live MLflow metrics of a running generation job: time series with step = prompts completed.

    live = LiveMetrics(run, earlier_stats, ...)   # the driver, once generation starts
    live.shard_written(stats, worker)             # each shard result (from `_run_shards`' on_result)
    live.tick()                                   # while waiting (the scheduler's poll)
    live.stop()                                   # flush; the final point is `MlflowTracker.finish`'s

Each point holds the contract metrics `throughput_tokens_per_s`, `block_efficiency`, `acceptance_rate`,
`prompts_completed`, `generated_tokens`, and `target_calls`, `prompts_failed`, `acceptance_at_position_<i>`,
for the whole job so far (a resumed job's earlier shards included), computed by
`pipeline.generate.summary.progress_metrics`, the function the final values come from. A point is logged
when a shard arrives, at most every `mlflow.log_every_s` seconds, and, while no shard arrives, every
`HEARTBEAT_S` (30 s), so a chart moves even when shards are long (the step then repeats: MLflow's
wall-time axis shows the pace). The first point comes with this run's first shard. Each worker's
resource usage (`pipeline.generate.stats.ResourceMeter`) goes with the next point as `system/worker_<n>/<name>`, the peak over the interval.
The MLflow calls run on one background thread, so a slow tracking server never holds up generation; a
failed call is logged as a warning and the job goes on. At most `MAX_PENDING` calls wait for that thread:
past that (a server that is down, each call retried for minutes by MLflow's client) the oldest waiting
point is dropped, and counted (`dropped`): a later point holds the job's totals so far. `stop(timeout_s)`
waits at most `timeout_s` (`mlflow.shutdown_timeout_s`) for what is pending, then drops it; the thread is
a daemon, so a call that hangs keeps neither the job nor the process.

Not here: the run itself and the final metrics (`pipeline.generate.tracking`), the arithmetic
(`pipeline.generate.summary`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from pipeline.generate.stats import merge_stats
from pipeline.generate.summary import progress_metrics, total_stats

log = logging.getLogger("pipeline")

HEARTBEAT_S = 30.0  # a point at least this often, shard or not
MAX_PENDING = 32  # MLflow calls waiting for the background thread; beyond, the oldest is dropped


def worker_key(worker: dict[str, Any]) -> str:
    """One worker process: its host (or Ray node) and pid."""
    return f"{worker.get('node_id') or worker.get('host', '?')}:{worker.get('pid', '?')}"


def merge_usage(held: dict[str, float], usage: dict[str, float]) -> dict[str, float]:
    """Two shards' `ResourceMeter.usage()` of one worker: peaks and utilisations as the maximum."""
    merged = dict(held)
    for key, value in usage.items():
        merged[key] = max(merged.get(key, float(value)), float(value))
    return merged


class BoundedSender:
    """One daemon thread making calls in order; at most `limit` wait, the oldest dropped (and counted) past
    that. `drain(timeout_s)` waits for what was submitted; `close(timeout_s)` drains, then drops the rest."""

    def __init__(self, limit: int = MAX_PENDING, name: str = "mlflow-live"):
        self.limit = limit
        self.dropped = 0  # calls never made: dropped when the queue was full, or left at `close`
        self._pending: deque[tuple[Callable[[Any], None], Any]] = deque()
        self._busy = False
        self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, function: Callable[[Any], None], argument: Any) -> None:
        with self._changed:
            if self._closed:
                self.dropped += 1
                return
            if len(self._pending) >= self.limit:
                self._pending.popleft()
                self.dropped += 1
            self._pending.append((function, argument))
            self._changed.notify_all()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._pending and not self._closed:
                    self._changed.wait()
                if not self._pending:
                    return
                function, argument = self._pending.popleft()
                self._busy = True
            try:
                function(argument)
            finally:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every call submitted so far was made (True), or `timeout_s` passed (False)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._changed:
            while self._pending or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def close(self, timeout_s: float | None = None) -> int:
        """Drain for at most `timeout_s`, then stop taking calls; what still waits is dropped. Returns
        `dropped`. A call in progress is left to finish on the daemon thread, unwaited."""
        self.drain(timeout_s)
        with self._changed:
            self._closed = True
            self.dropped += len(self._pending)
            self._pending.clear()
            self._changed.notify_all()
        return self.dropped


class LiveMetrics:
    """The driver's live logger for one job (see the module docstring)."""

    def __init__(
        self,
        log_metrics: Callable[[list], None],
        earlier_stats: list[dict[str, Any]],
        earlier_generation_s: float | None,
        num_prompts: int,
        every_s: float,
        started: float,
        checkpoint: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        heartbeat_s: float = HEARTBEAT_S,
        on_plan: Callable[[str, dict | None], None] | None = None,
    ):
        """log_metrics: takes a list of `mlflow.entities.Metric` (run on the background thread);
        started: the `clock()` time generation started; checkpoint(generation seconds so far): called
        after each shard (the run file's record of time spent); on_plan(plan, choice): a new choice of the planner (its description, and its method, num_drafts, draft_length)
        (method="auto"), called on the background thread."""
        self._log_metrics = log_metrics
        self.total = total_stats(earlier_stats)
        self.this_run = total_stats([])
        self.earlier_generation_s = earlier_generation_s
        self.num_prompts = num_prompts
        self.every_s = every_s
        self.heartbeat_s = max(heartbeat_s, every_s)
        self.started = started
        self.checkpoint = checkpoint
        self.clock = clock
        self.last_logged = float("-inf")
        self.points = 0  # live points submitted
        self.workers: dict[str, int] = {}  # worker_key -> its number in the metric names
        self.pending_usage: dict[int, dict[str, float]] = {}
        self._background = BoundedSender()
        self._warned = False
        self.on_plan = on_plan
        self.plan = ""

    def shard_written(self, stats: dict[str, Any], worker: dict[str, Any] | None = None) -> None:
        merge_stats(self.total, stats)
        merge_stats(self.this_run, stats)
        if self.on_plan is not None and stats.get("plan") and stats["plan"] != self.plan:
            self.plan = stats["plan"]
            choice = stats.get("plan_choice")
            self._background.submit(functools.partial(self._call, lambda plan: self.on_plan(plan, choice)), self.plan)
        if worker is not None and stats.get("resources"):
            number = self.workers.setdefault(worker_key(worker), len(self.workers))
            self.pending_usage[number] = merge_usage(self.pending_usage.get(number, {}), stats["resources"])
        if self.checkpoint is not None:
            self.checkpoint(self.clock() - self.started)
        self._log_if(self.every_s)

    def tick(self) -> None:
        """While the driver waits: a point when `heartbeat_s` passed without one."""
        self._log_if(self.heartbeat_s)

    def _log_if(self, interval_s: float) -> None:
        now = self.clock()
        if (
            now - self.last_logged < interval_s
            or not self.this_run["prompts_completed"] + self.this_run["prompts_failed"]
        ):
            return  # too soon, or nothing of this run yet (no point at step 0 with zeros)
        self.last_logged = now
        done = self.total["prompts_completed"] + self.total["prompts_failed"]
        # the point at the end of the job is the final one (MlflowTracker.finish), not a live one
        metrics = self._usage_metrics() + ([] if done >= self.num_prompts else self._progress_metrics(now))
        if metrics:
            self.points += 1
            self._background.submit(self._send, metrics)

    def values(self, now: float | None = None) -> dict[str, float]:
        """The live metrics as of `now` (default: the clock's now)."""
        seconds = (self.clock() if now is None else now) - self.started
        return progress_metrics(self.total, self.this_run, seconds, self.earlier_generation_s)

    def _progress_metrics(self, now: float) -> list:
        from mlflow.entities import Metric

        stamp, step = int(time.time() * 1000), int(self.total["prompts_completed"])
        return [Metric(name, value, stamp, step) for name, value in self.values(now).items()]

    def _usage_metrics(self) -> list:
        from mlflow.entities import Metric

        stamp, step = int(time.time() * 1000), int(self.total["prompts_completed"])
        metrics = [
            Metric(f"system/worker_{number}/{name}", value, stamp, step)
            for number, usage in sorted(self.pending_usage.items())
            for name, value in sorted(usage.items())
            if name not in ("wall_s", "cpu_s")
        ]
        self.pending_usage = {}
        return metrics

    def _send(self, metrics: list) -> None:
        self._call(self._log_metrics, metrics)

    def _call(self, function: Callable[[Any], None], argument: Any) -> None:
        try:
            function(argument)
        except Exception as err:  # noqa: BLE001 - live metrics are best effort; the job goes on
            if not self._warned:
                log.warning("live MLflow metrics failed (%s: %s); the job goes on", type(err).__name__, err)
                self._warned = True

    @property
    def dropped(self) -> int:
        """Points (and planner tags) never sent: the queue was full, or `stop` gave up on them."""
        return self._background.dropped

    def flush(self) -> None:
        """Wait until every point submitted so far was sent (or failed)."""
        self._background.drain()

    def stop(self, timeout_s: float | None = None) -> int:
        """Send what is pending (worker usage), waiting at most `timeout_s` for the background thread; what
        it has not sent by then is dropped. Returns the points dropped in all (logged when any were)."""
        usage = self._usage_metrics()
        if usage:
            self._background.submit(self._send, usage)
        dropped = self._background.close(timeout_s)
        if dropped:
            log.warning(
                "mlflow: %d live metric point(s) dropped (the tracking server was slow or down); the final "
                "values are logged at the end", dropped,
            )  # fmt: skip
        return dropped


class NullLive:
    """`mlflow.enabled=false`: no live metrics."""

    def shard_written(self, stats: dict[str, Any], worker: dict[str, Any] | None = None) -> None:
        pass

    def tick(self) -> None:
        pass

    dropped = 0

    def stop(self, timeout_s: float | None = None) -> int:
        return 0
