"""The Ray Data stage's actor: `SpecTrStage`, the job's actor code fed by Ray Data batches instead of shards.

    stage = SpecTrStage(config)    # once per actor: the pair, the tokenizer, one continuous batch
    table = await stage(batch)     # a pyarrow batch in; the same columns plus the generated ones out

`__init__` builds the job's own `ShardGenerator` (`pipeline.generate.worker`: loads the pair and owns the
actor's one `ShardFeed`, i.e. one `spectr.ContinuousBatcher`, or a `spectr.planner.AutoBatcher` for
method auto). Ray Data calls `__call__` for up to `config.batches_in_flight()` batches at once (an async actor,
`max_concurrency`); each call runs on a thread of the stage's own pool, turns its batch into a `Shard`
and waits in the feed while its rows share the batch with the other calls' rows: a freed slot takes a row
of any batch, so the engine's slots stay full across Ray Data batch boundaries, as across the job's shards.

The actor does what `ray.data.llm`'s chat-template, tokenize, engine and detokenize stages do, row by row:
- **Prompt**: a row with `messages` (and the chat template stage on, Ray's default) is rendered with the
  target tokenizer's template as Ray's stage renders it (a generation prompt after a user turn, else the
  last message continued) and tokenized without added special tokens (the template writes its own, as
  `apply_chat_template(tokenize=True)`); else its `prompt`, tokenized with them (Ray's tokenize stage); else,
  with `tokenize_stage` off, its `tokenized_prompt`. A row with none of them fails, naming the columns.
- **sampling_params**: vLLM's names (`pipeline.row_columns.SAMPLING_KEYS`); the detokenizer's settings
  (`STAGE_ONLY_KEYS`: they change no token) are taken here; `logprobs=N` fills Ray's `logprobs` column and
  `cumulative_logprob`; `prompt_logprobs=N` fills `prompt_logprobs` (from the engine's prefill, only for the
  rows that ask; N at most 20, vLLM's default max_logprobs, whatever engine_kwargs max_logprobs says); `truncate_prompt_tokens=k` keeps the prompt's last k tokens (the columns say what ran).
- **stop_reason**: vLLM's value and type: the stop token's id (an int), the stop string, or None (at EOS and
  the budget): an object column, as `logprobs` (Arrow has no int-or-string type).
- **Seed**: `sampling_params.seed`, else the job's rule (`row_seed(engine seed, id)`) with the `id` column,
  else a fresh one (vLLM's `seed=None`); the `seed` column says which, so any row can be reproduced.
- **n**: a row with `n` gives n output rows (`sample_index` 0..n-1, seeds `sample_seed(row seed, index)`).
- **Errors**: a row that cannot run fails alone: with `should_continue_on_error` it carries the message in
  `__inference_error__` (`""` on the others), else the batch raises and the dataset fails.

Not here: building the Dataset plan (`pipeline.ray_data.processor`), the settings' checks (`.config`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pipeline.ray_data.config import SAMPLING_PARAMS_COLUMN, SpecTrProcessorConfig

ERROR_COLUMN = "__inference_error__"  # Ray Data LLM's name (`should_continue_on_error`)
# vLLM SamplingParams keys that change no token, only the text the engine writes (or how it is sent): the stage's
STAGE_ONLY_KEYS = ("detokenize", "skip_special_tokens", "spaces_between_special_tokens", "output_kind")
OBJECT_COLUMNS = ("logprobs", "prompt_logprobs", "stop_reason")  # Python objects (Ray's engine stage: the first two)


def output_types(tokenize_stage: bool = True) -> dict[str, Any]:
    """The columns the stage writes, with their Arrow types: `ray.data.llm`'s (vLLM engine stage, and the
    tokenize stage's `tokenized_prompt`), then SpecTr's own. `logprobs` and `prompt_logprobs` are Python
    objects (Ray's pickled-object extension type), as in Ray: a list, per token, of {token id: {logprob,
    rank, decoded_token}}. Every batch has all of them: one schema."""
    import pyarrow as pa

    ids = pa.list_(pa.int64())
    types = {
        "prompt": pa.string(),  # the text tokenized: the chat template's output for a `messages` row
        "prompt_token_ids": ids,
        "num_input_tokens": pa.int64(),
        "generated_tokens": ids,
        "generated_text": pa.string(),
        "num_generated_tokens": pa.int64(),
        "embeddings": pa.null(),
        "metrics": pa.null(),
        "logprobs": None,  # object column (see the docstring); null unless sampling_params.logprobs
        "prompt_logprobs": None,
        "request_id": pa.int64(),  # per actor, from 0; -1 on a failed row (as Ray's)
        "batch_uuid": pa.string(),
        "time_taken_llm": pa.float64(),  # seconds from joining the batch to finishing; -1 on a failed row
        "params": pa.string(),  # the row's effective sampling parameters, as text
        ERROR_COLUMN: pa.string(),
        "finish_reason": pa.string(),  # vLLM's: stop | length (and error)
        "stop_reason": None,  # object column: vLLM's None, the stop string (str) or the stop token's id (int)
        "cumulative_logprob": pa.float64(),  # vLLM's: the sum of the sampled tokens' logprobs (null without logprobs)
        "target_calls": pa.int64(),
        "block_efficiency": pa.float64(),
        "sample_index": pa.int64(),  # 0 .. n-1: a row with `n` in its sampling_params gives n rows
        "seed": pa.int64(),  # the seed the row was generated with
    }
    if tokenize_stage:
        types["tokenized_prompt"] = ids
    return types


class RowsFailed(RuntimeError):
    """Rows of a batch failed and the stage does not continue on error (`should_continue_on_error=False`)."""


@dataclasses.dataclass
class RowAsk:
    """What a row asked of the stage beyond the engine's settings (from its sampling_params)."""

    logprobs: int | None = None  # vLLM's logprobs=N: the sampled token and the top N; None: no column
    truncate: int | None = None  # vLLM's truncate_prompt_tokens=k: the prompt's last k tokens
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    params: dict[str, Any] | None = None  # the row's sampling_params as given (for the `params` column)


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
        self.chat = config.chat()
        self.tokenize_stage = config.stage("tokenize_stage").enabled
        self.detokenize_stage = config.stage("detokenize_stage").enabled
        self._batches = itertools.count()  # the feed's "shard" index of each call
        self._requests = itertools.count()  # request_id, per actor as Ray's
        self._threads = ThreadPoolExecutor(config.max_concurrent_batches, thread_name_prefix="spectr-batch")

    async def __call__(self, batch: Any) -> Any:
        """A pyarrow batch -> the same rows with the generated columns (waits while other batches run too)."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, self.generate, batch)

    def generate(self, batch: Any) -> Any:
        """The blocking body of `__call__` (tests call it directly, without Ray)."""
        rows = batch.to_pylist()
        if not rows:
            return batch
        shard, asks = self._shard(next(self._batches), rows)
        result = self.generator(shard)
        return self._with_outputs(batch, shard, result.rows, asks, result.inputs)

    # -- rows in -------------------------------------------------------------------------------------------

    def _shard(self, index: int, rows: list[dict[str, Any]]) -> tuple[Any, list[RowAsk]]:
        """The batch as the job's `Shard` (problems, rendered and tokenized prompts, seeds, sampling params),
        and what each row asked of the stage itself."""
        from pipeline.generate.shards import Shard, row_seed

        ids = [_plain(row["id"]) if row.get("id") is not None else i for i, row in enumerate(rows)]
        texts: list[str | None] = []
        token_ids: list[list[int]] = [[] for _ in rows]
        problems: list[str | None] = []
        special: list[bool] = []  # whether the tokenizer adds its special tokens (a plain prompt)
        for i, row in enumerate(rows):
            where = f"row {i} of the batch" + (f" (id {ids[i]!r})" if row.get("id") is not None else "")
            text, given, problem = self._prompt_of(row)
            texts.append(text)
            special.append(problem is None and given is None and not self._templated(row))
            if given is not None:
                token_ids[i] = given
            problems.append(f"{where}: {problem}" if problem else None)
        self._tokenize(texts, token_ids, special, problems)
        params, asks = [], []
        for i, row in enumerate(rows):
            value, ask, problem = split_params(row.get(SAMPLING_PARAMS_COLUMN), self.config.max_logprobs())
            params.append(value)
            asks.append(ask)
            if problem and not problems[i]:
                problems[i] = f"row {i} of the batch: sampling_params: {problem}"
            if ask.truncate is not None and token_ids[i]:
                token_ids[i] = token_ids[i][-ask.truncate:]
        base = self.generator.spectr.seed
        # no id (and no sampling_params.seed): a fresh seed per row, vLLM's seed=None
        seeds = [row_seed(base, ids[i]) if row.get("id") is not None else fresh_seed() for i, row in enumerate(rows)]
        shard = Shard(index=index, ids=ids, prompts=texts, prompt_token_ids=token_ids, seeds=seeds, problems=problems,
                      extras={SAMPLING_PARAMS_COLUMN: params})
        return shard, asks

    def _templated(self, row: dict[str, Any]) -> bool:
        return self.chat.enabled and row.get("messages") is not None

    def _prompt_of(self, row: dict[str, Any]) -> tuple[str | None, list[int] | None, str | None]:
        """(text, token ids given by the row, problem): the chat template's output for `messages`, the row's
        `prompt`, or (tokenize_stage off) its `tokenized_prompt`."""
        from pipeline.rowcheck import messages_problem, prompt_problem

        if self._templated(row):
            messages, problem = messages_problem(row["messages"], "messages")
            if problem:
                return None, None, problem
            try:
                return self._render(messages), None, None
            except Exception as err:  # noqa: BLE001 - a template that fails on one row fails only that row
                return None, None, f"the chat template failed on 'messages': {type(err).__name__}: {err}"
        given = row.get("tokenized_prompt")
        if not self.tokenize_stage and given is not None:
            ids = [int(t) for t in given]
            return row.get("prompt") if isinstance(row.get("prompt"), str) else "", ids, None if ids else \
                "tokenized_prompt is empty"
        if row.get("prompt") is None:
            others = ["'messages' (the chat template's input)"] if self.chat.enabled else []
            others += [] if self.tokenize_stage else ["'tokenized_prompt'"]
            head = "prompt is null" if "prompt" in row else "no 'prompt' column"
            return None, None, head + (f", and the row has no {' or '.join(others)}" if others else "")
        problem = prompt_problem(row["prompt"])
        return None if problem else row["prompt"], None, problem

    def _render(self, messages: list[dict[str, Any]]) -> str:
        """Ray's chat template stage: a generation prompt when the last message is the user's, else the last
        message continued (an assistant prefill)."""
        from pipeline.row_columns import chat_template_text

        tokenizer = self.generator.tokenizer
        options = dict(self.chat.chat_template_kwargs or {})
        if self.chat.chat_template is not None:
            options["chat_template"] = chat_template_text(self.chat.chat_template)
        elif not getattr(tokenizer, "chat_template", None):
            raise ValueError("the target tokenizer has no chat template (set chat_template_stage="
                             "{'chat_template': ...}, or send 'prompt' instead of 'messages')")
        generation = messages[-1].get("role") == "user"
        with self.generator._text_lock:  # the fast tokenizer is not re-entrant
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation,
                                                 continue_final_message=not generation, **options)

    def _tokenize(self, texts: list[str | None], token_ids: list[list[int]], special: list[bool],
                  problems: list[str | None]) -> None:
        """Token ids of the rows that have a text and no ids yet: plain prompts with the tokenizer's special
        tokens (Ray's tokenize stage), rendered chat prompts without (their template wrote them)."""
        from pipeline import models

        tokenizer = self.generator.tokenizer
        for add in (True, False):
            todo = [i for i, text in enumerate(texts) if text is not None and not problems[i] and not token_ids[i]
                    and special[i] == add]
            with self.generator._text_lock:
                try:
                    encoded = models.tokenize(tokenizer, [texts[i] for i in todo], add)
                except Exception:  # noqa: BLE001 - retried row by row, so that only the failing rows fail
                    encoded = []
                    for i in todo:
                        try:
                            encoded.append(models.tokenize(tokenizer, [texts[i]], add)[0])
                        except Exception as err:  # noqa: BLE001
                            problems[i] = f"tokenizing row {i} failed: {type(err).__name__}: {err}"
                            encoded.append([])
            for i, ids in zip(todo, encoded):
                token_ids[i] = ids

    # -- rows out ------------------------------------------------------------------------------------------

    def _with_outputs(self, batch: Any, shard: Any, generated: list[dict[str, Any]], asks: list[RowAsk],
                      inputs: list[int] | None = None) -> Any:
        """The input batch with the stage's columns appended (replaced where a name is already there). A row
        with `n` in its sampling_params gives n output rows (its input columns repeated, `sample_index` 0..n-1);
        inputs: each generated row's row of the batch."""
        import pyarrow as pa

        inputs = list(range(len(generated))) if inputs is None else inputs
        if inputs != list(range(batch.num_rows)):
            batch = batch.take(pa.array(inputs, type=pa.int64()))
        asks = [asks[i] for i in inputs]
        failed = [(row["error"] or "failed") for row in generated if row["finish_reason"] == "error"]
        if failed and not self.config.should_continue_on_error:
            raise RowsFailed(f"{len(failed)} of {len(generated)} rows failed; the first: {failed[0]} "
                             "(should_continue_on_error=True keeps going, each failed row carrying its error)")
        batch_uuid = uuid.uuid4().hex
        ok = [row["finish_reason"] != "error" for row in generated]
        prompt_ids = [shard.prompt_token_ids[i] if shard.prompt_token_ids[i] else None for i in inputs]
        columns: dict[str, list[Any]] = {
            "prompt": [shard.prompts[i] if shard.prompts[i] is not None else "" for i in inputs],
            "prompt_token_ids": prompt_ids,
            "num_input_tokens": [len(ids or []) for ids in prompt_ids],
            "generated_tokens": [row["completion_token_ids"] for row in generated],
            "generated_text": [self._text(row, ask) for row, ask in zip(generated, asks)],
            "num_generated_tokens": [row["completion_tokens"] for row in generated],
            "embeddings": [None] * len(generated),
            "metrics": [None] * len(generated),
            "logprobs": [self._logprobs(row, ask) if good else None for row, ask, good in zip(generated, asks, ok)],
            "prompt_logprobs": [self._prompt_logprobs(row) if good else None for row, good in zip(generated, ok)],
            "request_id": [next(self._requests) if good else -1 for good in ok],
            "batch_uuid": [batch_uuid] * len(generated),
            "time_taken_llm": [row.get("time_taken_s") if good else -1.0 for row, good in zip(generated, ok)],
            "params": [self._params(row, ask) if good else "" for row, ask, good in zip(generated, asks, ok)],
            ERROR_COLUMN: [(row["error"] or "failed") if not good else "" for row, good in zip(generated, ok)],
            "finish_reason": [row["finish_reason"] for row in generated],
            "stop_reason": [stop_reason(row) for row in generated],
            "cumulative_logprob": [_cumulative(row) if ask.logprobs is not None and good else None
                                   for row, ask, good in zip(generated, asks, ok)],
            "target_calls": [row["target_calls"] for row in generated],
            "block_efficiency": [row["block_efficiency"] for row in generated],
            "sample_index": [row["sample_index"] for row in generated],
            "seed": [row["seed"] for row in generated],
        }
        types = output_types(self.tokenize_stage)
        if self.tokenize_stage:
            columns["tokenized_prompt"] = prompt_ids
        table = batch
        for name, values in columns.items():
            array = object_array(values) if name in OBJECT_COLUMNS else pa.array(values, type=types[name])
            where = table.schema.get_field_index(name)
            table = table.set_column(where, name, array) if where >= 0 else table.append_column(name, array)
        return table

    def _text(self, row: dict[str, Any], ask: RowAsk) -> str:
        """generated_text. With the detokenize stage (Ray's default) the tokens decoded skipping special tokens,
        whatever the row's sampling_params say (Ray's stage decodes so, after the engine); without it, the
        engine's text as the row asked: "" with detokenize=False, special tokens kept with
        skip_special_tokens=False. A stop string's cut text is kept either way."""
        if self.detokenize_stage:
            return row["completion"]
        if not ask.detokenize:
            return ""
        tokens = row["completion_token_ids"]
        stop_string = isinstance(stop_reason(row), str)
        if ask.skip_special_tokens or stop_string:  # a stop string's cut is in the completion's text
            return row["completion"]
        with self.generator._text_lock:
            return self.generator.tokenizer.decode(tokens, skip_special_tokens=False,
                                                   spaces_between_special_tokens=ask.spaces_between_special_tokens)

    def _logprobs(self, row: dict[str, Any], ask: RowAsk) -> list[dict[int, dict[str, Any]]] | None:
        """Ray's `logprobs`: per generated token, {token id: {logprob, rank, decoded_token}} for the sampled
        token and the row's top N (vLLM's logprobs=N). rank: 1 for the most likely token; the sampled token's
        rank where it is among the engine's top `max_logprobs`, else null (the engine reports no rank)."""
        if ask.logprobs is None:
            return None
        tokens, values = row["completion_token_ids"], row.get("completion_logprobs") or []
        tops = row.get("completion_top_logprobs") or [[] for _ in tokens]
        decode = self.generator.tokenizer.decode
        out = []
        with self.generator._text_lock:
            for token, value, top in zip(tokens, values, tops):
                ranked = [entry["token_id"] for entry in top]
                entry = {token: {"logprob": float(value), "rank": ranked.index(token) + 1 if token in ranked else None,
                                 "decoded_token": decode([token])}}
                for rank, alternative in enumerate(top[: ask.logprobs], start=1):
                    if alternative["token_id"] != token:
                        entry[alternative["token_id"]] = {"logprob": float(alternative["logprob"]), "rank": rank,
                                                          "decoded_token": decode([alternative["token_id"]])}
                out.append(entry)
        return out

    def _prompt_logprobs(self, row: dict[str, Any]) -> list[dict[int, dict[str, Any]] | None] | None:
        """Ray's `prompt_logprobs` (vLLM's): per prompt token, None first, then {token id: {logprob, rank,
        decoded_token}} for the prompt token and the top N, from the job's column (`with_vllm_fields`)."""
        entries = row.get("prompt_logprobs")
        if entries is None:
            return None
        decode = self.generator.tokenizer.decode
        with self.generator._text_lock:
            return [None if position is None else
                    {e["token_id"]: {"logprob": float(e["logprob"]), "rank": e["rank"], "decoded_token": decode([e["token_id"]])}
                     for e in position} for position in entries]

    def _params(self, row: dict[str, Any], ask: RowAsk) -> str:
        """The row's effective sampling parameters as text (Ray writes `str(vllm.SamplingParams)`)."""
        s = self.generator.spectr
        effective = {"n": 1, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                     "max_tokens": s.max_new_tokens, **(ask.params or {}), "seed": row["seed"]}
        return "SamplingParams(" + ", ".join(f"{k}={v!r}" for k, v in effective.items()) + ")"


def split_params(params: Any, max_logprobs: int) -> tuple[Any, RowAsk, str | None]:
    """(sampling_params for the engine, what the row asks of the stage, a problem or None): the stage's own
    keys (`STAGE_ONLY_KEYS`, `logprobs`) taken out; an unreadable value goes on for the engine's check to
    name. logprobs: True or an int N >= 0 (vLLM's count of alternatives; True: the sampled token's alone)."""
    if isinstance(params, str):
        try:
            params = json.loads(params)
        except ValueError:
            return params, RowAsk(), None  # row_settings reports it
    if not isinstance(params, dict):
        return params, RowAsk(), None
    params = {k: _plain_value(v) for k, v in params.items()}
    rest = {k: v for k, v in params.items() if k not in STAGE_ONLY_KEYS and k != "logprobs"}
    ask = RowAsk(params={k: v for k, v in params.items() if v is not None})
    for key in STAGE_ONLY_KEYS[:3]:
        if params.get(key) is not None:
            if not isinstance(params[key], bool):
                return rest, ask, f"{key} must be true or false, got {params[key]!r}"
            setattr(ask, key, params[key])
    truncate = params.get("truncate_prompt_tokens")
    if isinstance(truncate, int) and not isinstance(truncate, bool) and truncate >= 1:
        ask.truncate = truncate  # another value: the engine's check names it
    value = params.get("logprobs")
    if value is None or value is False:
        return rest, ask, None
    count = 0 if value is True else value
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        return rest, ask, f"logprobs must be an int >= 0 (or true), got {value!r}"
    if count > max_logprobs:
        return rest, ask, (f"logprobs={count} asks for more alternatives than engine_kwargs max_logprobs "
                           f"({max_logprobs}; vLLM's engine setting: set it to at least {count})")
    ask.logprobs = count
    return rest, ask, None


def stop_reason(row: dict[str, Any]) -> int | str | None:
    """vLLM's stop_reason of a generated row: the stop token's id as an int (the job's `stop_token_id`), the stop
    string, or None."""
    if row.get("stop_token_id") is not None:
        return int(row["stop_token_id"])
    return row.get("stop_reason")


def _cumulative(row: dict[str, Any]) -> float | None:
    """vLLM's cumulative_logprob: the sum of the sampled tokens' log-probabilities (as cut at a stop string)."""
    values = row.get("completion_logprobs")
    return None if values is None else float(sum(values))


def object_array(values: list[Any]) -> Any:
    """A column of Python objects (Ray Data's pickled-object extension type, as Ray writes a column whose
    values Arrow cannot type, such as a map from int token ids to structs)."""
    from ray.data._internal.object_extensions.arrow import ArrowPythonObjectArray

    return ArrowPythonObjectArray.from_objects(values)


def fresh_seed() -> int:
    """A row with neither an id nor a seed draws a fresh seed (vLLM's seed=None): repeated rows are independent
    samples, and a rerun gives other ones."""
    import secrets

    return secrets.randbits(62)


def _plain(value: Any) -> Any:
    """An id as the job reads it (a Python int or str; numpy scalars become Python ones)."""
    return value.item() if hasattr(value, "item") else value


def _plain_value(value: Any) -> Any:
    """A sampling_params value as Python (Ray Data hands lists as numpy arrays)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value
