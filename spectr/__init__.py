"""SpecTr batch generation: exact speculative decoding with K drafts of L tokens (Sun et al. 2023).

Public entry points: `spectr.generate(target, draft, prompts, ...) -> GenerationOutput`, and for
a long-lived caller that feeds prompts as they come (a Ray actor with a queue of shards)
`spectr.ContinuousBatcher(target, draft, batch_size=...)` with `admit(prompts, ...)` and
`step()` / `finished()` yielding `FinishedRow`s as rows finish.

Note: the function `spectr.generate` shadows the module `spectr/generate.py` as an attribute
of this package. Import the module's other names with `from spectr.generate import ...`
(or `importlib.import_module("spectr.generate")`), not `import spectr.generate as m`.
"""

from spectr.batching import ContinuousBatcher, FinishedRow
from spectr.generate import Generation, GenerationOutput, generate, known_methods
from spectr.stats import GenerationStats
from spectr.warps import SamplingWarp

__all__ = ["ContinuousBatcher", "FinishedRow", "Generation", "GenerationOutput", "GenerationStats", "SamplingWarp",
           "generate", "known_methods"]
