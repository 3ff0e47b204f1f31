"""The online chooser of `method="auto"`: which exact configuration the next iteration runs.

No calibration phase: every iteration of every exact configuration samples the target's
conditional law, so the chooser learns on the real iterations of the job, whose tokens are all
kept (`wasted_seconds` is 0).

- Candidates: a small set within the bounds (autoregressive, speculative L=1..4, block L=2..4,
  spectr K in {2, 4} x L in {2, 3, 4}), trimmed to the `MAX_CANDIDATES` best by the prior
  (`spectr.planner.prior`: the one cost model on latencies guessed from parameter counts, at the
  acceptance measured so far, `DEFAULT_ACCEPTANCE` before any).
- Measurement: per occupancy bucket (the live rows, rounded to a power of two above 2) and
  configuration, the last `WINDOW` iterations' tokens and seconds; the measured tokens/s of the
  batch is their ratio of sums (robust to one slow iteration on a shared machine).
- Exploration: in a bucket, autoregressive is always measured (the baseline the choice must not
  lose to), then each candidate whose estimate reaches within `EXPLORE_SLACK` of the best
  measured rate is tried for `TRIAL` iterations, best estimate first. A candidate's estimate is
  its prior scaled by what it measured in the nearest other bucket (else by the median
  measured/prior ratio of this bucket): a new bucket, e.g. the batch draining at the end of a
  job, re-explores only what may win there.
- Exploitation: the best measured rate; the current choice is kept unless another beats it by
  `SWITCH_MARGIN` (no thrashing on noise). A bounded share (`RECHECK_SHARE`) of iterations
  re-measures the runner-up, so that drift (longer contexts, a different acceptance) is seen.
- Warm start: `state()` is a JSON-able summary (tokens and seconds per configuration per bucket,
  acceptance); `OnlineChooser(..., warm_state=state)` starts from it and explores only what it
  did not measure.

Not here: running iterations (`spectr.planner.batcher.AutoBatcher`), the cost model's formula
(`spectr.planner.predict`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from spectr.planner.prior import DEFAULT_ACCEPTANCE
from spectr.steps import AUTOREGRESSIVE, StepConfig, StepReport

WINDOW = 24  # iterations per (bucket, configuration) that make its measured rate
TRIAL = 4  # iterations a candidate is tried before it counts as measured
EXPLORE_SLACK = 0.15  # explore candidates whose estimate is within this of the best measured rate
SWITCH_MARGIN = 0.04  # another configuration must be measured this much faster to replace the current one
RECHECK_SHARE = 0.08  # at most this share of iterations re-measures the runner-up
RECHECK_LENGTH = 2  # iterations per recheck
MAX_CANDIDATES = 8  # candidates kept after trimming by the prior (autoregressive always)
STATE_VERSION = 1


def default_candidates(max_num_drafts: int, max_draft_length: int, greedy: bool = False,
                       speculative: bool = True) -> list[StepConfig]:
    """The candidate set within the bounds (see the module docstring); greedy: one-draft methods only."""
    found = [StepConfig.of(AUTOREGRESSIVE)]
    if not speculative or max_draft_length < 1:
        return found
    found += [StepConfig.of("speculative", 1, n) for n in range(1, min(4, max_draft_length) + 1)]
    found += [StepConfig.of("block", 1, n) for n in range(2, min(4, max_draft_length) + 1)]
    if not greedy:
        found += [StepConfig.of("spectr", k, n) for k in (2, 4) if k <= max_num_drafts
                  for n in range(2, min(4, max_draft_length) + 1)]
    return found


def bucket_of(rows: int) -> int:
    """Occupancy bucket: 1 and 2 exactly, then the nearest power of two."""
    return rows if rows <= 2 else 2 ** round(math.log2(rows))


@dataclass
class _Measured:
    """The recent iterations of one configuration in one bucket."""

    samples: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # (tokens, seconds)
    iterations: int = 0

    def add(self, tokens: float, seconds: float) -> None:
        self.samples.append((tokens, seconds))
        self.iterations += 1

    @property
    def rate(self) -> float:
        seconds = sum(s for _, s in self.samples)
        return sum(t for t, _ in self.samples) / seconds if seconds > 0 else 0.0

    @property
    def measured(self) -> bool:
        return len(self.samples) >= TRIAL


@dataclass(frozen=True)
class TimelinePoint:
    iteration: int
    seconds: float  # generation seconds since the chooser started, at the end of the iteration
    config: str
    rows: int
    tokens: int


class OnlineChooser:
    """Chooses each iteration's configuration from measured iterations; see the module docstring.

    prior(config, rows, acceptance) -> predicted tokens/s of the batch (`spectr.planner.prior`).
    """

    def __init__(self, candidates: Sequence[StepConfig], prior: Callable[[StepConfig, float, float], float], *,
                 warm_state: dict | None = None):
        self.prior = prior
        self.acceptance = [0, 0]  # accepted, tested draft positions over speculative iterations
        self.buckets: dict[int, dict[StepConfig, _Measured]] = {}
        self._tokens: dict[StepConfig, int] = {}
        self._seconds: dict[StepConfig, float] = {}
        self.timeline: list[TimelinePoint] = []
        self.iterations = 0
        self.elapsed = 0.0
        self._trial: tuple[StepConfig, int] | None = None  # (config, iterations left)
        self._since_recheck = 0
        self.current: StepConfig = StepConfig.of(AUTOREGRESSIVE)
        self.predicted_tokens_per_s = 0.0
        if warm_state:
            self._load(warm_state)
        self.candidates = self._trimmed(list(candidates))

    # -- what was learned ------------------------------------------------------------------------
    @property
    def acceptance_rate(self) -> float:
        accepted, tested = self.acceptance
        return accepted / tested if tested else DEFAULT_ACCEPTANCE

    @property
    def wasted_seconds(self) -> float:
        """Generation seconds whose tokens were not kept: none, every iteration's tokens are kept."""
        return 0.0

    def tokens_by_config(self) -> dict[str, int]:
        return {c.label: n for c, n in self._tokens.items()}

    def seconds_by_config(self) -> dict[str, float]:
        return {c.label: s for c, s in self._seconds.items()}

    def state(self) -> dict:
        """JSON-able summary for a warm start: per bucket and configuration, tokens, seconds, iterations."""
        buckets = {}
        for bucket, configs in self.buckets.items():
            buckets[str(bucket)] = {c.label: {"tokens": sum(t for t, _ in m.samples),
                                              "seconds": sum(s for _, s in m.samples), "iterations": len(m.samples)}
                                    for c, m in configs.items() if m.samples}
        return {"version": STATE_VERSION, "acceptance": {"accepted": self.acceptance[0], "tested": self.acceptance[1]},
                "buckets": buckets}

    def _load(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            return
        acceptance = state.get("acceptance", {})
        self.acceptance = [int(acceptance.get("accepted", 0)), int(acceptance.get("tested", 0))]
        for bucket, configs in state.get("buckets", {}).items():
            for label, entry in configs.items():
                count = int(entry["iterations"])
                if count <= 0:
                    continue
                measured = self._measured(int(bucket), StepConfig.parse(label))
                for _ in range(min(count, TRIAL)):  # a warm entry counts as measured, but new iterations soon dominate
                    measured.samples.append((entry["tokens"] / count, entry["seconds"] / count))

    def _trimmed(self, candidates: list[StepConfig]) -> list[StepConfig]:
        """Autoregressive and the best of the others by the prior at a full batch (and what warm state measured)."""
        rows = max([b for b in self.buckets] or [1])
        speculative = [c for c in candidates if c.speculative]
        speculative.sort(key=lambda c: -self.prior(c, rows, self.acceptance_rate))
        known = {c for configs in self.buckets.values() for c in configs}
        kept = speculative[: MAX_CANDIDATES - 1] + [c for c in speculative[MAX_CANDIDATES - 1:] if c in known]
        return [c for c in candidates if not c.speculative] + kept

    def _measured(self, bucket: int, config: StepConfig) -> _Measured:
        return self.buckets.setdefault(bucket, {}).setdefault(config, _Measured())

    # -- choosing ---------------------------------------------------------------------------------
    def estimate(self, config: StepConfig, rows: int) -> float:
        """Measured tokens/s in this bucket, else the prior scaled by what was measured elsewhere."""
        bucket = bucket_of(rows)
        here = self.buckets.get(bucket, {})
        if config in here and here[config].measured:
            return here[config].rate
        prior = self.prior(config, rows, self.acceptance_rate)
        others = sorted((abs(math.log2(b / bucket)), b) for b, configs in self.buckets.items()
                        if b != bucket and config in configs and configs[config].measured)
        if others:
            nearest = others[0][1]
            return prior * self.buckets[nearest][config].rate / self.prior(config, nearest, self.acceptance_rate)
        ratios = [m.rate / self.prior(c, rows, self.acceptance_rate) for c, m in here.items() if m.measured]
        return prior * statistics.median(ratios) if ratios else prior

    def choose(self, rows: int) -> StepConfig:
        """The configuration of the next iteration, with `rows` live rows."""
        if self._trial is not None:
            config, left = self._trial
            self._trial = (config, left - 1) if left > 1 else None
            return self._set(config, rows)
        bucket = self.buckets.setdefault(bucket_of(rows), {})
        to_try = self._to_explore(bucket, rows)
        if to_try is not None:
            self._trial = (to_try, TRIAL - 1) if TRIAL > 1 else None
            return self._set(to_try, rows)
        ranked = sorted(self.candidates, key=lambda c: -self.estimate(c, rows))
        best = ranked[0]
        if self.current in self.candidates and self.estimate(self.current, rows) * (1 + SWITCH_MARGIN) >= \
                self.estimate(best, rows):
            best = self.current
        self._since_recheck += 1
        if len(ranked) > 1 and self._since_recheck * RECHECK_SHARE >= RECHECK_LENGTH:
            self._since_recheck = 0
            runner_up = next(c for c in ranked if c != best)
            self._trial = (runner_up, RECHECK_LENGTH - 1) if RECHECK_LENGTH > 1 else None
            return self._set(runner_up, rows)
        return self._set(best, rows)

    def _to_explore(self, bucket: dict[StepConfig, _Measured], rows: int) -> StepConfig | None:
        """The unmeasured candidate with the best estimate that may beat the best measured rate."""
        baseline = next(c for c in self.candidates if not c.speculative)
        if not (baseline in bucket and bucket[baseline].measured):
            return baseline
        best = max(m.rate for c, m in bucket.items() if m.measured and c in self.candidates)
        open_ = [(self.estimate(c, rows), c) for c in self.candidates if not (c in bucket and bucket[c].measured)]
        open_ = [(e, c) for e, c in open_ if e >= (1 - EXPLORE_SLACK) * best]
        return max(open_, key=lambda ec: ec[0])[1] if open_ else None

    def _set(self, config: StepConfig, rows: int) -> StepConfig:
        self.current = config
        self.predicted_tokens_per_s = self.estimate(config, rows)
        return config

    # -- learning ---------------------------------------------------------------------------------
    def observe(self, report: StepReport) -> None:
        """One iteration's report (`ContinuousBatcher.last_step`)."""
        config = report.config
        self._measured(bucket_of(report.rows), config).add(report.tokens, report.seconds)
        if config.speculative:
            self.acceptance[0] += report.accepted
            self.acceptance[1] += report.tested
        self._tokens[config] = self._tokens.get(config, 0) + report.tokens
        self._seconds[config] = self._seconds.get(config, 0.0) + report.seconds
        self.iterations += 1
        self.elapsed += report.seconds + report.prefill_seconds
        self.timeline.append(TimelinePoint(self.iterations - 1, self.elapsed, config.label, report.rows, report.tokens))

    def describe(self) -> str:
        """`auto: speculative L=3 for 81% of tokens, block L=3 12%, autoregressive 7%`."""
        total = sum(self._tokens.values())
        if not total:
            return "auto: nothing generated yet"
        shares = sorted(self._tokens.items(), key=lambda kv: -kv[1])
        parts = [f"{c.label} {100 * n / total:.0f}%" for c, n in shares]
        first, share = shares[0]
        parts[0] = f"{first.label} for {100 * share / total:.0f}% of tokens"
        return "auto: " + ", ".join(parts)
