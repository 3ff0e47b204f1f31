"""What `method=auto` ran: tokens and seconds per configuration, and how to say it in one line.

    mix = ConfigMix()
    mix.add("speculative L=3", tokens=24, seconds=0.05)   # after every iteration (the actor)
    mix.describe()  ->  "auto: speculative L=3 for 81% of tokens, block L=3 12%, autoregressive 7%"

Labels are `spectr.StepConfig.label`s (`autoregressive`, `speculative L=3`, `block L=3`, `spectr K=4
L=3`, ...). A `ConfigMix` is a plain dict pair, so it travels in shard statistics and part-file
metadata as JSON and sums over shards and actors (`merge`). Nothing here imports torch: the driver
uses it for the summary and MLflow.

Not here: choosing a configuration (`spectr.planner`), logging (`pipeline.generate.tracking`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ConfigMix:
    tokens: dict[str, int] = field(default_factory=dict)  # label -> tokens committed under it
    seconds: dict[str, float] = field(default_factory=dict)  # label -> seconds of its iterations

    def add(self, label: str, tokens: int, seconds: float) -> None:
        self.tokens[label] = self.tokens.get(label, 0) + int(tokens)
        self.seconds[label] = self.seconds.get(label, 0.0) + float(seconds)

    def merge(self, other: ConfigMix) -> ConfigMix:
        for label, tokens in other.tokens.items():
            self.add(label, tokens, other.seconds.get(label, 0.0))
        return self

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens.values())

    def shares(self) -> dict[str, float]:
        """label -> share of the tokens, largest first."""
        total = self.total_tokens or 1
        ranked = sorted(self.tokens.items(), key=lambda item: (-item[1], item[0]))
        return {label: tokens / total for label, tokens in ranked}

    def describe(self) -> str:
        """`auto: speculative L=3 for 81% of tokens, block L=3 12%, autoregressive 7%`."""
        shares = list(self.shares().items())
        if not shares:
            return "auto: no tokens yet"
        (first, share), rest = shares[0], shares[1:]
        words = [f"{first} for {100 * share:.0f}% of tokens"] + [f"{label} {100 * s:.0f}%" for label, s in rest]
        return "auto: " + ", ".join(words)

    def to_dict(self) -> dict[str, Any]:
        return {"tokens_by_config": dict(self.tokens), "seconds_by_config": dict(self.seconds)}

    @classmethod
    def of(cls, stats: dict[str, Any]) -> ConfigMix:
        """The mix recorded in shard statistics (empty for a fixed method)."""
        return cls(dict(stats.get("tokens_by_config") or {}), dict(stats.get("seconds_by_config") or {}))


def metric_name(label: str) -> str:
    """An MLflow metric name for a configuration's token share: `planner_share_speculative_L3`."""
    return "planner_share_" + re.sub(r"[^A-Za-z0-9]+", "_", label.replace("=", "")).strip("_")
