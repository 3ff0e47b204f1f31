"""The online chooser of `method="auto"`: which exact configuration the next iteration runs.

No calibration phase: every iteration of every exact configuration samples the target's
conditional law, so the chooser learns on the real iterations of the job, whose tokens are all
kept (`wasted_seconds` is 0).

- Candidates: a small set within the bounds (autoregressive, speculative L=1, block L=2..4,
  spectr K in {2, 4} x L in {2, 3, 4}, traversal K in {2, 4} at the longest L (3 or 4); speculative L >= 2
  is left out because block L
  dominates it: same draft, same verify, at least as many tokens), trimmed to the `MAX_CANDIDATES` best by
  the prior (`spectr.planner.prior`: the one cost model on latencies guessed from parameter counts).
- Measurement: an iteration's rate is (live rows x tokens per row) / seconds, and the two factors
  are measured apart, because their noise differs:
  - seconds per iteration: per occupancy bucket (the live rows, rounded to a power of two above 2)
    and configuration, over its last `WINDOW` iterations (the first iteration of a configuration in
    a bucket warms up new shapes and is not measured, nor is one that paid the draft's catch-up
    after autoregressive iterations: `observe(..., measure=False)`);
  - tokens per row per iteration: per configuration over every bucket (acceptance does not depend
    on occupancy), shrunk toward the model `sum(reach(config, acceptance))` times the measured/model
    ratio of its method (speculative and block pooled: one draft), with the weight of `PSEUDO_ROWS`
    row-iterations. At batch 1 one iteration's tokens are a single draw of 1 to L + 1: a short trial measured by its own tokens
    is decided by luck, while its seconds are steady.
- Estimates of what is not measured in a bucket: the same tokens per row over the prior's seconds
  per iteration, scaled by measured/prior seconds of the same configuration in the nearest other
  bucket, else of its nearest measured kin here (same family: autoregressive, one draft, several
  drafts; nearest K and L), else of the median speculative one.
- Exploration: autoregressive (the baseline the choice must not lose to) and, until
  `COLD_EXPLORE` speculative candidates have been measured, the best-estimated speculative one are
  tried for `TRIAL` measured iterations each whatever the prior says; after that, in any bucket,
  each unmeasured candidate whose estimate reaches within `EXPLORE_SLACK` of the best (measured
  rate, else estimate) is tried, best estimate first: a new bucket, e.g. the batch draining at the
  end of a job, re-explores only what may win there. A bucket with nothing left worth a trial
  looks again after `REEXPLORE_EVERY` iterations (the acceptance measured meanwhile moves the
  estimates).
- Exploitation: the best measured rate; the current choice is kept unless another beats it by
  `SWITCH_MARGIN` (no thrashing on noise). At most a share `RECHECK_SHARE` of iterations
  re-measures the rival most likely to have been under-measured (highest rate x (1 + 1/sqrt(n)),
  among those whose optimistic rate reaches the best's), so that noise in a short trial and drift
  (longer contexts, another acceptance) are corrected while clearly slower rivals cost nothing.
- Warm start: `state()` is a JSON-able summary (seconds and rows per configuration per bucket,
  tokens per configuration, acceptance); `OnlineChooser(..., warm_state=state)` starts from it and
  explores only what it did not measure. Warm seconds are kept apart from this process's windows and
  read as *relative* costs: each is scaled by this process's speed, the median over the
  configurations measured here of (seconds here / warm seconds), same bucket first (1 until one is
  measured). Whole processes on a shared machine run at visibly different speeds, so warm seconds taken as they
  are make every configuration run here look slower than the ones still carried from the faster
  earlier process, and the chooser wandered through all of them; scaled, the earlier job's ranking
  stands until this process measures otherwise (warm rivals are rechecked like measured ones).

Per iteration it costs a few dict lookups and sums over at most a few dozen entries (priors are
cached): no device read, nothing on the engine's hot path. Not here: running iterations
(`spectr.planner.batcher.AutoBatcher`), the cost model's formula (`spectr.planner.predict`).

Measurements (whole jobs and one process against every fixed configuration, the offline replay that set
the constants): docs/performance.md#the-planner-methodauto.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from spectr.planner.prior import DEFAULT_ACCEPTANCE, reach
from spectr.steps import AUTOREGRESSIVE, SINGLE_DRAFT, StepConfig, StepReport

WINDOW = 24  # iterations per (bucket, configuration) that make its seconds per iteration
TRIAL = 4  # measured iterations a candidate is tried before it counts as measured
EXPLORE_SLACK = 0.25  # explore candidates whose estimate is within this of the best measured rate
COLD_EXPLORE = 4  # speculative candidates tried (best estimate first) before estimates may stop exploring
SWITCH_MARGIN = 0.04  # another configuration must be measured this much faster to replace the current one
RECHECK_SHARE = 0.05  # at most this share of iterations re-measures a rival
RECHECK_LENGTH = 2  # iterations per recheck
MAX_CANDIDATES = 14  # candidates kept after trimming by the prior (autoregressive always)
REEXPLORE_EVERY = 64  # iterations after which a bucket looks again for candidates worth a trial
PSEUDO_ROWS = 16  # row-iterations of weight the model's tokens per row get against a configuration's own
TOKEN_MEMORY = 4096  # row-iterations of tokens kept per configuration (older ones fade by halves)
STATE_VERSION = 2


def default_candidates(max_num_drafts: int, max_draft_length: int, greedy: bool = False,
                       speculative: bool = True) -> list[StepConfig]:
    """The candidate set within the bounds (see the module docstring); greedy: one-draft methods only.

    Speculative L >= 2 is not a candidate: block L drafts and verifies the same tokens at the same cost
    (one draft of L tokens, a verify of L + 1 positions) and block verification is optimal among
    single-draft verifiers, so it commits at least as many tokens per iteration in expectation. At L = 1
    the two are the same rule."""
    found = [StepConfig.of(AUTOREGRESSIVE)]
    if not speculative or max_draft_length < 1:
        return found
    found.append(StepConfig.of("speculative", 1, 1))
    found += [StepConfig.of("block", 1, n) for n in range(2, min(4, max_draft_length) + 1)]
    if not greedy:
        found += [StepConfig.of("spectr", k, n) for k in (2, 4)
                  if k <= max_num_drafts for n in range(2, min(4, max_draft_length) + 1)]
        # traversal at the longest draft only: its gain over spectr grows with L while its selection costs more
        # per iteration, and each extra candidate costs exploration (measured on whole default jobs:
        # benchmarks/results/traversal/default_job_2026-12-06/README.md)
        longest = min(4, max_draft_length)
        found += [StepConfig.of("traversal", k, longest) for k in (2, 4) if k <= max_num_drafts and longest >= 3]
    return found


def family(config: StepConfig) -> str:
    """Configurations whose iterations cost alike: autoregressive, one draft, several drafts."""
    if not config.speculative:
        return AUTOREGRESSIVE
    return "single_draft" if config.method in SINGLE_DRAFT else "multi_draft"


def _token_family(config: StepConfig) -> str:
    """Configurations whose tokens per row share one measured/model ratio: one draft, else each method."""
    return "single_draft" if config.method in SINGLE_DRAFT else config.method


TIMELINE_POINTS = 20_000  # iterations kept for plots (`timeline`); older ones drop off


def bucket_of(rows: int) -> int:
    """Occupancy bucket: 1 and 2 exactly, then the nearest power of two."""
    return rows if rows <= 2 else 2 ** round(math.log2(rows))


@dataclass
class _Seconds:
    """Seconds and live rows of one configuration's recent measured iterations in one bucket (running sums)."""

    samples: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # (seconds, rows, tokens)
    seconds: float = 0.0
    rows: float = 0.0
    tokens: float = 0.0
    warmed: bool = False  # its first iteration (new shapes: allocations, kernel choices) was seen

    def add(self, seconds: float, rows: float, tokens: float) -> None:
        if len(self.samples) == WINDOW:
            old_seconds, old_rows, old_tokens = self.samples[0]
            self.seconds, self.rows, self.tokens = (self.seconds - old_seconds, self.rows - old_rows,
                                                    self.tokens - old_tokens)
        self.samples.append((seconds, rows, tokens))
        self.seconds, self.rows, self.tokens = self.seconds + seconds, self.rows + rows, self.tokens + tokens

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
        self._prior = prior
        self._priors: dict[tuple[StepConfig, int, float], float] = {}
        self._explored: dict[int, int] = {}  # bucket -> iteration at which nothing was left to explore
        self.acceptance = [0, 0]  # accepted, tested draft positions over speculative iterations
        self.buckets: dict[int, dict[StepConfig, _Seconds]] = {}
        self._row_tokens: dict[StepConfig, list[float]] = {}  # config -> [tokens, row-iterations], all buckets
        self._per_row: dict[StepConfig, float] = {}  # tokens per row, cached until the next observation
        self._tokens: dict[StepConfig, int] = {}
        self._seconds: dict[StepConfig, float] = {}
        # the most recent iterations only: an actor's chooser lives for the whole job, its memory must not grow
        self.timeline: deque[TimelinePoint] = deque(maxlen=TIMELINE_POINTS)
        self.iterations = 0
        self.elapsed = 0.0
        self._trial: tuple[StepConfig, int] | None = None  # (config, iterations left)
        self._since_recheck = 0
        self.current: StepConfig = StepConfig.of(AUTOREGRESSIVE)
        self.predicted_tokens_per_s = 0.0
        # bucket -> config -> (seconds, rows, tokens per iteration, iterations) from a warm state (not measured here)
        self._warm: dict[int, dict[StepConfig, tuple[float, float, float, int]]] = {}
        self._warm_cache: dict[int, dict[StepConfig, float]] = {}  # bucket -> `_warm_rates`, until the next observation
        if warm_state:
            self._load(warm_state)
        self.candidates = self._trimmed(list(candidates))
        self._candidate_set = set(self.candidates)

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
        """JSON-able summary for a warm start: per bucket and configuration, seconds, rows and iterations;
        per configuration, tokens per row-iteration; the acceptance."""
        buckets: dict[str, dict[str, dict]] = {}
        for bucket, configs in self._warm.items():  # what this process did not re-measure, in its time units
            speed = self._speed(bucket)
            buckets[str(bucket)] = {c.label: {"seconds": seconds * speed * count, "rows": rows * count,
                                              "tokens": tokens * count, "iterations": count}
                                    for c, (seconds, rows, tokens, count) in configs.items()}
        for bucket, configs in self.buckets.items():
            buckets.setdefault(str(bucket), {}).update(
                {c.label: {"seconds": m.seconds, "rows": m.rows, "tokens": m.tokens, "iterations": len(m.samples)}
                 for c, m in configs.items() if m.samples})
        tokens = {c.label: {"tokens": t, "rows": r} for c, (t, r) in self._row_tokens.items()}
        return {"version": STATE_VERSION, "acceptance": {"accepted": self.acceptance[0], "tested": self.acceptance[1]},
                "buckets": buckets, "tokens": tokens}

    def _load(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            return
        acceptance = state.get("acceptance", {})
        self.acceptance = [int(acceptance.get("accepted", 0)), int(acceptance.get("tested", 0))]
        for label, entry in state.get("tokens", {}).items():
            self._row_tokens[StepConfig.parse(label)] = [float(entry["tokens"]), float(entry["rows"])]
        for bucket, configs in state.get("buckets", {}).items():
            for label, entry in configs.items():
                count = int(entry["iterations"])
                if count <= 0:
                    continue
                self._warm.setdefault(int(bucket), {})[StepConfig.parse(label)] = (
                    entry["seconds"] / count, entry["rows"] / count, entry["tokens"] / count, min(count, WINDOW))

    def _trimmed(self, candidates: list[StepConfig]) -> list[StepConfig]:
        """Autoregressive and the best of the others by the prior at a full batch (and what warm state measured)."""
        rows = max([*self.buckets, *self._warm] or [1])
        speculative = [c for c in candidates if c.speculative]
        speculative.sort(key=lambda c: -self.prior(c, rows, self.acceptance_rate))
        known = {c for configs in [*self.buckets.values(), *self._warm.values()] for c in configs}
        kept = speculative[: MAX_CANDIDATES - 1] + [c for c in speculative[MAX_CANDIDATES - 1:] if c in known]
        return [c for c in candidates if not c.speculative] + kept

    def prior(self, config: StepConfig, rows: int, acceptance: float) -> float:
        """The prior's tokens/s (cached; acceptance to 0.01)."""
        key = (config, rows, round(acceptance, 2))
        if key not in self._priors:
            self._priors[key] = self._prior(config, rows, key[2])
        return self._priors[key]

    def _prior_seconds(self, config: StepConfig, rows: int) -> float:
        """The prior's seconds per iteration: its rows x tokens per row over its tokens/s."""
        acceptance = self.acceptance_rate
        rate = self.prior(config, rows, acceptance)
        return rows * sum(reach(config, round(acceptance, 2))) / rate if rate > 0 else math.inf

    def _measured(self, bucket: int, config: StepConfig) -> _Seconds:
        return self.buckets.setdefault(bucket, {}).setdefault(config, _Seconds())

    # -- estimating -------------------------------------------------------------------------------
    def tokens_per_row(self, config: StepConfig) -> float:
        """Tokens a live row commits per iteration of `config` (see the module docstring; cached)."""
        if not config.speculative:
            return 1.0
        if config not in self._per_row:
            model = sum(reach(config, self.acceptance_rate)) * self._family_ratio(_token_family(config))
            tokens, rows = self._row_tokens.get(config, (0.0, 0.0))
            self._per_row[config] = (tokens + PSEUDO_ROWS * model) / (rows + PSEUDO_ROWS)
        return self._per_row[config]

    def _family_ratio(self, name: str) -> float:
        """Measured / model tokens per row over every configuration of one family (shrunk toward 1). One draft
        pools speculative and block: the model (`reach`, token by token) is exact for the one in law and a
        lower bound for the other, and at batch 1 a method's own few trials are draws of 1 to L + 1 that would
        otherwise drag every configuration of that method down with them."""
        acceptance = self.acceptance_rate
        tokens = modelled = PSEUDO_ROWS
        for config, (measured, rows) in self._row_tokens.items():
            if _token_family(config) == name:
                tokens += measured
                modelled += rows * sum(reach(config, acceptance))
        return tokens / modelled

    def rate(self, config: StepConfig, measured: _Seconds) -> float:
        """Tokens/s of the batch from a measured window: its rows x tokens per row over its seconds."""
        if measured.seconds <= 0:
            return 0.0
        if not config.speculative:
            return measured.tokens / measured.seconds
        return measured.rows * self.tokens_per_row(config) / measured.seconds

    def _speed(self, bucket: int) -> float:
        """This process's seconds over the warm state's, for the same configurations: the median ratio over
        those measured here in `bucket`, else in any bucket; 1 when none is."""
        ratios: dict[bool, list[float]] = {True: [], False: []}
        for number, warm in self._warm.items():
            here = self.buckets.get(number, {})
            for config, (seconds, _, _, _) in warm.items():
                if config in here and here[config].measured and seconds > 0:
                    measured = here[config]
                    ratios[number == bucket].append(measured.seconds / len(measured.samples) / seconds)
        found = ratios[True] or ratios[False]
        return statistics.median(found) if found else 1.0

    def _warm_rates(self, bucket: int) -> dict[StepConfig, float]:
        """Tokens/s of the candidates known only from the warm state in `bucket`, at this process's speed."""
        if bucket in self._warm_cache:
            return self._warm_cache[bucket]
        here = self.buckets.get(bucket, {})
        warm = {c: v for c, v in self._warm.get(bucket, {}).items()
                if c in self._candidate_set and v[3] >= TRIAL and not (c in here and here[c].measured)}
        speed = self._speed(bucket) if warm else 1.0
        rates = {c: (rows * self.tokens_per_row(c) if c.speculative else tokens) / (seconds * speed)
                 for c, (seconds, rows, tokens, _) in warm.items() if seconds > 0}
        self._warm_cache[bucket] = rates
        return rates

    def estimate(self, config: StepConfig, rows: int) -> float:
        """Measured tokens/s in this bucket, else tokens per row over the prior's seconds scaled by what was
        measured elsewhere (see the module docstring)."""
        bucket = bucket_of(rows)
        here = self.buckets.get(bucket, {})
        if config in here and here[config].measured:
            return self.rate(config, here[config])
        warm = self._warm_rates(bucket)
        if config in warm:
            return warm[config]
        others = sorted((abs(math.log2(b / bucket)), b) for b, configs in self.buckets.items()
                        if b != bucket and config in configs and configs[config].measured)
        if others:
            nearest = others[0][1]
            seconds = self._prior_seconds(config, rows) * self._seconds_ratio(
                config, self.buckets[nearest][config], nearest)
        else:
            seconds = self._fitted_seconds(config, here, rows)
        return rows * self.tokens_per_row(config) / seconds

    def _fitted_seconds(self, config: StepConfig, here: dict[StepConfig, _Seconds], rows: int) -> float:
        """Seconds per iteration of an unmeasured speculative configuration in this bucket: an affine map
        from the prior's seconds fitted to the measured speculative ones (a fixed cost the prior may miss,
        and a slope along K and L), its slope kept between a quarter of and the plain measured/prior
        ratio; with fewer than two measured, the ratio of its nearest measured kin."""
        prior = self._prior_seconds(config, rows)
        points = [(self._prior_seconds(c, rows), m.seconds / len(m.samples)) for c, m in here.items()
                  if m.measured and c.speculative]
        if not config.speculative or len({round(x, 9) for x, _ in points}) < 2:
            return prior * self._kin_ratio(config, here, rows)
        mean_x = statistics.fmean(x for x, _ in points)
        mean_y = statistics.fmean(y for _, y in points)
        spread = sum((x - mean_x) ** 2 for x, _ in points)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
        ratio = mean_y / mean_x
        slope = min(max(slope, ratio / 4), ratio)
        return mean_y + slope * (prior - mean_x)

    def _seconds_ratio(self, config: StepConfig, measured: _Seconds, rows: int) -> float:
        """Measured / prior seconds per iteration of one measured window."""
        iterations = len(measured.samples)
        return (measured.seconds / iterations) / self._prior_seconds(config, max(1, round(measured.rows / iterations)))

    def _kin_ratio(self, config: StepConfig, here: dict[StepConfig, _Seconds], rows: int) -> float:
        """Measured / prior seconds of the nearest measured configuration of the same family in this bucket
        (one draft, several drafts; nearest in K and L, so that the search follows the measurements along L),
        else the median over the speculative ones, else over all; 1 when nothing was measured."""
        measured = [(c, self._seconds_ratio(c, m, rows)) for c, m in here.items() if m.measured]
        kin = [(abs(c.draft_length - config.draft_length) + abs(c.num_drafts - config.num_drafts), r)
               for c, r in measured if family(c) == family(config)]
        if kin:
            nearest = min(d for d, _ in kin)
            return statistics.median(r for d, r in kin if d == nearest)
        for same in (lambda c: c.speculative == config.speculative, lambda c: True):
            ratios = [r for c, r in measured if same(c)]
            if ratios:
                return statistics.median(ratios)
        return 1.0

    # -- choosing ---------------------------------------------------------------------------------
    def choose(self, rows: int) -> StepConfig:
        """The configuration of the next iteration, with `rows` live rows."""
        if self._trial is not None:
            config, left = self._trial
            self._trial = (config, left - 1) if left > 1 else None
            return self._set(config, rows)
        number = bucket_of(rows)
        bucket = self.buckets.setdefault(number, {})
        if self._explored.get(number, -REEXPLORE_EVERY) + REEXPLORE_EVERY <= self.iterations:
            to_try = self._to_explore(bucket, rows)
            if to_try is not None:
                trial = self._trial_length(bucket.get(to_try))
                self._trial = (to_try, trial - 1) if trial > 1 else None
                return self._set(to_try, rows)
            self._explored[number] = self.iterations
        # what is left unmeasured was estimated below the best by EXPLORE_SLACK: the best is a measured one
        rates = {c: self.rate(c, m) for c, m in bucket.items() if m.measured and c in self._candidate_set}
        warm = self._warm_rates(number)
        rates.update(warm)
        if not rates:
            return self._set(max(self.candidates, key=lambda c: self.estimate(c, rows)), rows)
        best = max(rates, key=rates.get)
        if self.current in rates and rates[self.current] * (1 + SWITCH_MARGIN) >= rates[best]:
            best = self.current  # not measured faster by the margin: no switch
        self._since_recheck += 1
        recheck = self._recheck(number, rates, best) if self._since_recheck * RECHECK_SHARE >= RECHECK_LENGTH else None
        if recheck is not None:
            self._since_recheck = 0
            self._trial = (recheck, RECHECK_LENGTH - 1) if RECHECK_LENGTH > 1 else None
            return self._set(recheck, rows)
        self.current, self.predicted_tokens_per_s = best, rates[best]
        return best

    def _recheck(self, number: int, rates: dict[StepConfig, float], best: StepConfig) -> StepConfig | None:
        """The measured rival most likely to be better than it looked: the highest rate x (1 + 1/sqrt(n)),
        if that optimistic rate reaches the best's (a rival measured clearly slower, often enough, is left).
        A rival known from the warm state only counts its warm iterations: it is rechecked here in turn."""
        bucket, warm = self.buckets.get(number, {}), self._warm.get(number, {})
        counts = {c: len(bucket[c].samples) if c in bucket and bucket[c].measured else warm[c][3] for c in rates}
        rivals = [(rate * (1 + 1 / math.sqrt(counts[c])), c) for c, rate in rates.items() if c != best]
        rivals = [(ucb, c) for ucb, c in rivals if ucb >= rates[best]]
        return max(rivals, key=lambda rc: rc[0])[1] if rivals else None

    def _to_explore(self, bucket: dict[StepConfig, _Seconds], rows: int) -> StepConfig | None:
        """The next candidate to try in this bucket, or None (see the module docstring)."""
        warm = self._warm_rates(bucket_of(rows))
        unmeasured = [c for c in self.candidates if not (c in bucket and bucket[c].measured) and c not in warm]
        if not unmeasured:
            return None
        tried = {c for configs in self.buckets.values() for c, m in configs.items() if m.measured and c.speculative}
        tried |= {c for configs in self._warm.values() for c, v in configs.items() if v[3] >= TRIAL and c.speculative}
        if len(tried) < COLD_EXPLORE:
            # cold start: autoregressive, then speculative candidates by estimate whatever it says, so that
            # a pessimistic prior cannot hide speculation (later estimates rest on measured kin)
            baseline = [c for c in self.candidates if not c.speculative and c in unmeasured]
            ranked = sorted((c for c in unmeasured if c.speculative), key=lambda c: -self.estimate(c, rows))
            if baseline or ranked:
                return (baseline or ranked)[0]
        measured_here = [self.rate(c, m) for c, m in bucket.items() if m.measured and c in self._candidate_set]
        measured_here += list(warm.values())
        best = max(measured_here or [self.estimate(c, rows) for c in self.candidates])
        open_ = [(self.estimate(c, rows), c) for c in unmeasured]
        open_ = [(e, c) for e, c in open_ if e >= (1 - EXPLORE_SLACK) * best]
        return max(open_, key=lambda ec: ec[0])[1] if open_ else None

    @staticmethod
    def _trial_length(measured: _Seconds | None) -> int:
        """Iterations until a candidate counts as measured: its first one in a bucket warms up, then TRIAL."""
        if measured is None:
            return TRIAL + 1
        return max(1, TRIAL - len(measured.samples) + (0 if measured.warmed else 1))

    def _set(self, config: StepConfig, rows: int) -> StepConfig:
        self.current = config
        self.predicted_tokens_per_s = self.estimate(config, rows)
        return config

    # -- learning ---------------------------------------------------------------------------------
    def observe(self, report: StepReport, measure: bool = True) -> None:
        """One iteration's report (`ContinuousBatcher.last_step`). Its tokens and acceptance always count;
        its seconds are a sample of its configuration's time unless measure=False (it paid for a switch:
        the draft's catch-up) or it was the first iteration of the configuration in its bucket."""
        config = report.config
        measured = self._measured(bucket_of(report.rows), config)
        if measure and measured.warmed:
            measured.add(report.seconds, report.rows, report.tokens)
        measured.warmed = measured.warmed or measure
        if config.speculative:
            self.acceptance[0] += report.accepted
            self.acceptance[1] += report.tested
            pooled = self._row_tokens.setdefault(config, [0.0, 0.0])
            pooled[0], pooled[1] = pooled[0] + report.tokens, pooled[1] + report.rows
            if pooled[1] > TOKEN_MEMORY:
                pooled[0], pooled[1] = pooled[0] / 2, pooled[1] / 2
            self._per_row.clear()
        self._warm_cache.clear()
        self._tokens[config] = self._tokens.get(config, 0) + report.tokens
        self._seconds[config] = self._seconds.get(config, 0.0) + report.seconds
        self.iterations += 1
        self.elapsed += report.seconds + report.prefill_seconds
        self.timeline.append(TimelinePoint(self.iterations - 1, self.elapsed, config.label, report.rows, report.tokens))

    def change_points(self) -> list[TimelinePoint]:
        """The timeline's points where the configuration changed (the first point included)."""
        points = list(self.timeline)
        return [p for i, p in enumerate(points) if i == 0 or p.config != points[i - 1].config]

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
