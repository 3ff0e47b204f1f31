"""The planner: `method="auto"` chooses each iteration's exact configuration online, from real iterations.

- `spectr.planner.chooser`: `OnlineChooser` (candidates, measured tokens/s per occupancy bucket,
  exploration, warm start) and `default_candidates`;
- `spectr.planner.batcher`: `AutoBatcher`, a `ContinuousBatcher` driven by the chooser;
- `spectr.planner.auto`: `generate_auto`, `spectr.generate(method="auto")`;
- `spectr.planner.prior`: the chooser's prior, latencies from parameter counts read through
- `spectr.planner.predict`: the one cost model (an iteration's seconds from component latencies and
  acceptance), which the benchmark also evaluates on measured latency tables
  (`spectr.planner.table`, `spectr.planner.latency`);
- `spectr.planner.acceptance`: exact per-position acceptance of each rule (the benchmark's optimality
  analysis).

The planner sits above the engine: it imports `spectr.batching` and friends, never the reverse. It needs
torch and transformers only (no Ray, MLflow, Hydra or pyarrow).
"""

from spectr.planner.auto import generate_auto
from spectr.planner.batcher import AUTO, AutoBatcher
from spectr.planner.chooser import OnlineChooser, default_candidates

__all__ = ["AUTO", "AutoBatcher", "OnlineChooser", "default_candidates", "generate_auto"]
