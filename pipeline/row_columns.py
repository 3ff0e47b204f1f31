"""The input's per-row columns besides the prompt: carried columns, stop strings, per-row sampling settings.

- `data.keep_columns` (a list of names, or "all": every input column but the prompt / messages and id
  columns): carried to the output unchanged, with one Arrow type per column for the whole job, so that
  every part file has the same schema (`KeptTypes`, filled by the driver's scan): the input's own for
  Parquet and saved HF datasets (several files: their types merged); for JSON lines and CSV, pyarrow's
  own inference (its JSON / CSV reader on each block the scan reads), merged over every block and file.
  Merging promotes as pyarrow's "permissive" schema unification does (null + T -> T, int64 + double ->
  double, structs by the union of their fields, lists by their items); two JSON-lines / CSV types that do
  not merge (a number here, a string there) make the column a string: CSV's text as read, JSON lines' a
  string as is and any other value as its JSON text. Two Parquet / Arrow files whose declared types do not
  merge are refused (exit 2).
- `data.stop_column`: a row's stop strings (a list of strings or one string; null: none), added to
  `spectr.stop`.
- `data.sampling_params_column`: a struct or a JSON object with any of vLLM's `SamplingParams` names in
  `SAMPLING_KEYS`, with vLLM's meanings; names that cannot be exact (`REFUSED_KEYS`) are refused with the
  reason unless neutral; a value out of range fails that row alone, with its error.
- `structured_outputs` (vLLM's; `guided_decoding`, its older name, is read as an alias): a grammar for the row
  (`spectr.structured.parse_structured`: json / json_object / regex / choice / grammar, whitespace_pattern); an
  invalid one fails the row, naming the problem; it rides the engine warp as its last field.
- The job-level equivalents (`spectr.min_p`, `spectr.logit_bias`, the penalties, `spectr.min_tokens`,
  `spectr.stop_token_ids`, `spectr.ignore_eos`, `spectr.include_stop_str_in_output`, `spectr.structured_outputs`:
  `JOB_KEYS`) apply to every
  row; a row's own value of the same name replaces the job's (`RowSettings.over`). A row's stop strings are
  added to `spectr.stop` instead.

Config shapes are checked here (`check_row_columns_config`, `check_stop_list`: exit 2 before anything is
written); the input's column names and the kept columns' types by the scan (`KeptTypes`, `resolve_columns`);
a row's values on the worker (`carried`, `row_settings`). Not here: reading files (`pipeline.prompts`), generating, writing.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from pipeline.errors import JobInputError
from spectr.structured import ALIASES as STRUCTURED_KEYS

BIAS_LIMIT = 100.0  # vLLM clamps each logit_bias value to [-100, 100] (spectr.warps.BIAS_LIMIT)

# the output row's own columns: a kept input column may not take one of these names
OUTPUT_COLUMNS = ("id", "prompt", "completion", "completion_token_ids", "prompt_tokens", "completion_tokens",
                  "finish_reason", "stop_reason", "target_calls", "block_efficiency", "seed", "error", "sample_index",
                  "completion_logprobs", "completion_top_logprobs", "time_taken_s", "prompt_token_ids",
                  "stop_token_id", "cumulative_logprob", "prompt_logprobs")
# vLLM's SamplingParams names, with vLLM's meanings (docs/sampling.md): top_k -1 or 0 = off; ignore_eos and
# stop_token_ids decide which tokens end the row; logprobs is read by the stage / the job-wide spectr.logprobs
SAMPLING_KEYS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop",
                 "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "logprobs", "logit_bias",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "structured_outputs", "guided_decoding",
                 "allowed_token_ids", "bad_words", "prompt_logprobs", "truncate_prompt_tokens", "detokenize",
                 "skip_special_tokens", "spaces_between_special_tokens", "output_kind")
# the detokenizer's settings: they change the text written, never a token (vLLM's defaults)
TEXT_KEYS = {"detokenize": True, "skip_special_tokens": True, "spaces_between_special_tokens": True}
MAX_LOGPROBS = 20  # vLLM's default max_logprobs: the most alternatives prompt_logprobs=N may ask
# known names that cannot be exact here (or are not built yet), refused with the reason (their neutral value passes)
REFUSED_KEYS = {
    "best_of": "best_of picks among samples by score, which changes the output law (draw n samples instead)",
    "use_beam_search": "beam search is not sampling from the target's law",
    "logits_processors": "arbitrary logits processors cannot be applied identically to the draft tree's nodes",
}
NEUTRAL = {"best_of": (None, 1), "use_beam_search": (False,), "logits_processors": (None, [])}
# vLLM names the job also sets for every row, as `spectr.<name>` (a row's own value replaces the job's), with the
# value that means "off"; temperature / top_k / top_p / max_tokens / seed / stop / n / logprobs have their own keys
JOB_KEYS = {"min_p": 0.0, "logit_bias": (), "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "repetition_penalty": 1.0, "min_tokens": 0, "stop_token_ids": (), "ignore_eos": False,
            "include_stop_str_in_output": False, "structured_outputs": None}
# vLLM's ranges: (test, the rule as the message says it); the same for a row's value and the job's
RANGES = {
    "temperature": (lambda v: v >= 0, ">= 0 (0 = greedy)"), "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (lambda v: v >= 0, ">= 0, or -1 (0 and -1 = off)"), "min_p": (lambda v: 0 <= v <= 1, "in [0, 1] (0 = off)"),
    "max_tokens": (lambda v: v >= 1, ">= 1"), "seed": (lambda v: v >= 0, ">= 0, or -1 (no seed)"),
    "n": (lambda v: v >= 1, ">= 1"),
    "logprobs": (lambda v: v >= 0, ">= 0"),
    "prompt_logprobs": (lambda v: 0 <= v <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}] (vLLM's max_logprobs)"),
    "truncate_prompt_tokens": (lambda v: v >= 1, ">= 1, the prompt's last k tokens kept (vLLM's -1, the model's "
                               "length, is not taken: a prompt over the model's positions is the row's error)"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2] (0 = off)"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2] (0 = off)"),
    "repetition_penalty": (lambda v: v > 0, "> 0 (1 = off)"), "min_tokens": (lambda v: v >= 0, ">= 0 (0 = off)"),
}


def check_stop_list(value: Any, key: str) -> tuple[str, ...]:
    """None or a list of non-empty strings -> a tuple (JobInputError naming `key` otherwise)."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not all(
            isinstance(s, str) and s for s in value):
        raise JobInputError(f"config: {key} must be a list of non-empty strings, got {value!r}")
    return tuple(value)


def check_row_columns_config(d: Any) -> None:
    """The shapes of data.keep_columns, stop_column, sampling_params_column, chat_template(_kwargs)."""
    keep = d.keep_columns
    if keep is not None and keep != "all":
        if isinstance(keep, str) or not isinstance(keep, (list, tuple)) or not all(
                isinstance(c, str) and c.strip() for c in keep) or len(set(keep)) != len(keep):
            raise JobInputError(f"config: data.keep_columns must be null, 'all' or a list of distinct column "
                                f"names, got {keep!r}")
        clash = [c for c in keep if c in OUTPUT_COLUMNS]
        if clash:
            raise JobInputError(f"config: data.keep_columns: {clash[0]!r} is an output column; rename it in the "
                                f"input to keep it")
    text = d.messages_column if d.chat else d.prompt_column
    for key in ("stop_column", "sampling_params_column"):
        column = getattr(d, key)
        if column is not None and (not column.strip() or column in (text, d.id_column)):
            raise JobInputError(f"config: data.{key} must be null or a column other than the prompt and id "
                                f"columns, got {column!r}")
    if d.chat_template is not None:
        chat_template_text(d.chat_template)
    kwargs = d.chat_template_kwargs
    if kwargs is not None and (not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs)):
        raise JobInputError(f"config: data.chat_template_kwargs must be null or a mapping, got {kwargs!r}")
    if not d.chat and (d.chat_template is not None or kwargs):
        raise JobInputError("config: data.chat_template and data.chat_template_kwargs need data.chat=true")


def chat_template_text(value: str) -> str:
    """data.chat_template: a Jinja template (it holds '{'), else the path of a file holding one."""
    if "{" in value:
        return value
    from pathlib import Path

    path = Path(value).expanduser()
    if not value.strip() or not path.is_file():
        raise JobInputError(f"config: data.chat_template must be a template (Jinja text) or the path of a "
                            f"template file, got {value!r} (no such file)")
    return path.read_text()


@dataclass(frozen=True)
class RowColumns:
    """What the scan resolved: the columns a worker reads besides prompt / id / budget, and the kept ones
    with their output Arrow types."""

    read: tuple[str, ...] = ()  # every extra column to read (kept, stop, sampling params)
    kept: tuple[tuple[str, Any], ...] = ()  # (name, pyarrow type) carried to the output
    stop_column: str | None = None
    params_column: str | None = None


def kept_names(d: Any, names: list[str]) -> list[str]:
    """The columns `data.keep_columns` names, given a file's column `names` ("all": all but prompt and id)."""
    if d.keep_columns == "all":
        text = d.messages_column if d.chat else d.prompt_column
        return [n for n in names if n not in (text, d.id_column)]
    return list(d.keep_columns or [])


def resolve_columns(d: Any, names: list[str], schema: Any, file_format: str, where: str,
                    kept_types: tuple[tuple[str, Any], ...] | None = None) -> RowColumns:
    """The configured extra columns against the input's column `names` (JobInputError for an unknown one);
    the kept columns' types: `kept_types` (the scan's `KeptTypes.result()`), else the schema's, else string."""
    import pyarrow as pa

    kept = kept_names(d, names)
    if d.keep_columns == "all":
        clash = [c for c in kept if c in OUTPUT_COLUMNS]
        if clash:
            raise JobInputError(f"data.keep_columns: input column {clash[0]!r} of {where} is an output column; "
                                f"list the columns to keep instead of 'all', or rename it")
    for key, columns in (("data.keep_columns", kept), ("data.stop_column", [d.stop_column]),
                         ("data.sampling_params_column", [d.sampling_params_column])):
        missing = [c for c in columns if c is not None and c not in names]
        if missing:
            raise JobInputError(_not_found(key, missing[0], where, names))
    known = dict(kept_types or ())
    typed = schema is not None and file_format in ("parquet", "hf_disk")
    types = tuple((c, known[c] if c in known else schema.field(c).type if typed else pa.string()) for c in kept)
    read = tuple(dict.fromkeys([*kept, *(c for c in (d.stop_column, d.sampling_params_column) if c)]))
    return RowColumns(read, types, d.stop_column, d.sampling_params_column)


def _not_found(key: str, column: str, where: str, names: list[str]) -> str:
    return f"{key}: column '{column}' not found in {where}; columns are: {', '.join(sorted(names)) or '(none)'}"


class KeptTypes:
    """The kept columns' output types, merged over what the scan sees: each Parquet / Arrow file's schema
    (`add_schema`), or pyarrow's inference on each JSON-lines / CSV block (`add_table`; `add_json_values`
    for a JSON-lines block pyarrow's reader rejected as a whole, one column at a time)."""

    def __init__(self, names: list[str]):
        import pyarrow as pa

        self.types: dict[str, Any] = dict.fromkeys(names, pa.null())
        self.declared = False  # Parquet / Arrow: a conflict between files is an error, not a string

    def result(self) -> tuple[tuple[str, Any], ...]:
        return tuple(self.types.items())

    def add(self, name: str, arrow_type: Any, where: str = "") -> None:
        import pyarrow as pa

        now = self.types[name]
        if now == arrow_type or (pa.types.is_string(now) and not self.declared):
            return
        try:
            merged = pa.unify_schemas([pa.schema([(name, now)]), pa.schema([(name, arrow_type)])],
                                      promote_options="permissive").field(name).type
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            if self.declared:
                raise JobInputError(f"data.keep_columns: column '{name}' holds {arrow_type} in {where} and {now} in "
                                    f"the files before it; its type must be one for the whole job") from None
            merged = pa.string()
        self.types[name] = merged

    def add_schema(self, schema: Any, where: str) -> None:
        """A typed file's schema (each kept column must be in it)."""
        self.declared = True
        for name in self.types:
            if name not in schema.names:
                raise JobInputError(_not_found("data.keep_columns", name, where, list(schema.names)))
            self.add(name, schema.field(name).type, where)

    def add_table(self, table: Any) -> None:
        """A block as pyarrow's JSON / CSV reader typed it (a column absent from the block: null)."""
        import pyarrow as pa

        for name in self.types:
            self.add(name, table.schema.field(name).type if name in table.column_names else pa.null())

    def add_json_values(self, name: str, values: list[Any]) -> None:
        """One column's values of a JSON-lines block, typed by pyarrow's JSON reader on that column alone
        (a string when it rejects them: numbers and strings mixed, say)."""
        import pyarrow as pa
        import pyarrow.json as pj

        lines = "".join(json.dumps({"v": v}) + "\n" for v in values).encode()
        try:
            table = pj.read_json(pa.BufferReader(lines), read_options=pj.ReadOptions(block_size=max(1 << 20, len(lines))))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            self.add(name, pa.string())
            return
        self.add(name, table.schema.field("v").type)


def carried(value: Any, file_format: str, arrow_type: Any = None) -> Any:
    """A kept value as the output stores it (JSON lines, a string column: non-strings as their JSON text)."""
    if file_format == "jsonl" and value is not None and not isinstance(value, str) and _is_text(arrow_type):
        return json.dumps(value)
    return value


def _is_text(arrow_type: Any) -> bool:
    import pyarrow as pa

    return arrow_type is None or pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


@dataclass
class RowSettings:
    """One row's own settings (None: the job's; `over` fills in the job's `JOB_KEYS`)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # added to spectr.stop
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: tuple[tuple[int, float], ...] | None = None
    n: int | None = None
    logprobs: int | None = None  # vLLM's: None, or how many top log-probabilities (0: the sampled token's only)
    presence_penalty: float | None = None  # vLLM's penalties and min_tokens (spectr.penalties): 0, 0, 1, 0 are off
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    structured_outputs: Any = None  # a `spectr.structured.StructuredSpec` (vLLM's structured_outputs / guided_decoding)
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: only these tokens may be sampled
    bad_words: tuple[str, ...] | None = None  # vLLM's: strings the row may not produce (tokenized by the actor)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's log-probability and the top N (None: none)
    truncate_prompt_tokens: int | None = None  # vLLM's: only the prompt's last k tokens are generated from
    detokenize: bool = True  # vLLM's: False writes no text (the tokens only)
    skip_special_tokens: bool = True  # vLLM's: False keeps the special tokens' text in the completion
    spaces_between_special_tokens: bool = True  # vLLM's

    def over(self, job: Any) -> RowSettings:
        """These settings with the job's value (`job_settings` of the job's `spectr.*`) wherever the row has
        none, for every `JOB_KEYS` name; the others stay None (the engine's own defaults are the job's)."""
        values = job_settings(job)
        job_logprobs = getattr(job, "logprobs", False)  # spectr.logprobs as vLLM's max_logprobs (None: off)
        top = job_logprobs if isinstance(job_logprobs, int) and not isinstance(job_logprobs, bool) else \
            (0 if job_logprobs is True else None)
        if self.logprobs is not None and (top is None or self.logprobs > top):
            raise ValueError(f"logprobs={self.logprobs}: the job writes " + (
                "no log-probabilities; set spectr.logprobs" if top is None else
                f"at most spectr.logprobs={top} alternatives per token; raise it") + f" to at least {self.logprobs} "
                "(vLLM's max_logprobs: the job's columns hold that many)")
        if not self.detokenize and (self.stop or getattr(job, "stop", None)):
            raise ValueError("stop strings need detokenize=True (the text is where they are found, as vLLM says)")
        return dataclasses.replace(self, **{k: v for k, v in values.items() if getattr(self, k) is None})

    def prompt_ids(self, token_ids: list[int]) -> list[int]:
        """The prompt the row generates from: vLLM's truncate_prompt_tokens=k keeps its last k tokens."""
        k = self.truncate_prompt_tokens
        return list(token_ids) if k is None or k >= len(token_ids) else list(token_ids[-k:])

    def decode_options(self) -> dict[str, bool]:
        """The tokenizer's `decode` options for the row's text (vLLM's skip_special_tokens and
        spaces_between_special_tokens; the latter only where special tokens are kept)."""
        if self.skip_special_tokens:
            return {"skip_special_tokens": True}
        return {"skip_special_tokens": False, "spaces_between_special_tokens": self.spaces_between_special_tokens}

    @property
    def own_stops(self) -> bool:
        """Whether the row ends on other tokens than the run's EOS ids (stop_token_ids, ignore_eos)."""
        return bool(self.stop_token_ids) or bool(self.ignore_eos)

    def engine_warp(self, job: Any) -> tuple | None:
        """The engine row's `Row.warp` (`spectr.SamplingWarp`'s fields, in its order) after `over`: None when the
        row samples by the job's temperature / top_k / top_p and nothing else (the batcher's own warp)."""
        penalties = (self.presence_penalty or 0.0, self.frequency_penalty or 0.0,
                     1.0 if self.repetition_penalty is None else self.repetition_penalty, self.min_tokens or 0)
        if (self.temperature, self.top_k, self.top_p) == (None, None, None) and not self.min_p \
                and not self.logit_bias and penalties == (0.0, 0.0, 1.0, 0) and self.structured_outputs is None \
                and not self.allowed_token_ids and not self.bad_words:
            return None
        warp = (job.temperature if self.temperature is None else self.temperature,
                job.top_k if self.top_k is None else self.top_k, job.top_p if self.top_p is None else self.top_p,
                self.min_p or 0.0, tuple(self.logit_bias or ()), *penalties)
        if self.bad_words:  # strings: the actor tokenizes them as vLLM does (spectr.bad_words.bad_words_token_ids)
            return (*warp, self.structured_outputs, tuple(self.allowed_token_ids or ()), tuple(self.bad_words))
        if self.allowed_token_ids:
            return (*warp, self.structured_outputs, tuple(self.allowed_token_ids))
        return warp if self.structured_outputs is None else (*warp, self.structured_outputs)

    def stop_ids(self, eos_token_ids: Any) -> tuple[int, ...] | None:
        """The tokens that end the row (vLLM's: the model's EOS unless ignore_eos, and stop_token_ids); None:
        the model's EOS ids, as for a row without its own."""
        if not self.own_stops:
            return None
        eos = [] if self.ignore_eos else list(eos_token_ids or [])
        return tuple(dict.fromkeys([*eos, *(self.stop_token_ids or [])]))


def job_settings(job: Any) -> dict[str, Any]:
    """The job's `JOB_KEYS` values (`spectr.*`, a `SpectrConfig`) in a row's shapes: logit_bias as sorted
    (token id, bias) pairs, stop_token_ids a list. ValueError naming `spectr.<key>` and vLLM's rule."""
    values = {}
    for key, off in JOB_KEYS.items():
        if key == "structured_outputs" and not hasattr(job, key):
            continue  # a config without the key (it is read where the job's config has it)
        value = getattr(job, key, off)
        try:
            if key == "logit_bias":
                value = _bias(value) if value is not None else ()
            elif key == "structured_outputs":
                value = _structured(value, key)
            elif key == "stop_token_ids":
                value = _token_ids(value, key) if value is not None else []
            elif isinstance(off, bool):
                value = _flag(value, key)
            else:
                value = _number(value, key, integer=isinstance(off, int))
                ok, rule = RANGES[key]
                if not ok(value):
                    raise ValueError(f"{key} must be {rule}, got {value!r}")
        except ValueError as err:
            raise ValueError(f"spectr.{err}") from None
        values[key] = value
    return values


def _number(value: Any, key: str, integer: bool) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not float(value).is_integer()):
        raise ValueError(f"{key} must be {'an int' if integer else 'a number'}, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{key} must be finite, got {value!r}")
    return int(value) if integer else float(value)


def _stop_strings(value: Any, key: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) and s for s in value):
        raise ValueError(f"{key} must be a list of non-empty strings, got {value!r}")
    return list(value)


def _params(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as err:
            raise ValueError(f"not a JSON object: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a struct or a JSON object, got {type(value).__name__}")
    unknown = sorted(k for k, v in value.items() if k not in SAMPLING_KEYS and k not in REFUSED_KEYS and v is not None)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(SAMPLING_KEYS)}")
    for key, reason in REFUSED_KEYS.items():
        if key in value and value[key] not in NEUTRAL[key]:
            raise ValueError(f"{key}={value[key]!r} is refused: {reason}")
    return {k: v for k, v in value.items() if v is not None and k not in REFUSED_KEYS}


def params_n(value: Any) -> int | None:
    """A row's sampling-params value -> its own `n` when it has a usable one (an int >= 1), else None: no `n`,
    or a value the worker refuses (`row_settings`' checks of the value's shape and names). The scan counts
    output rows with it (`SampleCounts`) and the worker writes that many error rows for a row it cannot run."""
    try:
        n = _params(value).get("n")
        n = None if n is None else _number(n, "n", integer=True)
    except ValueError:
        return None
    return n if n is not None and n >= 1 else None


@dataclass
class SampleCounts:
    """The plan's count of each row's n, from `data.sampling_params_column` in the scan's one pass (the scan
    calls `values` per batch, `value` per row on its line-by-line path; a row the scan cannot read counts the
    job's n, as its error rows do). `default`: spectr.num_samples (a row without its own n, or with an unusable
    value: `params_n`); `cap`: data.max_samples (None: every usable n is placed; a row over the cap fails with
    the job's n error rows). O(1) state: nothing here grows with the rows."""

    column: str
    default: int
    cap: int | None = None
    largest: int = 0  # the largest n placed (0: no row has its own)
    smallest: int = 0  # the smallest n of a row with its own
    extra: int = 0  # sum over the seen rows of (their rows - default)
    own: int = 0  # rows with their own n placed
    json_type: Any = None  # pyarrow's JSON reader infers it (a struct of any names, or a string)

    def _add(self, value: Any, count: int) -> None:
        n = params_n(value)
        if n is None or (self.cap is not None and n > self.cap):
            return
        self.extra += (n - self.default) * count
        self.own += count
        self.largest = max(self.largest, n)
        self.smallest = n if not self.smallest else min(self.smallest, n)

    def values(self, values: Any, ids: Any, first_row: int, where: str, text: bool = False) -> None:
        """A batch of the column's values (a struct, or JSON text: each distinct text parsed once)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
            counts = pc.value_counts(values)
            for value, count in zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist()):
                self._add(value, count)
        else:
            for value in values.to_pylist():
                self._add(value, 1)

    def value(self, value: Any, row: int, row_id: Any, where: str) -> None:
        self._add(value, 1)

    @property
    def placed(self) -> int:
        """Samples per prompt the plan places: the cap, else the largest n (at least the job's)."""
        return self.cap if self.cap is not None else max(self.default, self.largest)

    def sample_range(self, num_rows: int) -> tuple[int, int]:
        """The fewest and most samples of one prompt over the job's `num_rows` rows."""
        low = min(self.smallest or self.default, self.default) if self.own < num_rows else self.smallest
        high = max(self.largest, self.default) if self.own < num_rows else self.largest
        return low, high

    def output_rows(self, num_rows: int) -> int:
        """The rows the job writes for `num_rows` input rows (the scan's)."""
        return num_rows * self.default + self.extra


def _token_ids(value: Any, key: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise ValueError(f"{key} must be a list of token ids (ints >= 0), got {value!r}")
    return [int(t) for t in value]


def _bias(value: Any) -> tuple[tuple[int, float], ...]:
    if isinstance(value, (list, tuple)) and all(isinstance(e, dict) and set(e) == {"key", "value"} for e in value):
        value = {e["key"]: e["value"] for e in value}  # a Parquet map column reads back as key/value pairs
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be an object of token id -> bias, got {value!r}")
    out = []
    for token, bias in value.items():
        token = int(token) if isinstance(token, str) and token.isdigit() else token
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
        bias = _number(bias, f"logit_bias[{token}]", integer=False)  # finite: an infinite bias is refused
        out.append((token, min(BIAS_LIMIT, max(-BIAS_LIMIT, bias))))  # vLLM clamps to [-100, 100]
    return tuple(sorted(out))


def _structured(value: Any, key: str) -> Any:
    """vLLM's structured_outputs value (an object, a struct, or its JSON text) -> a `spectr.structured.StructuredSpec`
    or None; ValueError naming the key and the problem (an unknown key inside, an invalid schema, regex, grammar)."""
    from spectr.structured import parse_structured

    if value is not None and not isinstance(value, (str, dict)) and hasattr(value, "items"):
        value = dict(value.items())  # an OmegaConf mapping (spectr.structured_outputs)
    if isinstance(value, dict):  # a Parquet struct reads back with every field: the absent ones None
        value = {k: (list(v) if isinstance(v, tuple) else v) for k, v in value.items() if v is not None}
        if isinstance(value.get("json"), dict):
            value["json"] = _plain(value["json"])
    return parse_structured(value, key)


def _plain(value: Any) -> Any:
    """OmegaConf containers -> dicts and lists (a schema given as Hydra overrides)."""
    if hasattr(value, "items"):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or (hasattr(value, "__iter__") and not isinstance(value, (str, bytes))):
        return [_plain(v) for v in value]
    return value


def _output_kind(value: Any) -> None:
    """vLLM's output_kind (how a server streams a request's outputs): a batch writes each row once, whatever it says;
    a value vLLM does not have is refused."""
    kinds = ("CUMULATIVE", "DELTA", "FINAL_ONLY")
    name = getattr(value, "name", value)  # vLLM's RequestOutputKind, its name, or its value 0 / 1 / 2
    if not (name in kinds or (isinstance(name, int) and not isinstance(name, bool) and 0 <= name < len(kinds))):
        raise ValueError(f"output_kind must be one of {', '.join(kinds)} (or 0, 1, 2), got {value!r}")


def _flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def row_settings(params: Any, stop: Any, params_key: str, stop_key: str) -> RowSettings:
    """A row's sampling-params value and stop-column value -> its settings (ValueError naming the problem)."""
    settings = RowSettings(stop=_stop_strings(stop, stop_key))
    try:
        values = _params(params)
        for key in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if key in values:
                setattr(settings, key, _number(values[key], key, integer=False))
        for key in ("top_k", "max_tokens", "seed", "n", "min_tokens", "prompt_logprobs", "truncate_prompt_tokens"):
            if key in values:
                setattr(settings, key, _number(values[key], key, integer=True))
        if settings.top_k == -1:
            settings.top_k = 0  # vLLM's "off"
        if settings.seed == -1:
            settings.seed = None  # no seed: the job's (derived from spectr.seed and the row's id)
        if values.get("allowed_token_ids") is not None:
            settings.allowed_token_ids = tuple(_token_ids(values["allowed_token_ids"], "allowed_token_ids"))
            if not settings.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (no token could be sampled)")
        if values.get("bad_words") is not None:
            settings.bad_words = tuple(_stop_strings(values["bad_words"], "bad_words")) or None
        settings.stop += _stop_strings(values.get("stop"), "stop")
        if "stop_token_ids" in values:
            settings.stop_token_ids = _token_ids(values["stop_token_ids"], "stop_token_ids")
        for key in ("ignore_eos", "include_stop_str_in_output", *TEXT_KEYS):
            if key in values:
                setattr(settings, key, _flag(values[key], key))
        if "output_kind" in values:
            _output_kind(values["output_kind"])
        if "logit_bias" in values:
            settings.logit_bias = _bias(values["logit_bias"])
        given = [k for k in STRUCTURED_KEYS if values.get(k) is not None]
        if len(given) > 1:
            raise ValueError("structured_outputs and guided_decoding (its older name) may not both be set")
        if given:
            settings.structured_outputs = _structured(values[given[0]], given[0])
        if "logprobs" in values:
            value = values["logprobs"]
            settings.logprobs = (0 if value else None) if isinstance(value, bool) else _number(value, "logprobs", True)
    except ValueError as err:
        raise ValueError(f"{params_key}: {err}") from None
    for key, (ok, rule) in RANGES.items():
        value = getattr(settings, key)
        if value is not None and not ok(value):
            raise ValueError(f"{params_key}: {key} must be {rule}, got {value!r}")
    if settings.max_tokens is not None and (settings.min_tokens or 0) > settings.max_tokens:
        raise ValueError(f"{params_key}: min_tokens ({settings.min_tokens}) must be <= max_tokens "
                         f"({settings.max_tokens})")
    return settings
