"""One iteration's configuration and what it did: `StepConfig` (method, K, L) and `StepReport`.

`ContinuousBatcher.step(config)` runs one iteration with any exact configuration within the
bounds the batcher was allocated for; the next iteration may use another. Every exact
configuration samples the target's (warped) conditional law at every iteration, so switching
between iterations never changes the output LAW; a row's exact tokens then depend on the
schedule of configurations (a fixed method keeps "a row's output depends only on its prompt,
seed, models and settings").

Labels (`StepConfig.label`, parsed back by `StepConfig.parse`): `autoregressive`,
`speculative L=3`, `block L=3`, `spectr K=4 L=3`, `specinfer K=2 L=2`, `traversal K=4 L=8`.

This module holds plain values only: it runs nothing and imports no model code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

AUTOREGRESSIVE = "autoregressive"
SINGLE_DRAFT = ("speculative", "block")
MULTI_DRAFT = ("spectr", "specinfer", "traversal")
METHODS = (AUTOREGRESSIVE, *SINGLE_DRAFT, *MULTI_DRAFT)
_LABEL = re.compile(r"^(?P<method>[a-z_]+)(?: K=(?P<k>\d+))?(?: L=(?P<l>\d+))?$")


@dataclass(frozen=True)
class StepConfig:
    """An exact configuration of one iteration. Autoregressive is K = L = 0; the single-draft
    methods (speculative, block) have K = 1. Construct through `of` to get that normal form."""

    method: str
    num_drafts: int = 0
    draft_length: int = 0

    @classmethod
    def of(cls, method: str, num_drafts: int = 1, draft_length: int = 1) -> StepConfig:
        """The normal form: K = L = 0 for autoregressive, K = 1 for the single-draft methods. The method
        name is checked by the engine (`spectr.batching.known_methods`: the selection registry, which
        tests extend with broken rules), not here."""
        if not isinstance(method, str) or not method:
            raise ValueError(f"method must be a method name, got {method!r}")
        if method == AUTOREGRESSIVE:
            return cls(AUTOREGRESSIVE, 0, 0)
        for name, value in (("num_drafts", num_drafts), ("draft_length", draft_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        return cls(method, 1 if method in SINGLE_DRAFT else num_drafts, draft_length)

    @property
    def speculative(self) -> bool:
        return self.method != AUTOREGRESSIVE

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

    def to_dict(self) -> dict:
        return {"method": self.method, "num_drafts": self.num_drafts, "draft_length": self.draft_length}

    @classmethod
    def from_dict(cls, data: dict) -> StepConfig:
        return cls.of(data["method"], int(data.get("num_drafts", 1)) or 1, int(data.get("draft_length", 1)) or 1)

    @classmethod
    def parse(cls, label: str) -> StepConfig:
        """The config of a `label` (ValueError for anything else)."""
        match = _LABEL.match(label.strip())
        if match is None or match["method"] not in METHODS:
            raise ValueError(f"not a configuration label: {label!r}")
        method = match["method"]
        if method == AUTOREGRESSIVE:
            return cls.of(method)
        if match["l"] is None or (method in MULTI_DRAFT) != (match["k"] is not None):
            raise ValueError(f"not a configuration label: {label!r}")
        return cls.of(method, int(match["k"] or 1), int(match["l"]))

    def __str__(self) -> str:
        return self.label


@dataclass(frozen=True)
class StepReport:
    """What one `ContinuousBatcher.step` did (host values, read in the iteration's existing host copy).

    rows: live rows the iteration ran; tokens: tokens committed by all rows in it (after EOS and
    budget truncation); accepted / tested: draft positions accepted / examined by the selection
    (0 for autoregressive); seconds: wall seconds of the iteration (admission excluded: that is
    `prefill_seconds`, the prefill of the rows admitted before it; on CUDA the admission reads nothing,
    so its kernels may finish inside the iteration's seconds); finished: rows that finished.
    """

    config: StepConfig
    rows: int
    tokens: int
    seconds: float
    prefill_seconds: float = 0.0
    accepted: int = 0
    tested: int = 0
    finished: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0
