"""SpecTr batch generation: exact speculative decoding with K drafts of L tokens (Sun et al. 2023).

Public entry point: `spectr.generate(target, draft, prompts, ...) -> GenerationOutput`.

Note: the function `spectr.generate` shadows the module `spectr/generate.py` as an attribute
of this package. Import the module's other names with `from spectr.generate import ...`
(or `importlib.import_module("spectr.generate")`), not `import spectr.generate as m`.
"""

from spectr.generate import Generation, GenerationOutput, generate, known_methods
from spectr.stats import GenerationStats
from spectr.warps import SamplingWarp

__all__ = ["Generation", "GenerationOutput", "GenerationStats", "SamplingWarp", "generate", "known_methods"]
