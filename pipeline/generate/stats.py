"""Shard statistics as plain, summable dicts: what a worker returns and the driver adds up.

`empty_stats()` is the zero; `merge_stats(total, part)` adds in place (lists element-wise, the per-configuration
dicts of method="auto" key-wise; `plan`, the chooser's current configuration, is the latest one);
`stats_of(generation_stats)` takes the summable part of one `spectr.generate` call.
`ResourceMeter` measures what one shard cost its worker (CPU time, peak RSS; on CUDA the accelerator's
peak memory and utilisation); the worker puts it in the stats under `"resources"`, which
`merge_stats` leaves alone (it is per worker, not summable); `device_kind` names the worker's device.

Not here: derived metrics and the summary table (`pipeline.generate.summary`), logging them.
"""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

# Statistic fields summed over batches (lists element-wise). `iterations`: batched target calls (one
# forward of the target over every row in flight), where `target_calls` counts them per row.
# `predicted_seconds` (method=auto): the seconds the chooser predicted for the tokens of its iterations
# (each iteration's tokens over its predicted tokens/s for the configuration it chose); `wasted_seconds`: generation seconds whose tokens were not
# kept (the chooser measures on real iterations, so this is 0 unless it threw work away).
_SUMMED = (
    "predicted_seconds",
    "wasted_seconds",
    "iterations",
    "tested_positions",
    "draft_seconds",
    "target_seconds",
    "selection_seconds",
    "other_seconds",
    "wall_seconds",
    "compile_seconds",  # compiled mode (spectr.compile): seconds compiling, inside the phases' seconds
    "compile_fallbacks",  # compiled calls answered eagerly after a failure or a failed self-check (spectr.native)
    "prefilled_rows",  # admitted rows whose prompt ran through the models ...
    "shared_prefill_rows",  # ... and rows that copied the cache of the same prompt admitted with them (samples)
)
_SUMMED_LISTS = ("accepted_per_position", "tokens_per_call_histogram")
_SUMMED_DICTS = ("tokens_by_config", "seconds_by_config")  # method=auto: configuration label -> value


def empty_stats() -> dict[str, Any]:
    stats: dict[str, Any] = {name: 0.0 for name in _SUMMED}
    stats["tested_positions"] = 0
    stats["iterations"] = 0
    stats["compile_fallbacks"] = 0
    stats["prefilled_rows"] = 0
    stats["shared_prefill_rows"] = 0
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
    for name in _SUMMED_DICTS:
        if part.get(name):
            merged = dict(total.get(name) or {})
            for key, value in part[name].items():
                merged[key] = merged.get(key, 0) + value
            total[name] = merged
    if part.get("plan"):
        total["plan"] = part["plan"]  # the chooser's latest configuration (method="auto")
    if part.get("plan_choice"):
        total["plan_choice"] = part["plan_choice"]  # its method, num_drafts, draft_length
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
    if getattr(generation_stats, "plan", ""):  # method="auto": what the planner chose
        stats["plan"] = str(generation_stats.plan)
    return stats


def device_kind(device: str) -> str:
    """What a worker computes on, for people: `NVIDIA H200` on CUDA, `cpu` on CPU."""
    if not str(device).startswith("cuda"):
        return "cpu"
    try:
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    except (RuntimeError, AssertionError, ValueError) as err:  # no driver: say what it was meant to be
        return f"cuda ({type(err).__name__})"


def _peak_rss_mib() -> float:
    """This process's peak resident memory since it started (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


class ResourceMeter:
    """What one shard cost its worker process, measured from construction to `usage()`.

        meter = ResourceMeter(device)      # at the start of a shard
        stats["resources"] = meter.usage()  # at its end: a flat dict of floats (JSON-safe)

    Keys: `wall_s`, `cpu_s`, `cpu_utilization_percentage` (process CPU time / wall time, 100 = one core
    busy), `peak_rss_megabytes` (the process's peak since it started); on CUDA also
    `gpu_peak_memory_megabytes` (torch's peak allocation during the shard) and, when NVML answers,
    `gpu_utilization_percentage` (the device's utilisation at the end of the shard).
    """

    def __init__(self, device: str = "cpu"):
        self.device = str(device)
        self.started = time.perf_counter()
        self.cpu_started = time.process_time()
        if self._cuda():
            import torch

            torch.cuda.reset_peak_memory_stats(torch.device(self.device))

    def _cuda(self) -> bool:
        if not self.device.startswith("cuda"):
            return False
        import torch

        return torch.cuda.is_available()

    def usage(self) -> dict[str, float]:
        wall = max(time.perf_counter() - self.started, 1e-9)
        cpu = time.process_time() - self.cpu_started
        usage = {
            "wall_s": wall,
            "cpu_s": cpu,
            "cpu_utilization_percentage": 100.0 * cpu / wall,
            "peak_rss_megabytes": _peak_rss_mib(),
        }
        if self._cuda():
            usage.update(_cuda_usage(self.device))
        return usage


def _cuda_usage(device: str) -> dict[str, float]:
    import torch

    found = {"gpu_peak_memory_megabytes": torch.cuda.max_memory_allocated(torch.device(device)) / 2**20}
    try:
        found["gpu_utilization_percentage"] = float(torch.cuda.utilization(torch.device(device)))
    except Exception:  # noqa: BLE001 - NVML (pynvml) missing or unsupported: utilisation is optional
        pass
    return found
