"""The Ray Data stage's actor: `SpecTrStage`, the job's actor code fed by Ray Data batches instead of shards.

    stage = SpecTrStage(config)    # once per actor: the pair, the tokenizer, one continuous batch
    table = await stage(batch)     # a pyarrow batch in; the same columns plus the generated ones out

`__init__` builds the job's own `ShardGenerator` (`pipeline.generate.worker`: loads the pair and owns the
actor's one `ShardFeed`, i.e. one `spectr.ContinuousBatcher`, or a `spectr.planner.AutoBatcher` for
method auto). Ray Data calls `__call__` for up to `config.batches_in_flight()` batches at once (an async actor,
`max_concurrency`); each call runs on a thread of the stage's own pool, turns its batch into a `Shard`
(the job's rendering and tokenizing, `pipeline.generate.shards.shard_of_rows`) and waits in the feed while
its rows share the batch with the other calls' rows: a freed slot takes a row of any batch, so the engine's
slots stay full across Ray Data batch boundaries, exactly as they do across the job's shards.

A row: `prompt` (or `messages`, with `apply_chat_template`), optional `sampling_params` (vLLM's names:
`pipeline.row_columns.SAMPLING_KEYS`), any other columns (returned unchanged). A row with `n` in its
sampling_params gives n output rows (its columns repeated, `sample_index` 0..n-1, seeds as the job's
samples: `sample_seed(row seed, index)`), spread over the actor's batch like any rows.
Its seed: `sampling_params.seed`, else the job's rule (`row_seed(engine seed, id)`) with its `id` column as
the id, else a fresh one (vLLM's `seed=None`: repeated rows are independent samples). So a row with an id or a
seed gets the tokens of `spectr.generate` on its prompt ids with that seed and the same settings, whatever
batch it shares.
A row that cannot run (no prompt, bad sampling_params, a prompt too long for the model, an engine error)
fails alone: with `should_continue_on_error` it carries the message in `__inference_error__` (`""` on the
others, as Ray Data LLM does), else the batch raises and the dataset fails.

Not here: building the Dataset plan (`pipeline.ray_data.processor`), the settings' checks (`.config`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pipeline.ray_data.config import SAMPLING_PARAMS_COLUMN, SpecTrProcessorConfig

ERROR_COLUMN = "__inference_error__"  # Ray Data LLM's name (`should_continue_on_error`)


def output_types() -> dict[str, Any]:
    """The columns the stage adds, with their Arrow types (every batch has all of them: one schema)."""
    import pyarrow as pa

    return {
        "generated_text": pa.string(),
        "generated_tokens": pa.list_(pa.int32()),
        "num_generated_tokens": pa.int64(),
        "num_input_tokens": pa.int64(),
        "prompt_token_ids": pa.list_(pa.int32()),
        "time_taken_llm": pa.float64(),  # seconds from joining the batch to finishing
        "finish_reason": pa.string(),  # vLLM's: stop | length (and error)
        "stop_reason": pa.string(),  # null, the matched stop string, or the stop token id as text
        "target_calls": pa.int64(),
        "block_efficiency": pa.float64(),
        "logprobs": pa.list_(pa.float32()),  # raw target log-probabilities; null unless sampling_params.logprobs
        "sample_index": pa.int64(),  # 0 .. n-1: a row with `n` in its sampling_params gives n rows
    }


class RowsFailed(RuntimeError):
    """Rows of a batch failed and the stage does not continue on error (`should_continue_on_error=False`)."""


class SpecTrStage:
    """One draft/target pair and one continuous batch per actor; see the module docstring."""

    def __init__(self, config: SpecTrProcessorConfig):
        import torch

        from pipeline.generate.worker import ShardGenerator

        self.config = config
        spectr = config.spectr_config(gpu=torch.cuda.is_available())
        self.generator = ShardGenerator(config.model_config(), spectr, num_threads=max(1, round(config.num_cpus or 1)),
                                        data=config.data_config())
        self.generator.feed.max_budget = spectr.max_new_tokens  # the pool's first size: the default budget
        self.data = config.data_config()
        self._batches = itertools.count()  # the feed's "shard" index of each call
        self._threads = ThreadPoolExecutor(config.max_concurrent_batches, thread_name_prefix="spectr-batch")

    async def __call__(self, batch: Any) -> Any:
        """A pyarrow batch -> the same rows with the generated columns (waits while other batches run too)."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, self.generate, batch)

    def generate(self, batch: Any) -> Any:
        """The blocking body of `__call__` (tests call it directly, without Ray)."""
        rows = batch.to_pylist()
        if not rows:
            return batch
        shard, asked = self._shard(next(self._batches), rows)
        result = self.generator(shard)
        return self._with_outputs(batch, shard, result.rows, asked, result.inputs)

    def _shard(self, index: int, rows: list[dict[str, Any]]) -> tuple[Any, list[bool]]:
        """The batch as the job's `Shard` (problems, rendered and tokenized prompts, seeds, sampling params),
        and which rows asked for log-probabilities."""
        from pipeline.generate.shards import shard_of_rows
        from pipeline.prompts import PromptRows
        from pipeline.rowcheck import messages_problem, prompt_problem

        chat = self.data.chat
        ids = [_plain(row["id"]) if row.get("id") is not None else i for i, row in enumerate(rows)]
        values, problems = [], []
        for i, row in enumerate(rows):
            if chat:
                value, problem = messages_problem(row.get("messages"), "messages")
            else:
                value, problem = row.get("prompt"), prompt_problem(row.get("prompt"))
            values.append(None if problem else value)
            where = f"row {i} of the batch" + (f" (id {ids[i]!r})" if row.get("id") is not None else "")
            problems.append(f"{where}: {problem}" if problem else None)
        params, asked = zip(*(_split_logprobs(row.get(SAMPLING_PARAMS_COLUMN)) for row in rows))
        read = PromptRows(ids, None if chat else values, values if chat else None, problems,
                          extras={SAMPLING_PARAMS_COLUMN: list(params)})
        with self.generator._text_lock:  # the fast tokenizer is not re-entrant
            shard = shard_of_rows(index, read, self.generator.tokenizer, self.data, self.generator.spectr.seed)
        seeds = [seed if row.get("id") is not None else fresh_seed()
                 for row, seed in zip(rows, shard.seeds)]  # no id (and no sampling_params.seed): vLLM's seed=None
        return dataclasses.replace(shard, seeds=seeds), list(asked)

    def _with_outputs(self, batch: Any, shard: Any, generated: list[dict[str, Any]], asked: list[bool],
                      inputs: list[int] | None = None) -> Any:
        """The input batch with the generated columns appended (replaced where a name is already there). A row
        with `n` in its sampling_params gives n output rows (its input columns repeated, `sample_index` 0..n-1);
        inputs: each generated row's row of the batch."""
        import pyarrow as pa

        inputs = list(range(len(generated))) if inputs is None else inputs
        if inputs != list(range(batch.num_rows)):
            batch = batch.take(pa.array(inputs, type=pa.int64()))
            asked = [asked[i] for i in inputs]
        failed = [(row["error"] or "failed") for row in generated if row["finish_reason"] == "error"]
        if failed and not self.config.should_continue_on_error:
            raise RowsFailed(f"{len(failed)} of {len(generated)} rows failed; the first: {failed[0]} "
                             "(should_continue_on_error=True keeps going, each failed row carrying its error)")
        columns = {
            "generated_text": [row["completion"] for row in generated],
            "generated_tokens": [row["completion_token_ids"] for row in generated],
            "num_generated_tokens": [row["completion_tokens"] for row in generated],
            "num_input_tokens": [row["prompt_tokens"] for row in generated],
            "prompt_token_ids": [shard.prompt_token_ids[i] for i in inputs],
            "time_taken_llm": [row.get("time_taken_s") for row in generated],
            "finish_reason": [row["finish_reason"] for row in generated],
            "stop_reason": [row.get("stop_reason") for row in generated],
            "target_calls": [row["target_calls"] for row in generated],
            "block_efficiency": [row["block_efficiency"] for row in generated],
            "logprobs": [row.get("completion_logprobs") if want else None for row, want in zip(generated, asked)],
            "sample_index": [row["sample_index"] for row in generated],
        }
        types = output_types()
        if self.config.should_continue_on_error:
            columns[ERROR_COLUMN] = [(row["error"] or "failed") if row["finish_reason"] == "error" else ""
                                     for row in generated]
            types[ERROR_COLUMN] = pa.string()
        table = batch
        for name, values in columns.items():
            array = pa.array(values, type=types[name])
            where = table.schema.get_field_index(name)
            table = table.set_column(where, name, array) if where >= 0 else table.append_column(name, array)
        return table


def fresh_seed() -> int:
    """A row with neither an id nor a seed draws a fresh seed (vLLM's seed=None): repeated rows are independent
    samples, and a rerun gives other ones."""
    import secrets

    return secrets.randbits(62)


def _plain(value: Any) -> Any:
    """An id as the job reads it (a Python int or str; numpy scalars become Python ones)."""
    return value.item() if hasattr(value, "item") else value


def _split_logprobs(params: Any) -> tuple[Any, bool]:
    """(sampling_params without `logprobs`, whether the row asked for log-probabilities). `logprobs`: True,
    or an int >= 0 (vLLM's count of alternatives: each token's own log-probability is given, not the others)."""
    if isinstance(params, str):
        try:
            params = json.loads(params)
        except ValueError:
            return params, False  # row_settings reports it
    if not isinstance(params, dict) or "logprobs" not in params:
        return params, False
    rest = {k: v for k, v in params.items() if k != "logprobs"}
    value = params["logprobs"]
    return rest, value is not None and value is not False
