"""The planner's cost model: predict tokens/s of each (method, K, L, B) from measured latencies and acceptance.

Three parts, one module each:
- `spectr.planner.table`: the latency table (seconds per call by component, batch, shape, context,
  interpolated), the engine's batch shapes, and a table rescaled to a local calibration;
- `spectr.planner.latency`: measuring those latencies on the actor's own device through the engine's
  pieces (forwards, draft sampling, selection, commit, prefill) and calibrating them;
- `spectr.planner.predict`: predicting a run's seconds from the table and the run's acceptance.

It needs torch and transformers only (no Ray, MLflow, Hydra or pyarrow), so a worker can plan with it.
The benchmark job (`pipeline.benchmark`) uses it to predict every configuration it times.
"""

from spectr.planner.latency import Calibrator, ForwardTimer, measure_latencies, pooled
from spectr.planner.predict import Prediction, predict_seconds
from spectr.planner.table import (
    DRAFT,
    TARGET,
    BatchRun,
    LatencyTable,
    ScaledTable,
    batch_capacity,
    batch_context,
    tree_widths,
)

__all__ = [
    "DRAFT",
    "TARGET",
    "BatchRun",
    "Calibrator",
    "ForwardTimer",
    "LatencyTable",
    "Prediction",
    "ScaledTable",
    "batch_capacity",
    "batch_context",
    "measure_latencies",
    "pooled",
    "predict_seconds",
    "tree_widths",
]
