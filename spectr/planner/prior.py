"""The chooser's prior: latencies guessed from the models' parameter counts, read through the one cost model.

`PriorLatencies` answers `at(component, batch, shape, context)` like a measured
`spectr.planner.table.LatencyTable`, from nothing but the pair's sizes: a forward of a model of P
parameters over `batch` rows of T new tokens costs

    FORWARD_FIXED_S + P * (WEIGHT_S + TOKEN_S * batch * T)

(a fixed launch and Python cost, reading the weights once, and the matmuls per token), the draft's
sampling and the selection a small cost per row and vocabulary entry, the commit a constant. Traversal
verification adds its rejection loop: K L steps (the widest tree's non-root nodes, at most), each a fixed
cost (a few dozen small ops) plus a few float64 passes over one vocabulary row per row (its residual).
Tokens per call (`reach`) are modelled token by token with the first position tried K times for every
multi-draft method: a lower bound for traversal, whose measured/model ratio the chooser keeps apart. So
`prior_tokens_per_second` is `spectr.planner.predict.iteration_seconds` (the project's one cost
model, which the benchmark evaluates on measured tables) with a default acceptance, or the one
measured so far. It only ranks which configurations the online chooser tries first
(`spectr.planner.chooser`); measured iterations decide. The constants are CPU-like orders of
magnitude (float32, a few cores); on a GPU the fixed costs dominate more, which the measurements
correct.

Not here: measuring anything, choosing.
"""

from __future__ import annotations

from dataclasses import dataclass

from spectr.planner.predict import iteration_seconds
from spectr.planner.table import COMMIT, DRAFT, DRAFT_SAMPLE, DRAFT_SAMPLE_FIRST, TARGET
from spectr.steps import AUTOREGRESSIVE, MULTI_DRAFT, StepConfig

FORWARD_FIXED_S = 1.5e-3  # per forward: kernel launches, the HF module tree in Python
WEIGHT_S = 2e-10  # per parameter per forward: reading the weights
TOKEN_S = 7e-11  # per parameter per token: two flops at ~30 GFLOP/s
VOCAB_S = 2e-9  # per row, token and vocabulary entry: warps, sampling, selection
STEP_S = 5e-4  # commit, bookkeeping
# traversal's loop, per step: ~45 small ops, and ~13 float64 passes over [B, V] (fitted to eager runs of
# `scripts/bench_selection.py --method traversal`, one thread, V = 8192, B = 1 and 8, K L = 8..64)
TRAVERSAL_STEP_S = 2e-4
TRAVERSAL_VOCAB_S = 1.5e-8  # per row and vocabulary entry
DEFAULT_ACCEPTANCE = 0.7  # per draft position, before anything is measured


@dataclass(frozen=True)
class PriorLatencies:
    """Latencies of the pair's components from parameter counts (see the module docstring)."""

    target_parameters: int
    draft_parameters: int
    vocab_size: int

    def _forward(self, parameters: int, batch: float, tokens: int) -> float:
        return FORWARD_FIXED_S + parameters * (WEIGHT_S + TOKEN_S * batch * tokens)

    def at(self, component: str, batch: float, shape: tuple, context: float | None = None) -> float:
        if component == TARGET:
            return self._forward(self.target_parameters, batch, shape[0])
        if component == DRAFT:
            return self._forward(self.draft_parameters, batch, shape[0])
        if component in (DRAFT_SAMPLE, DRAFT_SAMPLE_FIRST):
            return VOCAB_S * batch * shape[0] * self.vocab_size
        if component == COMMIT:
            return STEP_S
        if component.startswith("selection_"):
            width = 1 + (shape[0] * shape[1] if len(shape) == 2 else 0)
            seconds = STEP_S + VOCAB_S * batch * width * self.vocab_size
            if component.startswith("selection_traversal"):  # its loop: K L steps at most
                seconds += (width - 1) * (TRAVERSAL_STEP_S + TRAVERSAL_VOCAB_S * batch * self.vocab_size)
            return seconds
        raise KeyError(f"no prior for {component}")


def reach(config: StepConfig, acceptance: float) -> list[float]:
    """s_j, j = 0..L: P(a call accepts >= j draft tokens) with per-position acceptance `acceptance`
    (several drafts: the first position is tried K times)."""
    if config.method == AUTOREGRESSIVE:
        return [1.0]
    first = 1.0 - (1.0 - acceptance) ** config.num_drafts if config.method in MULTI_DRAFT else acceptance
    return [1.0] + [first * acceptance ** (j - 1) for j in range(1, config.draft_length + 1)]


def prior_tokens_per_second(latencies: PriorLatencies, config: StepConfig, rows: float, acceptance: float) -> float:
    """Predicted tokens/s of the batch: rows x E[tokens per call] / seconds of one iteration."""
    probabilities = reach(config, acceptance)
    parts = iteration_seconds(latencies, config.method, rows, config.num_drafts, config.draft_length,
                              probabilities)
    seconds = sum(parts)
    return rows * sum(probabilities) / seconds if seconds > 0 else 0.0
