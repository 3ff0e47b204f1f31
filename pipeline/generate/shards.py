"""Shards: fixed ranges of the output rows, their part-file names, the per-row seed, and loading one.

The job writes one output row per prompt and sample (`spectr.num_samples`, or a row's own `n` up to
`data.max_samples`), and its shards are sized by those output rows (`shard_layout`): the input is cut into
blocks of `shard_size` prompts, and each block's samples into ranges of `samples_per_shard`, so shard i holds
prompts [b * shard_size, (b + 1) * shard_size) x samples [j * samples_per_shard, (j + 1) * samples_per_shard)
with b, j = divmod(i, sample_splits). One prompt with many samples thus spreads over several shards (and
actors); with one sample per prompt a shard is a block of rows, as it always was. The same data and layout
always give the same shards (which is what makes resume possible), and a sample's seed
(`sample_seed(row seed, sample index)`) does not depend on the layout, so neither do the rows. The driver
hands out a `ShardTask` (an index, a row range and a sample range: a few integers); the worker turns it
into a `Shard` with
`load_shard`: it reads the rows (`pipeline.prompts.read_rows`, with each row's budget when
`data.max_new_tokens_column` is set), renders chat messages, tokenizes, and computes each row's seed, a hash of `spectr.seed` and the row's id that does not depend on the row's
position, its shard, its batch or the number of actors.

This module does not run the model; `pipeline.generate.worker` turns a `Shard` into rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Any

from pipeline import models
from pipeline.config import DataConfig
from pipeline.prompts import PromptRows, ReadCache, read_rows
from pipeline.source import Source

MIN_PART_DIGITS = 6
# shard_size=null: the job's shard size (`auto_shard_size`)
SHARD_GRANULE = 16  # a multiple of this, so that the plan's scan can record offsets before it knows the size
SHARD_TARGET_ROWS = 256  # enough rows per part for a GPU's continuous batch ...
MIN_SHARDS = 64  # ... but at least this many shards (several per actor) on small jobs ...
MAX_PARTS = 2000  # ... and at most this many part files on large ones (1M prompts: 1,954 parts of 512)
# many samples per prompt: shards of fewer than SHARD_GRANULE prompts only on inputs this small (such a shard reads
# its whole granule: the rows around it are read again, a compressed file's stream restarted)
SMALL_INPUT = MIN_SHARDS * SHARD_GRANULE


@dataclass(frozen=True)
class ShardLayout:
    """How the job's output rows are cut: blocks of `shard_size` prompts (input rows), each block's
    `samples` samples per prompt in ranges of `samples_per_shard` (the last range may be shorter). The
    source's own `shard_size` (its scan's offsets) may be larger: `load_shard` reads the granule around."""

    num_rows: int  # prompts
    shard_size: int  # prompts per block
    samples: int = 1  # samples per prompt the plan places (spectr.num_samples, or data.max_samples)
    samples_per_shard: int = 1  # samples of each prompt in one shard

    @property
    def sample_splits(self) -> int:
        """Shards per block of prompts."""
        return -(-self.samples // self.samples_per_shard)

    @property
    def num_shards(self) -> int:
        return num_shards(self.num_rows, self.shard_size) * self.sample_splits

    @property
    def output_rows(self) -> int:
        """Output rows when every prompt gives `samples` rows (an upper bound when rows have their own n)."""
        return self.num_rows * self.samples

    def task(self, index: int) -> ShardTask:
        block, split = divmod(index, self.sample_splits)
        start = block * self.shard_size
        first = split * self.samples_per_shard
        return ShardTask(index, start, min(self.num_rows, start + self.shard_size), sample_start=first,
                         sample_stop=min(self.samples, first + self.samples_per_shard))


def shard_layout(num_rows: int, samples: int = 1, shard_size: int | None = None) -> ShardLayout:
    """The shards of `num_rows` prompts x `samples` samples, sized by output rows.

    shard_size: output rows per shard (None: `auto_shard_size` of the output rows). A block holds
    shard_size // samples prompts, at least one, with all their samples, so that the samples of a prompt
    share its prefill in one actor's batch; when one prompt's samples are more than shard_size rows, its
    samples are split into ranges, so that every actor gets some of them. Auto: a block of SHARD_GRANULE
    prompts or more is a multiple of it (the scan's JSONL/CSV offsets are every SHARD_GRANULE rows); fewer
    only on inputs of at most SMALL_INPUT prompts (a block inside a granule is read with its granule).
    A pure function of its arguments: resume re-plans the same shards (the manifest records the result)."""
    if samples < 1:
        raise ValueError(f"shard_layout: samples must be >= 1, got {samples}")
    rows = auto_shard_size(num_rows * samples) if shard_size is None else shard_size
    block = max(1, rows // samples)
    if shard_size is None and samples > 1:
        block = block // SHARD_GRANULE * SHARD_GRANULE if block >= SHARD_GRANULE or num_rows > SMALL_INPUT \
            else block
        block = max(block, 1 if num_rows <= SMALL_INPUT else SHARD_GRANULE)
    wanted = min(block, num_rows) * samples / rows  # shards for one block's rows: at most (explicit), about (auto)
    splits = min(samples, max(1, math.ceil(wanted) if shard_size is not None else int(wanted)))
    return ShardLayout(num_rows, block, samples, -(-samples // splits))


@dataclass(frozen=True)
class ShardTask:
    """What the driver sends a worker: which shard, which rows, which attempt. No row data.

    The attempt fences the writer: every attempt writes `part-NNNNNN-<run>-<attempt>.parquet`, its run's tag
    included, so a late writer (one the driver gave up on, or one of an earlier, killed run: its first attempt
    at a shard is attempt 0 too) never replaces the part the commit log names; the run's cleanup removes the
    parts the log does not name."""

    index: int
    start: int
    stop: int
    attempt: int = 0  # dispatches of this shard in this run before this one
    run: str = ""  # this run's tag (`JobPlan.run_tag`)
    fresh: bool = True  # no run has listed this shard in the commit log
    sample_start: int = 0  # the samples of each prompt this shard holds: [sample_start, sample_stop) ...
    sample_stop: int | None = None  # ... None: all of them (0 to the row's n)

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def output_rows(self) -> int:
        """The output rows it writes: prompts x its samples (rows with a smaller own n write fewer)."""
        return len(self) * (1 if self.sample_stop is None else self.sample_stop - self.sample_start)

    @property
    def fence(self) -> str:
        """The part name's attempt suffix: `<run>-<attempt>` ('' only for a task of no run: tests and tools)."""
        return f"{self.run}-{self.attempt}" if self.run else (str(self.attempt) if self.attempt else "")

    def again(self) -> ShardTask:
        """The same shard's next attempt (a new part name: the last attempt may still write late)."""
        return dataclasses.replace(self, attempt=self.attempt + 1)


@dataclass(frozen=True)
class Shard:
    """One shard's rows in memory (on a worker). `problems[i]`: why row i cannot be generated;
    `max_new_tokens[i]`: row i's budget from `data.max_new_tokens_column` (None: `spectr.max_new_tokens`)."""

    index: int
    ids: list[Any]
    prompts: list[str | None]
    prompt_token_ids: list[list[int]]
    seeds: list[int]
    problems: list[str | None] | None = None
    max_new_tokens: list[int | None] | None = None
    extras: dict[str, list[Any]] | None = None  # kept / stop / sampling-params columns (pipeline.row_columns)
    sample_start: int = 0  # the samples of each row to generate: [sample_start, sample_stop) ...
    sample_stop: int | None = None  # ... None: all of the row's n (`ShardTask`'s sample range)

    def __len__(self) -> int:
        return len(self.ids)

    def problem(self, i: int) -> str | None:
        return self.problems[i] if self.problems else None


def row_seed(base_seed: int, row_id: Any) -> int:
    """A 63-bit seed for one row, from the job seed and the row id (int and str ids never collide)."""
    key = f"{int(base_seed)}\x00{type(row_id).__name__}\x00{row_id}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)


def sample_seed(seed: int, sample_index: int) -> int:
    """The seed of sample `sample_index` of a row seeded `seed` (`spectr.num_samples`): the row's own seed for
    sample 0 (one sample is the row as without num_samples), a hash of (seed, index) for the others."""
    if sample_index == 0:
        return seed
    key = f"{int(seed)}\x00sample\x00{int(sample_index)}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)


def auto_shard_size(num_rows: int) -> int:
    """The default shard size for `num_rows` prompts: SHARD_TARGET_ROWS, less on small jobs (MIN_SHARDS
    shards, never under SHARD_GRANULE rows), more on large ones (at most MAX_PARTS part files); a multiple of
    SHARD_GRANULE."""
    wanted = max(SHARD_GRANULE, -(-num_rows // MAX_PARTS), min(SHARD_TARGET_ROWS, -(-num_rows // MIN_SHARDS)))
    return -(-wanted // SHARD_GRANULE) * SHARD_GRANULE


def num_shards(num_rows: int, shard_size: int) -> int:
    return (num_rows + shard_size - 1) // shard_size


def shard_task(index: int, num_rows: int, shard_size: int) -> ShardTask:
    return ShardTask(index, index * shard_size, min(num_rows, (index + 1) * shard_size))


def part_digits(total_shards: int) -> int:
    """At least 6 digits, more when needed, so that lexical order is row order."""
    return max(MIN_PART_DIGITS, len(str(max(0, total_shards - 1))))


def part_name(index: int, digits: int = MIN_PART_DIGITS, fence: str = "") -> str:
    """`part-NNNNNN-<fence>.parquet` (`ShardTask.fence`), or `part-NNNNNN.parquet` with no fence."""
    return f"part-{index:0{digits}d}{'-' + fence if fence else ''}.parquet"


def cut_shards(
    ids: list[Any],
    prompts: list[str],
    prompt_token_ids: list[list[int]],
    shard_size: int,
    base_seed: int,
    max_new_tokens: list[int] | None = None,
) -> list[Shard]:
    """In-memory shards of already tokenized rows (tests and tools; the job loads shards on the workers)."""
    if not (len(ids) == len(prompts) == len(prompt_token_ids)):
        raise ValueError(
            f"cut_shards: ids ({len(ids)}), prompts ({len(prompts)}) and token ids ({len(prompt_token_ids)}) "
            "must have the same length"
        )
    if shard_size < 1:
        raise ValueError(f"cut_shards: shard_size must be >= 1, got {shard_size}")
    shards = []
    for index in range(num_shards(len(ids), shard_size)):
        rows = slice(index * shard_size, (index + 1) * shard_size)
        shard_ids = ids[rows]
        shards.append(
            Shard(
                index=index,
                ids=list(shard_ids),
                prompts=list(prompts[rows]),
                prompt_token_ids=[list(t) for t in prompt_token_ids[rows]],
                seeds=[row_seed(base_seed, row_id) for row_id in shard_ids],
                max_new_tokens=None if max_new_tokens is None else list(max_new_tokens[rows]),
            )
        )
    return shards


def load_shard(
    task: ShardTask, source: Source, tokenizer: Any, data: DataConfig, base_seed: int, cache: ReadCache | None = None
) -> Shard:
    """Read, render (chat) and tokenize one shard's rows; a row that cannot be used keeps its problem."""
    rows = read_rows(source, *_aligned(source, task.start, task.stop), cache)
    skip = task.start % source.shard_size  # a block inside the source's granule: its rows of the granule
    if skip or len(rows) != len(task):
        rows = _rows_slice(rows, skip, skip + len(task))
    shard = shard_of_rows(task.index, rows, tokenizer, data, base_seed)
    return dataclasses.replace(shard, sample_start=task.sample_start, sample_stop=task.sample_stop)


def _aligned(source: Source, start: int, stop: int) -> tuple[int, int]:
    """[start, stop) widened to the source's granule (its JSONL/CSV offsets are at multiples of it)."""
    size = source.shard_size
    return start - start % size, min(source.num_rows, stop + (-stop) % size)


def _rows_slice(rows: PromptRows, start: int, stop: int) -> PromptRows:
    def cut(values):
        return None if values is None else values[start:stop]

    return dataclasses.replace(rows, ids=rows.ids[start:stop], texts=cut(rows.texts), messages=cut(rows.messages),
                               problems=rows.problems[start:stop], budgets=cut(rows.budgets),
                               extras=None if rows.extras is None else {k: v[start:stop] for k, v in rows.extras.items()})


def shard_of_rows(index: int, rows: PromptRows, tokenizer: Any, data: DataConfig, base_seed: int) -> Shard:
    """Rows already read (the job's `read_rows`, or a Ray Data batch) rendered (chat) and tokenized."""
    problems = list(rows.problems)
    texts = _texts(rows, tokenizer, data, problems)
    # a chat template writes its own special tokens (as apply_chat_template(tokenize=True) does)
    add_special_tokens = data.add_special_tokens and not data.chat
    token_ids = _tokenize(tokenizer, texts, add_special_tokens, problems)
    return Shard(
        index=index,
        ids=list(rows.ids),
        prompts=texts,
        prompt_token_ids=token_ids,
        seeds=[row_seed(base_seed, row_id) for row_id in rows.ids],
        problems=problems,
        max_new_tokens=rows.budgets,
        extras=rows.extras,
    )


def _texts(rows: PromptRows, tokenizer: Any, data: DataConfig, problems: list[str | None]) -> list[str | None]:
    if not data.chat:
        return list(rows.texts or [])
    texts: list[str | None] = []
    for i, messages in enumerate(rows.messages or []):
        if problems[i]:
            texts.append(None)
            continue
        try:
            texts.append(models.render_prompts(tokenizer, data, None, [messages])[0])
        except Exception as err:  # noqa: BLE001 - a template that fails on one row fails only that row
            problems[i] = f"data.messages_column: row {rows.ids[i]!r}: the chat template failed: {type(err).__name__}: {err}"
            texts.append(None)
    return texts


def _tokenize(
    tokenizer: Any, texts: list[str | None], add_special_tokens: bool, problems: list[str | None]
) -> list[list[int]]:
    usable = [i for i, text in enumerate(texts) if text is not None and not problems[i]]
    token_ids: list[list[int]] = [[] for _ in texts]
    try:
        encoded = models.tokenize(tokenizer, [texts[i] for i in usable], add_special_tokens)
    except Exception:  # noqa: BLE001 - retried row by row below, so only the failing rows fail
        encoded = []
        for i in usable:
            try:
                encoded.append(models.tokenize(tokenizer, [texts[i]], add_special_tokens)[0])
            except Exception as err:  # noqa: BLE001
                problems[i] = f"tokenizing row {i} failed: {type(err).__name__}: {err}"
                encoded.append([])
    for i, ids in zip(usable, encoded):
        token_ids[i] = ids
    return token_ids
