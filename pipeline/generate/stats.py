"""Shard statistics as plain, summable dicts: what a worker returns and the driver adds up.

`empty_stats()` is the zero; `merge_stats(total, part)` adds in place (lists element-wise);
`stats_of(generation_stats)` takes the summable part of one `spectr.generate` call.

Not here: derived metrics and the summary table (`pipeline.generate.summary`).
"""

from __future__ import annotations

from typing import Any

# Statistic fields summed over batches (lists element-wise).
_SUMMED = (
    "tested_positions",
    "draft_seconds",
    "target_seconds",
    "selection_seconds",
    "other_seconds",
    "wall_seconds",
)
_SUMMED_LISTS = ("accepted_per_position", "tokens_per_call_histogram")


def empty_stats() -> dict[str, Any]:
    stats: dict[str, Any] = {name: 0.0 for name in _SUMMED}
    stats["tested_positions"] = 0
    stats.update({name: [] for name in _SUMMED_LISTS})
    stats.update(generated_tokens=0, target_calls=0, prompts_completed=0, prompts_failed=0, shard_seconds=0.0)
    return stats


def merge_stats(total: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """Add `part` into `total` (in place) and return it; lists are summed element-wise."""
    for name in (
        *_SUMMED,
        "generated_tokens",
        "target_calls",
        "prompts_completed",
        "prompts_failed",
        "shard_seconds",
    ):
        total[name] = total.get(name, 0) + part.get(name, 0)
    for name in _SUMMED_LISTS:
        a, b = list(total.get(name, [])), list(part.get(name, []))
        width = max(len(a), len(b))
        a += [0] * (width - len(a))
        b += [0] * (width - len(b))
        total[name] = [x + y for x, y in zip(a, b)]
    return total


def stats_of(generation_stats: Any) -> dict[str, Any]:
    """The summable part of one `spectr.generate` call's stats."""
    stats = empty_stats()
    for name in _SUMMED:
        stats[name] = getattr(generation_stats, name)
    for name in _SUMMED_LISTS:
        stats[name] = [int(x) for x in getattr(generation_stats, name)]
    stats["generated_tokens"] = int(sum(generation_stats.generated_tokens))
    stats["target_calls"] = int(sum(generation_stats.target_calls))
    return stats
