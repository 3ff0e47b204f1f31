"""SpecTr batch generation: exact speculative decoding with K drafts of L tokens (Sun et al. 2023).

Public entry points: `spectr.generate(target, draft, prompts, ...) -> GenerationOutput` (`spectr.api`;
`method="auto"` chooses each iteration's configuration online, `spectr.planner`), and for a
long-lived caller that feeds prompts as they come (a Ray actor with a queue of shards)
`spectr.ContinuousBatcher(target, draft, batch_size=...)` with `admit(prompts, ...)` and
`step(config=None)` / `finished()` yielding `FinishedRow`s as rows finish; `step` takes any
`StepConfig` within the batcher's bounds and leaves a `StepReport` in `last_step`.
`spectr.planner.AutoBatcher` is the same surface with the configuration chosen per iteration.

Note: the function `spectr.generate` shadows the module `spectr/generate.py` as an attribute
of this package. Import the module's other names with `from spectr.generate import ...`
(or `importlib.import_module("spectr.generate")`), not `import spectr.generate as m`.
"""

from spectr.api import generate
from spectr.batching import ContinuousBatcher, FinishedRow, known_methods
from spectr.generate import Generation, GenerationOutput
from spectr.stats import GenerationStats
from spectr.steps import StepConfig, StepReport
from spectr.warps import SamplingWarp

__all__ = ["ContinuousBatcher", "FinishedRow", "Generation", "GenerationOutput", "GenerationStats", "SamplingWarp",
           "StepConfig", "StepReport", "generate", "known_methods"]
