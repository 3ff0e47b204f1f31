"""Typed, validated configuration of the benchmark job (`python -m jobs.benchmark`).

`bench_config_from_dict` turns the composed Hydra config (conf/benchmark.yaml: the main job's `model`,
`data` and `mlflow` groups plus the `bench` group) into a frozen `BenchConfig`, checking every key, type
and range, and raises `JobInputError` naming the key. The `model`, `data` and `mlflow` sections are
validated by the rules both jobs share (`pipeline.config.shared_sections`), so both accept the same values.

This module also expands the grid into the list of `BenchCase`s the runner measures. It does not load
models or time anything.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any

from pipeline.config import (
    DataConfig,
    MlflowConfig,
    ModelConfig,
    build_section,
    check_mapping,
    resolved_container,
    shared_sections,
)
from pipeline.errors import JobInputError

HF_GENERATE = "hf_generate"
HF_ASSISTED = "hf_assisted"
AUTO = "auto"  # the online chooser, per iteration (pipeline.benchmark.auto)
OUR_METHODS = ("autoregressive", "speculative", "block", "spectr", "specinfer", "traversal")
MULTI_DRAFT = ("spectr", "specinfer", "traversal")  # measured for K >= 2
METHODS = (HF_GENERATE, HF_ASSISTED, *OUR_METHODS[:-1])  # the default grid (traversal: when listed)
KNOWN_METHODS = (HF_GENERATE, HF_ASSISTED, *OUR_METHODS, AUTO)


@dataclass(frozen=True)
class OptimalityConfig:
    enabled: bool = True
    num_prompts: int = 8  # held-out prompts, taken after the benchmark prompts
    continuation_tokens: int = 48  # target-sampled tokens per prompt
    max_drafts: int = 8  # report K = 1..max_drafts


@dataclass(frozen=True)
class CostModelConfig:
    enabled: bool = True
    latency_repeats: int = 5
    latency_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    calibrate: bool = True  # time each configuration's forward shapes right after each of its runs
    calibration_repeats: int = 2


@dataclass(frozen=True)
class GridConfig:
    methods: tuple[str, ...] = METHODS
    num_drafts: tuple[int, ...] = (1, 2, 4, 8)
    draft_lengths: tuple[int, ...] = (2, 4, 8)
    batch_sizes: tuple[int, ...] = (1, 16)
    num_prompts: int = 4
    max_prompt_tokens: int = 64
    max_new_tokens: int = 32
    ignore_eos: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    repeats: int = 3
    warmup_tokens: int = 8
    assisted_tokens: int = 4
    memory_sample_ms: float = 10.0
    optimality: OptimalityConfig = OptimalityConfig()
    cost_model: CostModelConfig = CostModelConfig()


@dataclass(frozen=True)
class BenchConfig:
    model: ModelConfig
    data: DataConfig
    mlflow: MlflowConfig
    bench: GridConfig
    output_dir: str | None = None
    device: str = "auto"
    threads: int | None = None
    progress: bool = True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BenchCase:
    """One configuration of the grid: a method at one batch size (K, L = 0 where they do not apply)."""

    method: str
    batch_size: int
    num_drafts: int = 0
    draft_length: int = 0

    @property
    def label(self) -> str:
        if self.method in ("speculative", "block", *MULTI_DRAFT):
            return f"{self.method} K={self.num_drafts} L={self.draft_length} B={self.batch_size}"
        if self.method == HF_ASSISTED:
            return f"{self.method} L={self.draft_length} B={self.batch_size}"
        return f"{self.method} B={self.batch_size}"


def bench_config_from_omegaconf(cfg: Any) -> BenchConfig:
    """Resolve a composed OmegaConf/Hydra config and validate it into a `BenchConfig`."""
    return bench_config_from_dict(resolved_container(cfg))


def bench_config_from_dict(raw: dict[str, Any]) -> BenchConfig:
    check_mapping(raw, sorted(f.name for f in fields(BenchConfig)))
    for section in ("model", "data", "bench"):
        if not isinstance(raw.get(section), dict):
            raise JobInputError(f"config: missing section '{section}'")
    model, data, mlflow = shared_sections(raw["model"], raw["data"], raw.get("mlflow") or {})
    grid = _grid(raw["bench"])
    device = raw.get("device", "auto")
    if not isinstance(device, str) or not (device in ("auto", "cpu") or device.startswith("cuda")):
        raise JobInputError(f"config: device must be auto, cpu, cuda or cuda:N, got {device!r}")
    threads = raw.get("threads")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise JobInputError(f"config: threads must be an int >= 1 or null, got {threads!r}")
    output_dir = raw.get("output_dir")
    if output_dir is not None and (not isinstance(output_dir, str) or not output_dir.strip()):
        raise JobInputError(f"config: output_dir must be a directory or null, got {output_dir!r}")
    progress = raw.get("progress", True)
    if not isinstance(progress, bool):
        raise JobInputError(f"config: progress must be true or false, got {progress!r}")
    return BenchConfig(model, data, mlflow, grid, output_dir, device, threads, progress)


def _grid(raw: dict[str, Any]) -> GridConfig:
    """Keys and types by the dataclass annotations (`pipeline.config.build_section`), then the ranges here."""
    grid = build_section(GridConfig, raw, "bench", {"optimality": OptimalityConfig, "cost_model": CostModelConfig})
    for i, method in enumerate(grid.methods):
        if method not in KNOWN_METHODS:
            raise JobInputError(f"config: bench.methods[{i}] = {method!r} is not one of {', '.join(KNOWN_METHODS)}")
    grid = dataclasses.replace(
        grid,
        methods=tuple(dict.fromkeys(grid.methods)),
        num_drafts=_positive_set(grid.num_drafts, "bench.num_drafts"),
        draft_lengths=_positive_set(grid.draft_lengths, "bench.draft_lengths"),
        batch_sizes=_positive_set(grid.batch_sizes, "bench.batch_sizes"),
        cost_model=dataclasses.replace(
            grid.cost_model,
            latency_batch_sizes=_positive_set(
                grid.cost_model.latency_batch_sizes, "bench.cost_model.latency_batch_sizes"
            ),
        ),
    )
    _check_grid(grid)
    return grid


def _positive_set(values: tuple[int, ...], key: str) -> tuple[int, ...]:
    """Sorted distinct ints, each >= 1."""
    for i, value in enumerate(values):
        if value < 1:
            raise JobInputError(f"config: {key}[{i}] must be an int >= 1, got {value!r}")
    return tuple(sorted(set(values)))


def _check_grid(g: GridConfig) -> None:
    def bad(key: str, rule: str, value: Any) -> JobInputError:
        return JobInputError(f"config: bench.{key} must be {rule}, got {value!r}")

    for key in ("num_prompts", "max_prompt_tokens", "max_new_tokens", "repeats", "assisted_tokens"):
        if getattr(g, key) < 1:
            raise bad(key, ">= 1", getattr(g, key))
    for key in ("top_k", "seed", "warmup_tokens"):
        if getattr(g, key) < 0:
            raise bad(key, ">= 0", getattr(g, key))
    for key in ("num_prompts", "continuation_tokens", "max_drafts"):
        if getattr(g.optimality, key) < 1:
            raise bad(f"optimality.{key}", ">= 1", getattr(g.optimality, key))
    for key in ("latency_repeats", "calibration_repeats"):
        if getattr(g.cost_model, key) < 1:
            raise bad(f"cost_model.{key}", ">= 1", getattr(g.cost_model, key))
    if not math.isfinite(g.temperature) or g.temperature < 0:
        raise bad("temperature", "a finite number >= 0 (0 means greedy)", g.temperature)
    if not 0.0 < g.top_p <= 1.0:
        raise bad("top_p", "in (0, 1]", g.top_p)
    if not g.memory_sample_ms > 0:
        raise bad("memory_sample_ms", "> 0", g.memory_sample_ms)
    if g.temperature == 0 and set(MULTI_DRAFT) & set(g.methods) and max(g.num_drafts) > 1:
        # spectr.generate runs greedy decoding with one draft: the K drafts would all be the draft's argmax
        raise bad("temperature", "> 0 when spectr or specinfer run with K >= 2, or traversal (greedy decoding "
                  "uses K = 1)", 0.0)
    if g.temperature == 0 and HF_ASSISTED in g.methods:
        # assisted generation with do_sample=False is greedy matching, a different algorithm
        raise bad("temperature", "> 0 when hf_assisted is benchmarked (it is measured with sampling)", 0.0)


def expand_grid(g: GridConfig) -> list[BenchCase]:
    """The configurations to measure, in run order (per batch size: baselines first, then by L, K).

    K = 1 is speculative sampling for K-SEQ and SpecInfer, so it is measured once, as `speculative`, when
    `speculative` is listed or K = 1 is in the grid of spectr or specinfer; likewise traversal at K = 1 is
    block verification, measured as `block`; `spectr`, `specinfer` and `traversal` are measured for K >= 2.
    HF assisted generation runs at batch size 1 only (transformers 5 refuses larger batches) with
    L = `assisted_tokens`.
    """
    cases: list[BenchCase] = []
    multi = [m for m in MULTI_DRAFT if m in g.methods]
    one_draft = 1 in g.num_drafts
    want_speculative = "speculative" in g.methods or (one_draft and bool({"spectr", "specinfer"} & set(multi)))
    want_block = "block" in g.methods or (one_draft and "traversal" in multi)
    for batch in g.batch_sizes:
        if HF_GENERATE in g.methods:
            cases.append(BenchCase(HF_GENERATE, batch))
        if HF_ASSISTED in g.methods and batch == 1:
            cases.append(BenchCase(HF_ASSISTED, batch, 1, g.assisted_tokens))
        if "autoregressive" in g.methods:
            cases.append(BenchCase("autoregressive", batch))
        if AUTO in g.methods:  # bounded by the grid's largest K and L
            cases.append(BenchCase(AUTO, batch, max(g.num_drafts), max(g.draft_lengths)))
        for length in g.draft_lengths:
            if want_speculative:
                cases.append(BenchCase("speculative", batch, 1, length))
            if want_block:
                cases.append(BenchCase("block", batch, 1, length))
            for drafts in g.num_drafts:
                if drafts == 1:
                    continue
                for method in multi:
                    cases.append(BenchCase(method, batch, drafts, length))
    return cases
