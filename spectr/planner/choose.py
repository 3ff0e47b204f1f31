"""Choosing the fastest exact method for this hardware: predicted tokens/s of every candidate, best first.

Every candidate (autoregressive, speculative with L draft tokens, SpecTr or SpecInfer with K drafts of L
tokens) samples exactly from the target's distribution, so choosing among them, or switching between
batches, never changes the output's law; only the speed differs. The prediction for one candidate at a
batch of B rows is

    tokens/s = B * E[tokens per call] / seconds per iteration

with E[tokens per call] from `spectr.planner.acceptance.AcceptanceModel` and the seconds of one iteration
from `CostModel`: the target forward over the tree (1 + K*L tokens per row), the draft forwards (the
pending 1 or 2 tokens, then L - 1 steps of K branches), the draft's sampling, the selection walk and the
commit, each read from a latency table measured on the device at this batch and context
(`spectr.planner.latency.measure_cost_model`) and interpolated in the token count.

The component sum misses what whole iterations also pay (Python bookkeeping, mask building, the host
sync, cache effects between the pieces), more for the speculative methods than for autoregressive. So
the calibration also times a few candidates as whole engine iterations
(`spectr.planner.calibrate.time_engine`), and `CostModel.corrections` scales each of them to its
measured seconds; an unmeasured candidate is scaled by the median measured factor of its method, else
of its `family`, else of every speculative candidate. With `new_tokens` known, each row's prefill (measured in those runs) is spread
over the tokens it generates.

A speculative choice must beat autoregressive by `SPECULATION_MARGIN` in the prediction, otherwise the
plan is autoregressive: on a shared machine predictions move by about 10%, and a choice that is not
clearly faster risks being slower.

`Planner` keeps the current plan and re-plans when a measured run's acceptance or the batch's occupancy
has drifted from what the plan assumed. Not here: running anything (`spectr.generate`).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from spectr.planner.acceptance import AUTOREGRESSIVE, AcceptanceModel
from spectr.planner.table import COMMIT, DRAFT, DRAFT_SAMPLE, TARGET, LatencyTable, interpolate

SELECTION = "selection"  # + "_<method>"; shape (K * L,) (autoregressive: (0,))
SPECULATIVE_METHODS = ("speculative", "block", "spectr", "specinfer")
SINGLE_DRAFT = ("speculative", "block")
SPECULATION_MARGIN = 0.05  # a speculative plan must be predicted this much faster than autoregressive


def family(method: str) -> str:
    """Methods whose iterations cost alike (same drafting and verify forward; only the selection rule
    differs): autoregressive, one draft (speculative, block), several drafts (spectr, specinfer)."""
    if method == AUTOREGRESSIVE:
        return AUTOREGRESSIVE
    return "single_draft" if method in SINGLE_DRAFT else "multi_draft"


@dataclass(frozen=True)
class Candidate:
    """One exact configuration: a method with K drafts of L tokens (autoregressive: K = 1, L = 0)."""

    method: str
    num_drafts: int = 1
    draft_length: int = 0

    @property
    def label(self) -> str:
        if self.method == AUTOREGRESSIVE:
            return AUTOREGRESSIVE
        if self.method in SINGLE_DRAFT:
            return f"{self.method} L={self.draft_length}"
        return f"{self.method} K={self.num_drafts} L={self.draft_length}"

    @property
    def tree_tokens(self) -> int:
        """Target tokens per row in one verify call: the pending token and every draft token."""
        return 1 + self.num_drafts * self.draft_length


def default_candidates(
    max_num_drafts: int = 8,
    max_draft_length: int = 8,
    methods: Sequence[str] = SPECULATIVE_METHODS,
    num_drafts: Sequence[int] = (2, 4, 8),
) -> list[Candidate]:
    """Autoregressive, the single-draft methods (speculative, block) at L = 1..max, and each multi-draft
    method at K in `num_drafts` x L. Block verification is rated at token verification's acceptance, a
    lower bound (it is never worse in expectation), so it is chosen when its own costs are lower."""
    if max_num_drafts < 1 or max_draft_length < 1:
        raise ValueError(
            f"max_num_drafts and max_draft_length must be >= 1, got {max_num_drafts} and {max_draft_length}"
        )
    found = [Candidate(AUTOREGRESSIVE)]
    lengths = range(1, max_draft_length + 1)
    for method in (m for m in methods if m in SINGLE_DRAFT):
        found += [Candidate(method, 1, length) for length in lengths]
    for method in (m for m in methods if m not in SINGLE_DRAFT):
        found += [Candidate(method, k, length) for k in num_drafts if k <= max_num_drafts for length in lengths]
    return found


@dataclass(frozen=True)
class CostModel:
    """Seconds of one iteration's pieces, from a latency table measured at some batch sizes and one context.

    Components (see `spectr.planner.table`): TARGET and DRAFT forwards with shape (new tokens per row,) at
    a few token counts (interpolated in between), DRAFT_SAMPLE with shape (K,), COMMIT with shape (L,),
    and SELECTION_<method> with shape (K * L,).
    """

    table: LatencyTable
    context: float | None = None
    corrections: Mapping[Candidate, float] = field(default_factory=dict)  # measured / component seconds
    prefill_per_row: Mapping[str, float] = field(default_factory=dict)  # "target" / "pair" -> seconds per row

    def with_engine_timings(self, timings: Sequence[EngineTiming], batch: float) -> CostModel:
        """This model scaled to whole-iteration measurements at `batch` rows (see the module docstring)."""
        corrections, prefill = {}, {}
        for t in timings:
            base = self.iteration_seconds(t.candidate, batch, t.reach, corrected=False)
            corrections[t.candidate] = t.iteration_seconds / base if base > 0 else 1.0
            prefill[_prefilled(t.candidate)] = t.prefill_seconds_per_row
        return replace(self, corrections=corrections, prefill_per_row=prefill)

    def correction(self, candidate: Candidate) -> float:
        if candidate in self.corrections:
            return self.corrections[candidate]
        same = [f for c, f in self.corrections.items() if c.method == candidate.method]
        kin = [f for c, f in self.corrections.items() if family(c.method) == family(candidate.method)]
        speculative = [f for c, f in self.corrections.items() if c.method != AUTOREGRESSIVE]
        pool = same or kin or (speculative if candidate.method != AUTOREGRESSIVE else [])
        return statistics.median(pool) if pool else 1.0

    def prefill_seconds(self, candidate: Candidate) -> float:
        """Seconds of one row's prefill (0 when not measured)."""
        return self.prefill_per_row.get(_prefilled(candidate), 0.0)

    def _along(self, component: str, batch: float, size: int) -> float:
        """Interpolate the component's latency over its measured shape sizes at `batch` rows."""
        sizes = sorted({key[2][0] for key in self.table.seconds if key[0] == component and key[2]})
        if not sizes:
            raise KeyError(f"no latency measured for {component}")
        points = [(s, self.table.at(component, batch, (s,), self.context)) for s in sizes]
        if len(points) == 1:
            return points[0][1]
        return max(interpolate(points, size), 0.0)

    def forward(self, role: str, batch: float, tokens: int) -> float:
        return self._along(role, batch, tokens)

    def iteration_seconds(
        self, candidate: Candidate, batch: float, reach: Sequence[float], corrected: bool = True
    ) -> float:
        """One iteration with `batch` rows; reach[j]: probability that a call accepts >= j draft tokens."""
        factor = self.correction(candidate) if corrected else 1.0
        return factor * self._component_seconds(candidate, batch, reach)

    def _component_seconds(self, candidate: Candidate, batch: float, reach: Sequence[float]) -> float:
        if candidate.method == AUTOREGRESSIVE:
            return (
                self.forward(TARGET, batch, 1)
                + self._along(f"{SELECTION}_{AUTOREGRESSIVE}", batch, 0)
                + self._along(COMMIT, batch, 0)
            )
        k, length = candidate.num_drafts, candidate.draft_length
        two_pending = 1.0 - (1.0 - reach[length]) ** batch  # some row accepted all L last time
        draft = (
            (1.0 - two_pending) * self.forward(DRAFT, batch, 1)
            + two_pending * self.forward(DRAFT, batch, 2)
            + (length - 1) * self.forward(DRAFT, batch, k)
            + length * self._along(DRAFT_SAMPLE, batch, k)
        )
        target = self.forward(TARGET, batch, candidate.tree_tokens)
        selection = self._along(f"{SELECTION}_{candidate.method}", batch, k * length)
        return draft + target + selection + self._along(COMMIT, batch, length)


def _prefilled(candidate: Candidate) -> str:
    """Which models a row's admission prefills: the target alone, or the pair."""
    return "target" if candidate.method == AUTOREGRESSIVE else "pair"


@dataclass(frozen=True)
class EngineTiming:
    """One candidate timed as whole engine iterations (`spectr.planner.calibrate.time_engine`)."""

    candidate: Candidate
    iteration_seconds: float  # mean seconds of one iteration with the batch full
    prefill_seconds_per_row: float  # the admission of the batch's rows, per row
    reach: tuple[float, ...] = (1.0,)  # the acceptance the component model is evaluated at


@dataclass(frozen=True)
class PlanEntry:
    candidate: Candidate
    tokens_per_call: float  # per row
    iteration_seconds: float
    tokens_per_second: float


@dataclass(frozen=True)
class Plan:
    """Every candidate's prediction, fastest first, at `batch` rows."""

    entries: tuple[PlanEntry, ...]
    batch: float

    @property
    def best(self) -> PlanEntry:
        return self.entries[0]

    def entry(self, candidate: Candidate) -> PlanEntry:
        return next(e for e in self.entries if e.candidate == candidate)

    @property
    def autoregressive(self) -> PlanEntry | None:
        return next((e for e in self.entries if e.candidate.method == AUTOREGRESSIVE), None)

    @property
    def speedup(self) -> float:
        """Predicted tokens/s of the choice over autoregressive (1.0 when autoregressive is not a candidate)."""
        base = self.autoregressive
        return self.best.tokens_per_second / base.tokens_per_second if base and base.tokens_per_second else 1.0

    def describe(self) -> str:
        return (
            f"auto chose {self.best.candidate.label}, predicted {self.best.tokens_per_second:.1f} tok/s "
            f"({self.speedup:.2f}x autoregressive)"
        )


def make_plan(
    candidates: Iterable[Candidate], acceptance: AcceptanceModel, cost: CostModel, batch: float,
    new_tokens: int | None = None, margin: float = SPECULATION_MARGIN,
) -> Plan:
    """Predict every candidate at `batch` rows and sort them, fastest first (ties: the simpler first);
    autoregressive goes first unless the fastest other candidate beats it by `margin`.

    new_tokens: tokens each row generates (None: prefill not counted)."""
    if batch <= 0:
        raise ValueError(f"batch must be > 0, got {batch}")
    entries = []
    for candidate in candidates:
        reach = acceptance.reach(candidate.method, candidate.num_drafts, candidate.draft_length)
        tokens = sum(reach)
        seconds = cost.iteration_seconds(candidate, batch, reach)
        if new_tokens:  # the rows admitted per iteration at this pace, each prefilled once
            seconds += batch * tokens / new_tokens * cost.prefill_seconds(candidate)
        entries.append(PlanEntry(candidate, tokens, seconds, batch * tokens / seconds if seconds > 0 else 0.0))
    if not entries:
        raise ValueError("no candidates to plan over")
    entries.sort(key=lambda e: (-e.tokens_per_second, e.candidate.tree_tokens))
    base = next((e for e in entries if e.candidate.method == AUTOREGRESSIVE), None)
    if base is not None and entries[0] is not base and entries[0].tokens_per_second < (1 + margin) * base.tokens_per_second:
        entries.remove(base)
        entries.insert(0, base)
    return Plan(tuple(entries), batch)


class Planner:
    """The current plan, re-planned when a measured run drifts from what the plan assumed.

    `observe` takes one run of the chosen candidate (its accepted draft positions and target calls, and
    the mean number of rows that were active): when the measured tokens per call differ from the
    prediction by more than `tolerance` (relative), the acceptance model is calibrated to the
    measurement; when the occupancy differs by more than `tolerance`, the plan is made for the measured
    occupancy. Either way the choice may change; it is always among exact candidates.
    """

    def __init__(
        self,
        candidates: Sequence[Candidate],
        acceptance: AcceptanceModel,
        cost: CostModel,
        batch: float,
        tolerance: float = 0.15,
        new_tokens: int | None = None,
    ):
        self.candidates = list(candidates)
        self.acceptance, self.cost, self.tolerance = acceptance, cost, tolerance
        self.new_tokens = new_tokens
        self.plan = make_plan(self.candidates, acceptance, cost, batch, new_tokens)
        self.replans = 0

    @property
    def choice(self) -> Candidate:
        return self.plan.best.candidate

    def observe(
        self, candidate: Candidate, accepted_per_position: Sequence[int], target_calls: int, mean_active_rows: float
    ) -> bool:
        """Record one run; returns True when the plan was remade."""
        drifted = False
        acceptance = self.acceptance
        if candidate.method != AUTOREGRESSIVE and target_calls > 0:
            measured = 1.0 + sum(accepted_per_position[: candidate.draft_length]) / target_calls
            predicted = self.plan.entry(candidate).tokens_per_call if candidate in self.candidates else measured
            if abs(measured - predicted) > self.tolerance * predicted:
                acceptance = acceptance.calibrated(
                    candidate.method, candidate.num_drafts, candidate.draft_length, accepted_per_position,
                    target_calls,
                )
                drifted = True
        batch = self.plan.batch
        if mean_active_rows > 0 and abs(mean_active_rows - batch) > self.tolerance * batch:
            batch, drifted = mean_active_rows, True
        if drifted:
            self.acceptance = acceptance
            self.plan = make_plan(self.candidates, acceptance, self.cost, batch, self.new_tokens)
            self.replans += 1
        return drifted


def bounded(candidates: Iterable[Candidate], max_num_drafts: int | None, max_draft_length: int | None) -> list[Candidate]:
    """The candidates within optional bounds on K and L."""
    return [
        c
        for c in candidates
        if (max_num_drafts is None or c.num_drafts <= max_num_drafts)
        and (max_draft_length is None or c.draft_length <= max_draft_length)
    ]


__all__ = [
    "Candidate",
    "CostModel",
    "EngineTiming",
    "Plan",
    "PlanEntry",
    "Planner",
    "bounded",
    "default_candidates",
    "family",
    "make_plan",
]
