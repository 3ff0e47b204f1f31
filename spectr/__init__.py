"""SpecTr batch generation: exact speculative decoding with K drafts of L tokens (Sun et al. 2023).

Public entry point: `spectr.generate(target, draft, prompts, ...) -> GenerationOutput`
(see spectr/generate.py). The names below are imported lazily, so that `import spectr.selection`
does not pull in transformers.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "generate": "spectr.generate",
    "GenerationOutput": "spectr.generate",
    "known_methods": "spectr.generate",
    "GenerationStats": "spectr.stats",
    "SamplingWarp": "spectr.warps",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = importlib.import_module(_EXPORTS[name])
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'spectr' has no attribute {name!r}")
