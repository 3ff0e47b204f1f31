"""The stateful predictor each Ray actor runs: load the pair once, then map shards to output rows.

`ShardGenerator(model, spectr, num_threads)` loads the target, the draft and the target's tokenizer in
`__init__`; `__call__(shard)` cuts the shard into batches of `spectr.batch_size`, calls
`spectr.generate` on each, and returns a `ShardResult` of contract rows plus the shard's statistics.
It is a plain class: tests call it directly; `pipeline.generate.scheduler` wraps it with `ray.remote`.

A batch that fails (e.g. one prompt too long for the model makes `spectr.generate` raise for the whole
batch) is retried row by row, so that the good rows complete and only the bad rows are written with
`finish_reason="error"` and the message. This class does not write files or talk to MLflow.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.config import ModelConfig
from pipeline.generate.config import SpectrConfig
from pipeline.generate.shards import Shard
from pipeline.generate.stats import ResourceMeter, device_kind, empty_stats, merge_stats, stats_of

log = logging.getLogger(__name__)

@dataclass
class ShardResult:
    index: int
    rows: list[dict[str, Any]]
    stats: dict[str, Any]  # see `empty_stats`
    worker: dict[str, Any] = field(default_factory=dict)  # node, pid, device: where it ran


class ShardGenerator:
    """Holds one draft/target pair; turns a `Shard` into output rows."""

    def __init__(
        self,
        model: ModelConfig,
        spectr: SpectrConfig,
        num_threads: int | None = None,
        device: str | None = None,
        on_batch: Any = None,
    ):
        """on_batch(shard_index, rows): called after each batch of a shard (the driver's progress bar);
        an exception in it is logged and ignored: progress must never fail generation."""
        import torch

        from pipeline import models

        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu" and num_threads:
            torch.set_num_threads(int(num_threads))
        self.device = device
        self.spectr = spectr
        self.on_batch = on_batch
        self.tokenizer = models.load_tokenizer(
            models.check_model_dir(model.target, "model.target", model.allow_pickle),
            "model.target",
            model.trust_remote_code,
        )
        self.target = models.load_model(model.target, model, device)
        self.draft = models.load_model(model.draft, model, device)
        self.eos_token_id = models.eos_token_ids_of(self.target, self.tokenizer)  # every EOS id

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

    def generate_shard(self, shard: Shard) -> ShardResult:
        """The Ray-callable name of `__call__`."""
        return self(shard)

    def __call__(self, shard: Shard) -> ShardResult:
        started = time.perf_counter()
        meter = ResourceMeter(self.device)
        rows: list[dict[str, Any]] = []
        stats = empty_stats()
        batch_size = self.spectr.batch_size
        for start in range(0, len(shard), batch_size):
            batch = range(start, min(start + batch_size, len(shard)))
            rows.extend(self._generate_batch(shard, list(batch), stats))
            self._report_batch(shard.index, len(batch))
        stats["prompts_failed"] = sum(row["finish_reason"] == "error" for row in rows)
        stats["prompts_completed"] = len(rows) - stats["prompts_failed"]
        stats["shard_seconds"] = time.perf_counter() - started
        stats["resources"] = meter.usage()  # per worker, not summed (merge_stats leaves it alone)
        return ShardResult(index=shard.index, rows=rows, stats=stats, worker=self.ready())

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
        try:
            output = spectr.generate(
                self.target,
                self.draft,
                [shard.prompt_token_ids[i] for i in positions],
                method=s.method,
                num_drafts=s.num_drafts,
                draft_length=s.draft_length,
                max_new_tokens=s.max_new_tokens,
                temperature=s.temperature,
                top_k=s.top_k,
                top_p=s.top_p,
                eos_token_id=self.eos_token_id,
                seed=[shard.seeds[i] for i in positions],
            )
        except Exception as err:  # noqa: BLE001 - isolated below: only the failing rows get an error row
            if len(positions) == 1:
                return [self._error_row(shard, positions[0], err)]
            rows = []
            for i in positions:  # a row's output does not depend on its batch, so this loses nothing
                rows.extend(self._generate_batch(shard, [i], stats))
            return rows
        merge_stats(stats, stats_of(output.stats))
        per_row = output.stats
        rows = []
        for j, i in enumerate(positions):
            tokens = [int(t) for t in output.tokens[j]]
            calls = int(per_row.target_calls[j])
            rows.append(
                {
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
            )
        return rows

    def _error_row(self, shard: Shard, i: int, err: BaseException) -> dict[str, Any]:
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
            "error": f"{type(err).__name__}: {err}",
        }
