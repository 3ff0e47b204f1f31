"""The benchmark job as the driver runs it: one process, one draft/target pair, every method, one run.

    report = run_benchmark(config)   # config: pipeline.benchmark.config.BenchConfig

1) load the pair and the prompts exactly as the main job does (`pipeline.models`, `pipeline.prompts`), cut
   each prompt to its last `max_prompt_tokens` tokens; the first prompts are the benchmark subset
   (batch size B runs ceil(num_prompts / B) batches of B of them), the next ones are the held-out
   prompts of the optimality analysis;
2) for each configuration of the grid (`expand_grid`; tqdm bar): one untimed warm-up run on the
   first batch with `warmup_tokens` new tokens (all warm-ups first), then `repeats` timed runs with
   seeds seed + 1000 r (`pipeline.benchmark.methods.run_case`), taken round-robin: repeat r of every configuration runs
   before repeat r + 1 of any, so a drift in the machine's speed spreads over all configurations
   instead of favouring the ones that ran in a quiet minute; tokens/s is the median over repeats,
   block efficiency and acceptance pool all repeats;
3) token-level optimality (`pipeline.benchmark.optimality`);
4) cost model: per-call latencies, then a prediction for every timed run (`spectr.planner`);
5) report (`pipeline.benchmark.report`, `tables`, `goals`, `plots`): printed table, Markdown, CSV, PNG plots, goals, benchmark.log,
   all logged to MLflow as artifacts of one run (`mlflow.enabled`).

The whole job runs in this process (no Ray): a benchmark wants one pair on one device and nothing else
running. It does not write generations anywhere; that is the main job.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from pipeline import models
from pipeline import prompts as io
from pipeline.benchmark.auto import AutoSummary, summarize
from pipeline.benchmark.config import AUTO, HF_ASSISTED, HF_GENERATE, BenchCase, BenchConfig, expand_grid
from pipeline.benchmark.methods import CaseRun, PeakMemory, SamplingSettings, run_case
from pipeline.benchmark.optimality import OptimalityResult, run_optimality
from pipeline.errors import JobInputError
from spectr.hf import HFCausalLM
from spectr.planner.latency import Calibrator, measure_latencies, pooled, prefill_latency
from spectr.planner.predict import Prediction, predict_seconds
from spectr.planner.table import (
    DRAFT,
    TARGET,
    BatchRun,
    LatencyTable,
    batch_context,
)
from spectr.warps import SamplingWarp

SEED_STRIDE = 1000  # repeat r seeds its rows from seed + SEED_STRIDE * r


@dataclass
class Pair:
    target: Any
    draft: Any
    tokenizer: Any
    eos_token_id: int | None
    pad_token_id: int
    device: torch.device


@dataclass
class CaseResult:
    """All timed runs of one configuration and what is derived from them."""

    case: BenchCase
    runs: list[CaseRun] = field(default_factory=list)
    error: str | None = None
    predictions: list[Prediction] = field(default_factory=list)
    context: int | None = None  # the cached context of its forwards in the cost model (case_context)
    speedup_vs_autoregressive: float | None = None
    speedup_vs_hf_generate: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.runs)

    @property
    def tokens_per_second(self) -> float:
        return statistics.median(r.tokens_per_second for r in self.runs) if self.runs else float("nan")

    @property
    def tokens_per_second_spread(self) -> tuple[float, float]:
        values = [r.tokens_per_second for r in self.runs]
        return (min(values), max(values)) if values else (float("nan"), float("nan"))

    @property
    def generated_tokens(self) -> int:
        return sum(r.generated_tokens for r in self.runs)

    @property
    def target_calls(self) -> int:
        return sum(r.target_calls for r in self.runs)

    @property
    def block_efficiency(self) -> float:
        calls = self.target_calls
        return self.generated_tokens / calls if calls else float("nan")

    @property
    def accepted_per_position(self) -> list[int]:
        total: list[int] = []
        for run in self.runs:
            total = (
                [a + b for a, b in zip(total, run.accepted_per_position)]
                if total
                else list(run.accepted_per_position)
            )
        return total

    @property
    def acceptance_per_position(self) -> list[float]:
        """P(position j accepted | position j tested): tested_0 = target calls, tested_j = accepted_{j-1}."""
        accepted = self.accepted_per_position
        tested = [self.target_calls, *accepted[:-1]]
        return [a / t if t else float("nan") for a, t in zip(accepted, tested)]

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / tested draft positions (the definition in docs/architecture.md)."""
        accepted = self.accepted_per_position
        if not accepted:
            return float("nan")
        tested = self.target_calls + sum(accepted[:-1])
        return sum(accepted) / tested if tested else float("nan")

    def _seconds(self, name: str) -> float:
        return sum(getattr(r, name) for r in self.runs)

    @property
    def time_split(self) -> dict[str, float]:
        """Fractions of the wall time over all repeats: draft, target, selection, other."""
        wall = self._seconds("wall_seconds")
        if not wall:
            return dict.fromkeys(("draft", "target", "selection", "other"), float("nan"))
        return {
            "draft": self._seconds("draft_seconds") / wall,
            "target": self._seconds("target_seconds") / wall,
            "selection": self._seconds("selection_seconds") / wall,
            "other": self._seconds("other_seconds") / wall,
        }

    @property
    def cpu_per_wall(self) -> float | None:
        """Process CPU time / wall time over all repeats (below the thread count: it waited for a CPU)."""
        wall = self._seconds("wall_seconds")
        return self._seconds("cpu_seconds") / wall if wall > 0 else None

    @property
    def peak_memory_bytes(self) -> int:
        return max((r.peak_memory_bytes for r in self.runs), default=0)

    @property
    def auto(self) -> AutoSummary | None:
        """Method auto: what the chooser ran, pooled over the timed runs (None for the other methods)."""
        return summarize(self.runs) if self.case.method == AUTO else None

    @property
    def predicted_tokens_per_second(self) -> float | None:
        """The cost model's prediction (None for auto: its chooser measures instead, `AutoSummary`)."""
        if not self.predictions:
            return None
        return statistics.median(
            p.tokens_per_second(r.generated_tokens) for p, r in zip(self.predictions, self.runs)
        )

    @property
    def prediction_error(self) -> float | None:
        """Median over repeats of (predicted - measured) / measured tokens/s, each repeat's prediction
        made from that repeat's own target calls and acceptance (so the two are paired)."""
        errors = [
            p.tokens_per_second(r.generated_tokens) / r.tokens_per_second - 1.0
            for p, r in zip(self.predictions, self.runs)
            if r.tokens_per_second
        ]
        return statistics.median(errors) if errors else None

    @property
    def predicted_split(self) -> dict[str, float] | None:
        if not self.predictions:
            return None
        total = sum(p.seconds for p in self.predictions)
        return {
            "draft": sum(p.draft_seconds for p in self.predictions) / total,
            "target": sum(p.target_seconds for p in self.predictions) / total,
            "selection": sum(p.selection_seconds for p in self.predictions) / total,
            "other": sum(p.other_seconds for p in self.predictions) / total,
        }


@dataclass
class BenchmarkReport:
    config: BenchConfig
    output_dir: Path
    results: list[CaseResult]
    optimality: OptimalityResult | None
    latencies: LatencyTable | None
    environment: dict[str, Any]
    phase_errors: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    goals: list[Any] = field(default_factory=list)  # pipeline.benchmark.goals.Goal
    text: str = ""
    run_id: str | None = None
    tracking_uri: str | None = None

    @property
    def exit_code(self) -> int:
        return 0 if all(r.ok for r in self.results) and not self.phase_errors else 1


# ---------------------------------------------------------------------------------------
# 1) pair and prompts
# ---------------------------------------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise JobInputError(f"device: {name} requested but CUDA is not available on this machine")
    return device


def load_pair(config: BenchConfig, device: torch.device) -> Pair:
    """The main job's checks (directories, vocabularies, identical tokenizers), then both models."""
    m = config.model
    target_dir, draft_dir, target_tok = models.check_pair(m)
    target = models.load_model(str(target_dir), m, str(device))
    draft = models.load_model(str(draft_dir), m, str(device))
    eos = models.eos_token_id_of(target, target_tok)
    pad = target_tok.pad_token_id if target_tok.pad_token_id is not None else (eos if eos is not None else 0)
    return Pair(target, draft, target_tok, eos, int(pad), device)


def prompt_counts(config: BenchConfig) -> tuple[int, int]:
    """(benchmark prompts, optimality prompts) the configuration needs."""
    g = config.bench
    bench = max(math.ceil(g.num_prompts / b) * b for b in g.batch_sizes)
    return bench, g.optimality.num_prompts if g.optimality.enabled else 0


def load_prompts(config: BenchConfig, tokenizer: Any) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of the benchmark prompts and of the held-out optimality prompts (disjoint)."""
    table = io.read_prompts(config.data)
    texts = models.render_prompts(tokenizer, config.data, table.prompts, table.messages)
    needed_bench, needed_optimality = prompt_counts(config)
    if len(texts) < needed_bench + needed_optimality:
        raise JobInputError(
            f"data: {config.data.path} gives {len(texts)} prompt(s) (data.limit={config.data.limit}), but the "
            f"benchmark needs {needed_bench} (bench.num_prompts={config.bench.num_prompts}, batch sizes "
            f"{list(config.bench.batch_sizes)}) + {needed_optimality} (bench.optimality.num_prompts)"
        )
    texts = texts[: needed_bench + needed_optimality]
    token_ids = models.tokenize(tokenizer, texts, config.data.add_special_tokens)
    keep = config.bench.max_prompt_tokens
    for row, ids in enumerate(token_ids):
        if not ids:
            raise JobInputError(f"data: prompt {row} ({table.ids[row]!r}) tokenizes to no tokens")
    token_ids = [ids[-keep:] for ids in token_ids]
    return token_ids[:needed_bench], token_ids[needed_bench:]


def batches_for(prompts: list[list[int]], batch_size: int, num_prompts: int) -> list[list[list[int]]]:
    count = math.ceil(num_prompts / batch_size)
    return [prompts[i * batch_size : (i + 1) * batch_size] for i in range(count)]


# ---------------------------------------------------------------------------------------
# 2)-4) measurements
# ---------------------------------------------------------------------------------------


def sampling_settings(config: BenchConfig, pair: Pair, max_new_tokens: int | None = None) -> SamplingSettings:
    g = config.bench
    return SamplingSettings(
        max_new_tokens=max_new_tokens or g.max_new_tokens,
        temperature=g.temperature,
        top_k=g.top_k,
        top_p=g.top_p,
        eos_token_id=None if g.ignore_eos else pair.eos_token_id,
        pad_token_id=pair.pad_token_id,
        assisted_tokens=g.assisted_tokens,
        memory_sample_ms=g.memory_sample_ms,
    )


def measure_cases(
    config: BenchConfig, pair: Pair, cases: list[BenchCase], batches_of, calibrator: Calibrator | None = None,
    on_run=None,
) -> list[CaseResult]:
    """Warm-ups, then the timed repeats round-robin (repeat r of every configuration before any r + 1);
    after each timed run of our methods, the cost model's calibration. A configuration that fails is
    reported with its error and skipped from then on; the others go on.

    batches_of(case): the prompt batches of a configuration; on_run(case): called after each run."""
    g = config.bench
    results = [CaseResult(case) for case in cases]

    def attempt(result: CaseResult, action) -> None:
        try:
            if result.error is None:
                action()
        except (RuntimeError, ValueError, MemoryError) as err:  # one failed configuration does not end the run
            result.error = f"{type(err).__name__}: {err}"
            result.runs = []
        if on_run is not None:
            on_run(result.case)

    if g.warmup_tokens > 0:
        warmup = sampling_settings(config, pair, g.warmup_tokens)
        for r in results:
            attempt(r, lambda r=r: run_case(pair, r.case, batches_of(r.case)[:1], warmup, g.seed))
    settings = sampling_settings(config, pair)
    for repeat in range(g.repeats):
        for r in results:

            def timed(r=r, repeat=repeat):
                batches = batches_of(r.case)
                run = run_case(pair, r.case, batches, settings, g.seed + SEED_STRIDE * repeat)
                if calibrator is not None and r.case.method not in (HF_GENERATE, HF_ASSISTED, AUTO):
                    run.calibration = calibrator.measure(r.case, case_context(config, batches))
                r.runs.append(run)

            attempt(r, timed)
    return results


def attach_speedups(results: list[CaseResult]) -> None:
    baseline: dict[tuple[str, int], float] = {}
    for r in results:
        if r.ok and r.case.method in ("autoregressive", HF_GENERATE):
            baseline[(r.case.method, r.case.batch_size)] = r.tokens_per_second
    for r in results:
        if not r.ok:
            continue
        ours = baseline.get(("autoregressive", r.case.batch_size))
        hf = baseline.get((HF_GENERATE, r.case.batch_size))
        r.speedup_vs_autoregressive = r.tokens_per_second / ours if ours else None
        r.speedup_vs_hf_generate = r.tokens_per_second / hf if hf else None


def case_context(config: BenchConfig, batches) -> int:
    """The cached context a configuration's forwards attend, averaged over its batches (`batch_context`)."""
    return round(statistics.mean(batch_context(b, config.bench.max_new_tokens) for b in batches))


def attach_predictions(
    config: BenchConfig, pair: Pair, results: list[CaseResult], bench_prompts, on_step=None
) -> LatencyTable:
    """Measure the latencies the cost model needs, then predict every timed run of our methods."""
    g = config.bench
    ours = [r for r in results if r.ok and r.case.method not in (HF_GENERATE, HF_ASSISTED, AUTO)]
    target_lm, draft_lm = HFCausalLM(pair.target, role="target"), HFCausalLM(pair.draft, role="draft")
    batch_sizes = sorted(
        {b for b in g.cost_model.latency_batch_sizes if b <= max(g.batch_sizes)} | set(g.batch_sizes)
    )
    shapes = _batch_shapes(config, ours, bench_prompts)
    for r in ours:
        r.context = case_context(config, [b for b, _ in shapes[r.case]])
    table = measure_latencies(
        target_lm,
        draft_lm,
        [r.case for r in ours],
        batch_sizes,
        {r.context for r in ours},
        SamplingWarp(g.temperature, g.top_k, g.top_p),
        g.cost_model.latency_repeats,
        on_step,
    )
    prefills = _PrefillLatencies(table, g.cost_model.latency_repeats)
    for r in ours:
        speculative = r.case.method != "autoregressive"
        batch_prefills = [
            (prefills.of(TARGET, target_lm, b), prefills.of(DRAFT, draft_lm, b) if speculative else 0.0)
            for b, _ in shapes[r.case]
        ]
        r.predictions = _predict_runs(table, r, batch_prefills, shapes[r.case])
    return table


def _batch_shapes(config: BenchConfig, ours: list[CaseResult], bench_prompts) -> dict:
    """case -> per batch: (its prompts, context)."""
    g = config.bench
    return {r.case: [(batch, batch_context(batch, g.max_new_tokens))
                     for batch in batches_for(bench_prompts, r.case.batch_size, g.num_prompts)] for r in ours}


class _PrefillLatencies:
    """Prefill latency of each (model, batch of prompts), measured once and added to the table."""

    def __init__(self, table: LatencyTable, repeats: int):
        self.table, self.repeats = table, repeats
        self.cache: dict[tuple[str, tuple], float] = {}

    def of(self, role: str, model: HFCausalLM, batch) -> float:
        key = (role, tuple(map(tuple, batch)))
        if key not in self.cache:
            self.cache[key] = prefill_latency(model, batch, self.repeats)
            self.table.add(f"prefill_{role}", len(batch), (max(len(p) for p in batch) - 1,), self.cache[key])
        return self.cache[key]


def _predict_runs(table: LatencyTable, r: CaseResult, batch_prefills, shapes) -> list[Prediction]:
    calibration = pooled(run.calibration for run in r.runs)
    return [
        predict_seconds(
            table,
            r.case.method,
            r.case.num_drafts,
            r.case.draft_length,
            [
                BatchRun(calls, prefill, context)
                for calls, prefill, (_, context) in zip(run.row_target_calls, batch_prefills, shapes)
            ],
            run.tokens_per_call_histogram,
            calibration=calibration,
            batch_size=r.case.batch_size,
            calibration_context=r.context,
        )
        for run in r.runs
    ]


def environment(config: BenchConfig, device: torch.device, started: float) -> dict[str, Any]:
    import os
    import platform

    import transformers

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_average_at_start": round(load[0], 2),
        "started_utc": datetime.fromtimestamp(started, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "memory_kind": PeakMemory(device, 1.0).kind,
    }


def run_benchmark(config: BenchConfig, command: str | None = None) -> BenchmarkReport:
    """The whole job (see the module docstring). Raises JobInputError for bad input before measuring."""
    from pipeline.benchmark.report import write_report
    from pipeline.benchmark.tracking import make_tracker

    started = time.time()
    device = resolve_device(config.device)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    env = environment(config, device, started)
    env["command"] = command or "python -m jobs.benchmark"
    pair = load_pair(config, device)
    bench_prompts, optimality_prompts = load_prompts(config, pair.tokenizer)
    output_dir = _output_dir(config)
    output_dir.mkdir(parents=True, exist_ok=True)
    tracker = make_tracker(config)
    tracker.start(config)
    try:
        results = _run_grid(config, pair, bench_prompts)
        attach_speedups(results)
        optimality, latencies, phase_errors = _run_analyses(config, pair, results, bench_prompts, optimality_prompts)
        env["wall_minutes"] = round((time.time() - started) / 60.0, 2)
        env["load_average_at_end"] = round(__import__("os").getloadavg()[0], 2)
        report = BenchmarkReport(config, output_dir, results, optimality, latencies, env, phase_errors=phase_errors)
        write_report(report)
        tracker.finish(report)
    except BaseException:
        tracker.fail()
        raise
    report.run_id, report.tracking_uri = tracker.run_id, tracker.tracking_uri
    return report


def _output_dir(config: BenchConfig) -> Path:
    default = f"runs/benchmark-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}"
    return Path(config.output_dir or default).expanduser().resolve()


def _run_grid(config: BenchConfig, pair: Pair, bench_prompts: list[list[int]]) -> list[CaseResult]:
    """Every configuration of the grid, timed round-robin, with a progress bar over runs."""
    from tqdm.auto import tqdm

    g = config.bench
    cases = expand_grid(g)
    calibrator = None
    if g.cost_model.enabled and g.cost_model.calibrate:
        calibrator = Calibrator(HFCausalLM(pair.target, role="target"), HFCausalLM(pair.draft, role="draft"),
                                g.cost_model.calibration_repeats)
    runs_per_case = g.repeats + (1 if g.warmup_tokens > 0 else 0)
    bar = tqdm(total=len(cases) * runs_per_case, desc="runs (round-robin over configurations)", unit="run",
               disable=not config.progress, dynamic_ncols=True)

    def on_run(case: BenchCase) -> None:
        bar.set_postfix_str(case.label)
        bar.update(1)

    def batches_of(case: BenchCase):
        return batches_for(bench_prompts, case.batch_size, g.num_prompts)

    try:
        results = measure_cases(config, pair, cases, batches_of, calibrator, on_run)
    finally:
        bar.close()
    return results


def _run_analyses(config: BenchConfig, pair: Pair, results: list[CaseResult], bench_prompts, optimality_prompts):
    """(optimality, latency table, errors). They come after the grid: a failure in one is reported
    (exit 1), not allowed to lose the grid."""
    g = config.bench
    phase_errors: list[str] = []
    optimality = None
    if g.optimality.enabled:
        try:
            optimality = run_optimality(
                pair.target, pair.draft, optimality_prompts, g.optimality.continuation_tokens,
                SamplingWarp(g.temperature, g.top_k, g.top_p), g.seed, g.optimality.max_drafts,
            )
        except (RuntimeError, ValueError) as err:
            phase_errors.append(f"optimality analysis failed: {type(err).__name__}: {err}")
    latencies = None
    if g.cost_model.enabled and any(r.ok and r.case.method not in (HF_GENERATE, HF_ASSISTED, AUTO) for r in results):
        try:
            latencies = attach_predictions(config, pair, results, bench_prompts)
        except (RuntimeError, ValueError, KeyError) as err:
            phase_errors.append(f"cost model failed: {type(err).__name__}: {err}")
            for r in results:
                r.predictions = []
    return optimality, latencies, phase_errors
