"""The planner in the benchmark: `auto` learns on its own timed runs, next to every fixed configuration.

A timed run of an `auto` configuration generates each of its batches with
`spectr.planner.auto.generate_auto` (K <= the grid's largest num_drafts, L <= its largest
draft_length): the online chooser picks every iteration's configuration from the batch's measured
tokens/s. Nothing is measured before the timed runs (no calibration); the first batch of every run
starts cold, and each next batch of the same run starts from the previous batch's chooser state, as
a generation actor keeps its chooser across shards. `AutoRun` keeps what one run did: tokens and
seconds per configuration, the seconds whose tokens were not kept (0 by design), and the timeline
(per iteration: seconds since the run started, configuration, live rows) that
`pipeline.benchmark.plots` draws.

Not here: the goals on it (`pipeline.benchmark.goals`), the chooser (`spectr.planner.chooser`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AutoRun:
    """What `auto` ran over one timed run (all its batches)."""

    tokens_by_config: dict[str, int] = field(default_factory=dict)
    seconds_by_config: dict[str, float] = field(default_factory=dict)
    wasted_seconds: float = 0.0
    timeline: list[tuple[float, str, int]] = field(default_factory=list)  # (seconds since start, config, rows)
    predicted_tokens_per_second: float = 0.0  # the chooser's estimate for its last choice
    state: dict | None = None  # the last chooser's state: the next batch of the run starts from it

    def add(self, chooser) -> None:
        """Fold in one batch's chooser (`spectr.planner.chooser.OnlineChooser`)."""
        for label, tokens in chooser.tokens_by_config().items():
            self.tokens_by_config[label] = self.tokens_by_config.get(label, 0) + tokens
        for label, seconds in chooser.seconds_by_config().items():
            self.seconds_by_config[label] = self.seconds_by_config.get(label, 0.0) + seconds
        start = self.timeline[-1][0] if self.timeline else 0.0
        self.timeline += [(start + p.seconds, p.config, p.rows) for p in chooser.timeline]
        self.wasted_seconds += chooser.wasted_seconds
        self.predicted_tokens_per_second = chooser.predicted_tokens_per_s
        self.state = chooser.state()


@dataclass(frozen=True)
class AutoSummary:
    """`auto` pooled over the timed runs of one configuration; `timeline` is the first run's."""

    tokens_by_config: dict[str, int]
    generation_seconds: float
    wasted_seconds: float
    timeline: list[tuple[float, str, int]]
    predicted_tokens_per_second: float

    @property
    def shares(self) -> list[tuple[str, float]]:
        """(configuration, share of tokens), largest first."""
        total = sum(self.tokens_by_config.values())
        return sorted(((c, n / total) for c, n in self.tokens_by_config.items() if total), key=lambda cs: -cs[1])

    @property
    def dominant(self) -> tuple[str, float]:
        return self.shares[0] if self.shares else ("", 0.0)

    @property
    def description(self) -> str:
        """`auto: speculative L=3 for 81% of tokens, block L=3 12%, autoregressive 7%`."""
        parts = [f"{c} {100 * s:.0f}%" for c, s in self.shares]
        if not parts:
            return "auto: nothing generated"
        first, share = self.shares[0]
        parts[0] = f"{first} for {100 * share:.0f}% of tokens"
        return "auto: " + ", ".join(parts)


def summarize(runs) -> AutoSummary | None:
    """The `auto` runs of one configuration (`CaseRun`s with `.auto`) pooled; None when none ran."""
    autos = [r.auto for r in runs if getattr(r, "auto", None) is not None]
    if not autos:
        return None
    tokens: dict[str, int] = {}
    for a in autos:
        for label, n in a.tokens_by_config.items():
            tokens[label] = tokens.get(label, 0) + n
    seconds = sum(sum(a.seconds_by_config.values()) for a in autos)
    return AutoSummary(tokens, seconds, sum(a.wasted_seconds for a in autos), autos[0].timeline,
                       autos[-1].predicted_tokens_per_second)
