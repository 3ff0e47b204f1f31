"""The stateful predictor each Ray actor runs: load the pair once, then turn shards into part files.

`ShardGenerator(model, spectr, num_threads, device, on_batch, job)` loads the target, the draft and the
target's tokenizer in `__init__`. For the job, `generate_shard(task)` does all the row work of one shard on
the worker: it reads the shard's rows from the input (`pipeline.generate.shards.load_shard`), renders chat
messages and tokenizes, generates, and writes the part file to the output filesystem itself; it returns
only a `ShardResult` of statistics, the file's name, size and row count (never the rows). `__call__(shard)`
is the in-memory core (a `Shard` in, contract rows out) that tests call directly without Ray;
`pipeline.generate.scheduler` wraps the class with `ray.remote`.

A batch that fails (e.g. one prompt too long for the model makes `spectr.generate` raise for the whole
batch) is retried row by row, so that the good rows complete and only the bad rows are written with
`finish_reason="error"` and the message; a row the input reading already found unusable (a null prompt,
malformed chat messages) is written the same way without being generated. This class does not talk to
MLflow.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.config import DataConfig, ModelConfig
from pipeline.generate.config import SpectrConfig
from pipeline.generate.shards import Shard, ShardTask, load_shard
from pipeline.generate.stats import ResourceMeter, device_kind, empty_stats, merge_stats, stats_of
from pipeline.source import Source

log = logging.getLogger(__name__)

AUTO_MAX_DRAFTS = 8  # method=auto: the planner's bounds when spectr.max_num_drafts / max_draft_length are null
AUTO_MAX_LENGTH = 8


@dataclass
class ShardResult:
    index: int
    rows: list[dict[str, Any]] | None  # only from `__call__`; the job's results carry no rows
    stats: dict[str, Any]  # see `empty_stats`
    worker: dict[str, Any] = field(default_factory=dict)  # node, pid, device: where it ran
    num_rows: int = 0
    failed: int = 0  # rows with finish_reason=error
    file: str = ""  # the part file's name in the output directory
    bytes: int = 0  # and its size


@dataclass(frozen=True)
class WorkerJob:
    """What a worker needs to read and write shards itself (sent once, when the actor starts)."""

    data: DataConfig
    source: Source
    output_uri: str
    part_digits: int
    schema: Any  # pyarrow.Schema of the part files, with the run's settings in its metadata


PLAN_METADATA_KEY = b"spectr.plan"


def with_plan(schema: Any, plan: dict[str, Any] | None) -> Any:
    """The part file's schema, with the planner's choice (method=auto) under `spectr.plan` when there is one."""
    if plan is None:
        return schema
    import json

    return schema.with_metadata({**(schema.metadata or {}), PLAN_METADATA_KEY: json.dumps(plan).encode()})


class ShardGenerator:
    """Holds one draft/target pair; turns a shard into output rows (and, for the job, a part file)."""

    def __init__(
        self,
        model: ModelConfig,
        spectr: SpectrConfig,
        num_threads: int | None = None,
        device: str | None = None,
        on_batch: Any = None,
        job: WorkerJob | None = None,
    ):
        """on_batch(shard_index, rows): called after each batch of a shard (the driver's progress bar);
        an exception in it is logged and ignored: progress must never fail generation.
        job: what `generate_shard` needs (the pool sends it with each shard instead, by reference)."""
        import torch

        from pipeline import models
        from pipeline.prompts import ReadCache

        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu" and num_threads:
            torch.set_num_threads(int(num_threads))
        self.device = device
        self.spectr = spectr
        self.on_batch = on_batch
        self.job = job
        self._job_ref: Any = None
        self.cache = ReadCache()
        self.tokenizer = models.load_tokenizer(
            models.check_model_dir(model.target, "model.target", model.allow_pickle),
            "model.target",
            model.trust_remote_code,
        )
        self.target = models.load_model(model.target, model, device)
        self.draft = models.load_model(model.draft, model, device)
        self.eos_token_id = models.eos_token_ids_of(self.target, self.tokenizer)  # every EOS id
        self.planner: Any = None  # method=auto: calibrated on the first batch (spectr.planner)
        self.calibration_s = 0.0

    def ready(self) -> dict[str, Any]:
        """Where this generator runs (called once so that load errors surface before any shard)."""
        import socket

        import ray
        import torch

        node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        return {
            "host": socket.gethostname(),
            "node_id": node_id,
            "pid": os.getpid(),
            "device": self.device,
            "device_kind": device_kind(self.device),
            "torch_threads": torch.get_num_threads(),
        }

    def ping(self) -> float:
        """The heartbeat the driver polls (in its own concurrency group, so it answers mid-shard)."""
        return time.time()

    def generate_shard(self, task: ShardTask, job_ref: list[Any] | None = None) -> ShardResult:
        """Read, generate and write one shard; return its statistics and the part file's name and size.

        job_ref: [ObjectRef of the WorkerJob] (nested, so that Ray passes the reference, not the object):
        fetched from the object store once per actor process, a restarted one included."""
        from pipeline import fs
        from pipeline.generate.output import write_shard

        if job_ref is not None and job_ref[0] != self._job_ref:
            import ray

            self.job, self._job_ref = ray.get(job_ref[0]), job_ref[0]
        job = self.job
        if job is None:
            raise RuntimeError(
                "ShardGenerator.generate_shard needs a `job` (at construction or with the shard)"
            )
        shard = load_shard(task, job.source, self.tokenizer, job.data, self.spectr.seed, self.cache)
        result = self(shard)
        output = fs.resolve(job.output_uri, "output_dir")
        schema = with_plan(job.schema, self.plan_record())  # method=auto: this shard's choice in its metadata
        result.file, result.bytes = write_shard(output, task.index, result.rows, schema, job.part_digits)
        result.rows = None  # the driver gets statistics only
        return result

    def __call__(self, shard: Shard) -> ShardResult:
        started = time.perf_counter()
        meter = ResourceMeter(self.device)
        stats = empty_stats()
        by_position: dict[int, dict[str, Any]] = {}
        for i in range(len(shard)):
            if shard.problem(i):
                by_position[i] = self._error_row(shard, i, shard.problem(i))
        usable = [i for i in range(len(shard)) if i not in by_position]
        batch_size = self.spectr.batch_size
        for start in range(0, len(usable), batch_size):
            batch = usable[start : start + batch_size]
            for i, row in zip(batch, self._generate_batch(shard, batch, stats)):
                by_position[i] = row
            self._report_batch(shard.index, len(batch))
        rows = [by_position[i] for i in range(len(shard))]
        stats["prompts_failed"] = sum(row["finish_reason"] == "error" for row in rows)
        stats["prompts_completed"] = len(rows) - stats["prompts_failed"]
        stats["shard_seconds"] = time.perf_counter() - started
        stats["resources"] = meter.usage()  # per worker, not summed (merge_stats leaves it alone)
        if self.planner is not None:
            stats["plan"] = self.planner.plan.describe()
        return ShardResult(
            index=shard.index,
            rows=rows,
            stats=stats,
            worker=self.ready(),
            num_rows=len(rows),
            failed=stats["prompts_failed"],
        )

    def _report_batch(self, shard_index: int, rows: int) -> None:
        if self.on_batch is None:
            return
        try:
            self.on_batch(shard_index, rows)
        except Exception as err:  # noqa: BLE001 - progress is best effort
            log.warning("progress report failed (%s: %s); generation goes on", type(err).__name__, err)

    def _generate_batch(
        self, shard: Shard, positions: list[int], stats: dict[str, Any]
    ) -> list[dict[str, Any]]:
        import spectr

        s = self.spectr
        prompts = [shard.prompt_token_ids[i] for i in positions]
        seeds = [shard.seeds[i] for i in positions]
        try:
            if s.method == "auto":
                output = self._generate_auto(prompts, seeds)
            else:
                output = spectr.generate(
                    self.target,
                    self.draft,
                    prompts,
                    method=s.method,
                    num_drafts=s.num_drafts,
                    draft_length=s.draft_length,
                    max_new_tokens=s.max_new_tokens,
                    temperature=s.temperature,
                    top_k=s.top_k,
                    top_p=s.top_p,
                    eos_token_id=self.eos_token_id,
                    seed=seeds,
                )
        except Exception as err:  # noqa: BLE001 - isolated below: only the failing rows get an error row
            if len(positions) == 1:
                return [self._error_row(shard, positions[0], f"{type(err).__name__}: {err}")]
            rows = []
            for i in positions:  # a row's output does not depend on its batch, so this loses nothing
                rows.extend(self._generate_batch(shard, [i], stats))
            return rows
        merge_stats(stats, stats_of(output.stats))
        return [self._row(shard, i, output, j) for j, i in enumerate(positions)]

    def _generate_auto(self, prompts: list[list[int]], seeds: list[int]) -> Any:
        """method=auto: calibrate the planner on the first batch (once per actor), generate with its choice,
        and let it re-plan when the measured acceptance or the batch's occupancy drifts."""
        from spectr.planner.auto import auto_planner, generate_auto
        from spectr.warps import SamplingWarp

        s = self.spectr
        bounds = dict(num_drafts=s.max_num_drafts or AUTO_MAX_DRAFTS, draft_length=s.max_draft_length or AUTO_MAX_LENGTH)
        if self.planner is None:
            self.planner, calibration = auto_planner(
                self.target, self.draft, prompts, batch_size=s.batch_size,
                warp=SamplingWarp(s.temperature, s.top_k, s.top_p), seed=s.seed,
                max_num_drafts=bounds["num_drafts"], max_draft_length=bounds["draft_length"],
            )
            self.calibration_s = calibration.seconds
            log.info("%s (calibration %.1f s)", self.planner.plan.describe(), calibration.seconds)
        choice = self.planner.choice
        output = generate_auto(
            self.target, self.draft, prompts, planner=self.planner, max_new_tokens=s.max_new_tokens,
            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, eos_token_id=self.eos_token_id, seed=seeds,
            **bounds,
        )
        stats = output.stats
        self.planner.observe(choice, stats.accepted_per_position, stats.total_target_calls, len(prompts))
        return output

    def plan_record(self) -> dict[str, Any] | None:
        """method=auto: the planner's current choice and prediction (None before it has run)."""
        if self.planner is None:
            return None
        best = self.planner.plan.best
        return {
            "method": best.candidate.method,
            "num_drafts": best.candidate.num_drafts,
            "draft_length": best.candidate.draft_length,
            "predicted_tokens_per_s": best.tokens_per_second,
            "predicted_speedup_vs_autoregressive": self.planner.plan.speedup,
            "calibration_s": self.calibration_s,
            "replans": self.planner.replans,
            "description": self.planner.plan.describe(),
        }

    def _row(self, shard: Shard, i: int, output: Any, j: int) -> dict[str, Any]:
        per_row = output.stats
        tokens = [int(t) for t in output.tokens[j]]
        calls = int(per_row.target_calls[j])
        return {
            "id": shard.ids[i],
            "prompt": shard.prompts[i],
            "completion": self.tokenizer.decode(tokens, skip_special_tokens=True),
            "completion_token_ids": tokens,
            "prompt_tokens": len(shard.prompt_token_ids[i]),
            "completion_tokens": len(tokens),
            "finish_reason": str(per_row.finish_reason[j]),
            "target_calls": calls,
            "block_efficiency": len(tokens) / calls if calls else 0.0,
            "seed": shard.seeds[i],
            "error": None,
        }

    def _error_row(self, shard: Shard, i: int, message: str) -> dict[str, Any]:
        return {
            "id": shard.ids[i],
            "prompt": shard.prompts[i],
            "completion": "",
            "completion_token_ids": [],
            "prompt_tokens": len(shard.prompt_token_ids[i]),
            "completion_tokens": 0,
            "finish_reason": "error",
            "target_calls": 0,
            "block_efficiency": None,
            "seed": shard.seeds[i],
            "error": message,
        }
