"""The cost model's latency table: seconds per call by (component, batch, shape, context), interpolated.

Also the shape of a benchmark batch as the engine sizes it (its context) and
`ScaledTable`, a table rescaled to a local calibration. Not here: measuring (`spectr.planner.latency`),
predicting (`spectr.planner.predict`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

TARGET, DRAFT = "target", "draft"
REJECT_ALL, ACCEPT_ALL = "reject_all", "accept_all"
DRAFT_SAMPLE, DRAFT_SAMPLE_FIRST = "draft_sample", "draft_sample_first"
COMMIT = "commit"


@dataclass
class LatencyTable:
    """Seconds per call keyed by (component, batch size, shape, context).

    `at` interpolates linearly in the batch size at each measured context, then linearly in the
    context; components measured at one context (or none, `None`) do not depend on it, and
    `at(..., context=None)` takes the widest measured context. The "context" of the forwards is the
    cached tokens they attend.
    """

    seconds: dict[tuple, float] = field(default_factory=dict)

    def add(self, component: str, batch: int, shape: tuple, seconds: float, context: int | None = None) -> None:
        self.seconds[(component, batch, tuple(shape), context)] = seconds

    def contexts(self, component: str) -> list[int]:
        return sorted({key[3] for key in self.seconds if key[0] == component and key[3] is not None})

    def at(self, component: str, batch: float, shape: tuple, context: float | None = None) -> float:
        """Latency at a (possibly unmeasured) batch size and context (see the class docstring)."""
        curves: dict[int | None, list[tuple[int, float]]] = {}
        for (name, b, s, ctx), value in self.seconds.items():
            if name == component and s == tuple(shape):
                curves.setdefault(ctx, []).append((b, value))
        if not curves:
            raise KeyError(f"no latency measured for {component} {shape}")
        values = [(ctx, interpolate(sorted(points), batch)) for ctx, points in curves.items()]
        if len(values) == 1:
            return max(values[0][1], 0.0)
        measured = sorted(v for v in values if v[0] is not None)
        if context is None:
            return max(measured[-1][1], 0.0)  # the widest measured context
        return max(interpolate(measured, context), 0.0)

    def grid(self, component: str, context: int | None = None) -> dict[tuple[int, tuple], float]:
        """{(batch, shape): seconds} of one component at one measured context (default: the widest)."""
        contexts = self.contexts(component)
        if context is None and contexts:
            context = contexts[-1]
        return {(k[1], k[2]): v for k, v in self.seconds.items() if k[0] == component and k[3] == context}

    def rows(self) -> list[dict]:
        return [
            {
                "component": key[0],
                "batch_size": key[1],
                "shape": "x".join(map(str, key[2])),
                "context": "" if key[3] is None else key[3],
                "milliseconds": 1000.0 * value,
            }
            for key, value in sorted(self.seconds.items(), key=lambda kv: tuple(map(str, kv[0])))
        ]


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through (x, y) points sorted by x; linear extrapolation from the end segments."""
    if len(points) == 1:
        return points[0][1] * x / points[0][0]  # one point: proportional
    if x <= points[0][0]:
        (x0, y0), (x1, y1) = points[0], points[1]
    elif x >= points[-1][0]:
        (x0, y0), (x1, y1) = points[-2], points[-1]
    else:
        (x0, y0), (x1, y1) = next((a, b) for a, b in zip(points, points[1:]) if a[0] <= x <= b[0])
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)




# ---------------------------------------------------------------------------------------
# the shape of a benchmark batch
# ---------------------------------------------------------------------------------------


def batch_context(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> float:
    """Cached slots a forward of this batch attends, averaged over the run: the longest row's
    committed length (its prompt but the pending last token) plus half the new tokens."""
    return max(len(p) for p in prompts) - 1 + max_new_tokens / 2


@dataclass(frozen=True)
class BatchRun:
    """One batch of one measured run, as the prediction needs it."""

    row_target_calls: Sequence[int]  # target calls of each row
    prefill_seconds: tuple[float, float]  # (target, draft) prefill latency of this batch (draft 0: none)
    context: float  # batch_context


class ScaledTable:
    """A LatencyTable whose forward latencies are rescaled to a local measurement at one batch size.

    at(component, a, shape, c) = table.at(component, a, shape, c) * local[component, shape] /
    table.at(component, B, shape, context); components without a local measurement are taken from
    the table as they are. Prefill latencies are scaled like the model's widest forward.
    """

    def __init__(self, table: LatencyTable, local: dict[tuple[str, tuple], float], batch: int, context: float):
        self.table, self.local, self.batch, self.context = table, local, batch, context

    def factor(self, component: str, shape: tuple) -> float:
        if (component, shape) not in self.local:
            return 1.0
        return self.local[(component, shape)] / self.table.at(component, self.batch, shape, self.context)

    def model_factor(self, component: str) -> float:
        """Scale of the model's widest calibrated forward (used for its prefill)."""
        shapes = [shape for c, shape in self.local if c == component]
        return self.factor(component, max(shapes)) if shapes else 1.0

    def at(self, component: str, batch: float, shape: tuple, context: float | None = None) -> float:
        return self.table.at(component, batch, shape, context) * self.factor(component, shape)
