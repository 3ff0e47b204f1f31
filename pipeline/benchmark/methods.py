"""Run one benchmark configuration once: our engine or a Hugging Face baseline, timed, with its stats.

`run_case(pair, case, batches, settings, seed_base)` generates for every batch of prompts with one
method and returns a `CaseRun`: wall time, generated tokens, target calls per row, accepted tokens per
draft position, the time split and the peak memory. The three kinds of runner share that result:

- ours (`autoregressive`, `speculative`, `spectr`, `specinfer`, and `auto`, whose chooser picks each
  iteration's configuration, `pipeline.benchmark.auto`): `spectr.generate`, whose stats give
  the time split (draft / target / selection; other = wall - the three) and the acceptance counts;
- `hf_generate`: `target.generate(do_sample=True, top_k=0, ...)` on the left-padded batch;
- `hf_assisted`: `target.generate(assistant_model=draft, ...)` with a constant schedule of
  `assisted_tokens` draft tokens and the confidence-threshold early stop turned off; batch size 1 only
  (transformers 5 raises for larger batches). HF uses the global torch RNG: it is seeded per batch
  inside `torch.random.fork_rng`, so the caller's global RNG is left alone.

For the HF runs the target calls are counted with a forward hook (every target forward yields tokens
there: the prompt forward gives the first one), so their block efficiency is measured too; their time
is not split (reported as all "other").

Peak memory: on CUDA, `torch.cuda.max_memory_allocated` after a reset (tensors only); on CPU the
whole process's resident set size sampled every `memory_sample_ms` by a thread (`/proc/self/statm`),
the max over the run. This module does not choose the grid, repeat runs or report.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import spectr
from pipeline.benchmark.auto import AutoRun
from pipeline.benchmark.config import AUTO, HF_ASSISTED, HF_GENERATE, BenchCase
from spectr.planner.auto import generate_auto


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    eos_token_id: int | None  # None: generate exactly max_new_tokens (ignore_eos)
    pad_token_id: int
    assisted_tokens: int = 4
    memory_sample_ms: float = 10.0


@dataclass
class CaseRun:
    """One timed run of a configuration over all its batches."""

    wall_seconds: float = 0.0
    generated_tokens: int = 0
    row_target_calls: list[list[int]] = field(default_factory=list)  # per batch, per row
    accepted_per_position: list[int] = field(default_factory=list)
    tokens_per_call_histogram: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    selection_seconds: float = 0.0
    peak_memory_bytes: int = 0
    draft_calls: int = 0  # HF assisted: draft forwards (ours: L per iteration, not counted here)
    cpu_seconds: float = 0.0  # process CPU time (all threads) during the run; cpu/wall shows contention
    calibration: dict = field(default_factory=dict)  # the cost model's forward latencies right after this run
    auto: AutoRun | None = None  # method auto: what the chooser ran (pipeline.benchmark.auto)

    @property
    def target_calls(self) -> int:
        return sum(sum(rows) for rows in self.row_target_calls)

    @property
    def other_seconds(self) -> float:
        return max(0.0, self.wall_seconds - self.draft_seconds - self.target_seconds - self.selection_seconds)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0


class PeakMemory:
    """Peak memory over a `with` block: CUDA max allocated, or the process RSS sampled by a thread."""

    def __init__(self, device: torch.device, sample_ms: float):
        self.device = device
        self.sample_seconds = sample_ms / 1000.0
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def kind(self) -> str:
        return "cuda_max_allocated" if self.device.type == "cuda" else "process_peak_rss"

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.peak_bytes = current_rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.sample_seconds):
            self.peak_bytes = max(self.peak_bytes, current_rss_bytes())

    def __exit__(self, *exc) -> bool:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
        else:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self.peak_bytes, current_rss_bytes())
        return False


def current_rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; falls back to ru_maxrss elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def run_case(
    pair: Any,
    case: BenchCase,
    batches: Sequence[Sequence[Sequence[int]]],
    settings: SamplingSettings,
    seed_base: int,
) -> CaseRun:
    """Generate for every batch with `case.method`; batch i, row j is seeded `seed_base + i*B + j`.

    pair: an object with `.target` and `.draft` (Hugging Face causal LMs on one device).
    """
    device = next(pair.target.parameters()).device
    run = CaseRun()
    with PeakMemory(device, settings.memory_sample_ms) as memory:
        start, cpu_start = time.perf_counter(), time.process_time()
        for index, prompts in enumerate(batches):
            seeds = [seed_base + index * case.batch_size + row for row in range(len(prompts))]
            if case.method == HF_GENERATE:
                _hf_batch(pair.target, None, prompts, settings, seeds[0], run)
            elif case.method == HF_ASSISTED:
                _hf_batch(pair.target, pair.draft, prompts, settings, seeds[0], run)
            else:
                _ours_batch(pair, case, prompts, settings, seeds, run)
        _sync(device)
        run.wall_seconds = time.perf_counter() - start
        run.cpu_seconds = time.process_time() - cpu_start
    run.peak_memory_bytes = memory.peak_bytes
    return run


def _ours_batch(
    pair, case: BenchCase, prompts, settings: SamplingSettings, seeds: list[int], run: CaseRun
) -> None:
    if case.method == AUTO:
        output = _auto_batch(pair, case, prompts, settings, seeds, run)
    else:
        output = spectr.generate(
            pair.target, None if case.method == "autoregressive" else pair.draft, prompts, method=case.method,
            num_drafts=max(case.num_drafts, 1), draft_length=max(case.draft_length, 1),
            max_new_tokens=settings.max_new_tokens, temperature=settings.temperature, top_k=settings.top_k,
            top_p=settings.top_p, eos_token_id=settings.eos_token_id, seed=seeds,
        )  # fmt: skip
    stats = output.stats
    run.generated_tokens += stats.total_generated_tokens
    run.row_target_calls.append(list(stats.target_calls))
    run.accepted_per_position = _add(run.accepted_per_position, stats.accepted_per_position)
    run.tokens_per_call_histogram = _add(run.tokens_per_call_histogram, stats.tokens_per_call_histogram)
    run.draft_seconds += stats.draft_seconds
    run.target_seconds += stats.target_seconds
    run.selection_seconds += stats.selection_seconds


def _auto_batch(pair, case: BenchCase, prompts, settings: SamplingSettings, seeds: list[int], run: CaseRun):
    """`auto` on one batch (`pipeline.benchmark.auto`): K <= case.num_drafts, L <= case.draft_length, the
    chooser starting from the previous batch's of this run."""
    if run.auto is None:
        run.auto = AutoRun()
    output = generate_auto(
        pair.target, pair.draft, prompts, num_drafts=max(case.num_drafts, 1), draft_length=max(case.draft_length, 1),
        max_new_tokens=settings.max_new_tokens, temperature=settings.temperature, top_k=settings.top_k,
        top_p=settings.top_p, eos_token_id=settings.eos_token_id, seed=seeds, warm_state=run.auto.state,
    )  # fmt: skip
    run.auto.add(output.chooser)
    return output


def _add(total: list[int], part: Sequence[int]) -> list[int]:
    if not total:
        return list(part)
    return [a + b for a, b in zip(total, part)]


class _CallCounter:
    """Counts forward calls of a module (a forward pre-hook), removed on exit."""

    def __init__(self, module: torch.nn.Module | None):
        self.module, self.calls, self.handle = module, 0, None

    def __enter__(self) -> _CallCounter:
        if self.module is not None:
            self.handle = self.module.register_forward_pre_hook(self._count)
        return self

    def _count(self, module, args) -> None:
        self.calls += 1

    def __exit__(self, *exc) -> bool:
        if self.handle is not None:
            self.handle.remove()
        return False


def hf_generation_kwargs(settings: SamplingSettings, assistant: Any | None) -> dict[str, Any]:
    """The `generate` arguments of the HF baselines (sampling with top_k=0 means no top-k)."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=settings.temperature > 0,
        temperature=settings.temperature if settings.temperature > 0 else None,
        top_k=settings.top_k if settings.temperature > 0 else None,
        top_p=settings.top_p if settings.temperature > 0 else None,
        max_new_tokens=settings.max_new_tokens,
        eos_token_id=settings.eos_token_id,
        pad_token_id=settings.pad_token_id,
    )
    kwargs: dict[str, Any] = {"generation_config": config}
    if assistant is not None:
        config.num_assistant_tokens = settings.assisted_tokens
        config.num_assistant_tokens_schedule = "constant"
        config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = assistant
    return kwargs


def configure_assistant(draft: Any, settings: SamplingSettings) -> None:
    """The assistant reads its schedule from its own generation config: constant L, no early stop."""
    draft.generation_config.num_assistant_tokens = settings.assisted_tokens
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0


def _hf_batch(target, assistant, prompts, settings: SamplingSettings, seed: int, run: CaseRun) -> None:
    if assistant is not None and len(prompts) != 1:
        raise ValueError(
            f"hf_assisted runs at batch size 1 only (transformers 5), got a batch of {len(prompts)}"
        )
    device = next(target.parameters()).device
    width = max(len(p) for p in prompts)
    input_ids = torch.full(
        (len(prompts), width), settings.pad_token_id, dtype=torch.int64
    )  # [B, P] left-padded
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.int64)  # [B, P]
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    if assistant is not None:
        configure_assistant(assistant, settings)
    kwargs = hf_generation_kwargs(settings, assistant)
    models = [target] if assistant is None else [target, assistant]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.inference_mode(), \
            _quiet_transformers(), _eos_override(models, settings.eos_token_id):
        torch.manual_seed(seed)
        with _CallCounter(target) as target_counter, _CallCounter(assistant) as draft_counter:
            sequences = target.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **kwargs
            )  # [B, P + N]
    new_tokens = sequences[:, width:].tolist()
    generated = [_cut_at_eos(row, settings.eos_token_id, settings.pad_token_id) for row in new_tokens]
    run.generated_tokens += sum(generated)
    # The HF loop runs the whole batch until every row is done; rows share the calls.
    run.row_target_calls.append([target_counter.calls] * len(prompts))
    run.draft_calls += draft_counter.calls


class _eos_override:
    """HF fills an unset (None) eos_token_id from the model's generation config; with ignore_eos the
    models' own EOS must be unset for the call, so every row generates max_new_tokens like ours."""

    def __init__(self, models, eos_token_id: int | None):
        self.models, self.eos_token_id = models, eos_token_id

    def __enter__(self):
        self.saved = [m.generation_config.eos_token_id for m in self.models]
        for m in self.models:
            m.generation_config.eos_token_id = self.eos_token_id

    def __exit__(self, *exc) -> bool:
        for m, eos in zip(self.models, self.saved):
            m.generation_config.eos_token_id = eos
        return False


class _quiet_transformers:
    """transformers warns on every assisted call that its own assistant passes generation_config plus kwargs."""

    def __enter__(self):
        from transformers.utils import logging as hf_logging

        self.level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()

    def __exit__(self, *exc) -> bool:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(self.level)
        return False


def _cut_at_eos(tokens: list[int], eos_token_id: int | None, pad_token_id: int) -> int:
    """Generated tokens of one HF row: up to and including the first EOS (later ones are padding)."""
    if eos_token_id is None:
        return len(tokens)
    for position, token in enumerate(tokens):
        if token == eos_token_id:
            return position + 1
    return len(tokens)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
