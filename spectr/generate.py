"""The public entry point: `spectr.generate` over a Hugging Face draft/target pair, batched.

`generate(target, draft, prompts, ...)` (a fixed method; the public `spectr.generate` in
`spectr.api` adds `method="auto"` on top of it and of `spectr.planner`) runs `Generation`: every prompt is admitted, in
order, to a `spectr.batching.ContinuousBatcher` of `batch_size` slots (all prompts at once
by default); when a row finishes, the next waiting prompt takes its slot, and the outputs and
statistics come back in prompt order. One iteration (draft -> verify -> select -> commit) is
`spectr.iteration`; the rows' device state and admission are `spectr.rows`.

`method` is chosen by name: "autoregressive" is the plain target-only loop with the same
cache, warps and random streams; the others are the selection methods of
`spectr.selection` / `spectr.sequence`.

Randomness: each row's uniforms come from its counter-based stream (spectr.rng), keyed by its
seed and its own iteration count, so a row's output depends neither on its batch nor on the
iteration at which it was admitted.

This module knows nothing about tokenizers, Ray or files: prompts are lists of token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spectr.bad_words import bad_words_token_ids
from spectr.batching import ContinuousBatcher, FinishedRow, known_methods
from spectr.rows import prefill
from spectr.settings import Settings, check_prompts
from spectr.stats import GenerationStats
from spectr.structured import StructuredCompiler, StructuredSpec, parse_structured
from spectr.warps import split_row_warps

__all__ = ["Generation", "GenerationOutput", "generate", "known_methods", "prefill"]


@dataclass
class GenerationOutput:
    """tokens[i]: generated ids of prompt i (prompt excluded, EOS included if produced); logprobs[i]
    (with `logprobs=True`): per token, its log-probability under the warped target law it was drawn from."""

    tokens: list[list[int]]
    stats: GenerationStats
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None  # with top_logprobs=N: per token, N (id, log-prob)
    chooser: Any = None  # method="auto": the `spectr.planner.chooser.OnlineChooser` that ran it


def generate(
    target,
    draft,
    prompts: Sequence[Sequence[int]],
    *,
    method: str = "spectr",
    num_drafts: int = 4,
    draft_length: int = 4,
    max_new_tokens: int | Sequence[int] = 64,
    temperature: float | Sequence[float] = 1.0,
    top_k: int | Sequence[int] = 0,
    top_p: float | Sequence[float] = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    seed: int | Sequence[int] = 0,
    batch_size: int | None = None,
    logprobs: bool | str = False,
    compile: bool | str = False,
    min_p: float | Sequence[float] = 0.0,
    logit_bias: dict | Sequence[dict | None] | None = None,
    top_logprobs: int = 0,
    presence_penalty: float | Sequence[float] = 0.0,
    frequency_penalty: float | Sequence[float] = 0.0,
    repetition_penalty: float | Sequence[float] = 1.0,
    min_tokens: int | Sequence[int] = 0,
    **row_fields: Any,
) -> GenerationOutput:
    """Generate up to `max_new_tokens` tokens per prompt from `target`, exactly its (warped) distribution.

    target, draft: Hugging Face causal LMs sharing a vocabulary (`draft` may be None for
    "autoregressive"). prompts: list of token-id lists. method: "autoregressive", "speculative" (one draft:
    num_drafts is taken as 1), "spectr", "specinfer", "block" (block verification of one draft, num_drafts taken
    as 1), "traversal" (the K drafts verified as one tree, `spectr.traversal`; K = 1 is block). The package's `spectr.generate`
    (`spectr.api.generate`) also takes "auto", which `spectr.planner` runs; this one does not.
    max_new_tokens: an int or one int per prompt. eos_token_id: None, an int or a list of ints.
    top_k=0 / top_p=1.0 mean no truncation; temperature=0 is greedy (and drafts one path:
    K identical argmax drafts would add nothing). seed: an int (row i uses seed + i) or one
    int per prompt; a row's output depends only on its prompt, its seed, the models and the
    settings. batch_size: rows in flight; None = all prompts at once, else prompts are admitted
    in order and a finished row's slot takes the next waiting prompt (continuous batching; the
    output is the same). temperature / top_k / top_p: one value, or one per prompt (a list or an [N]
    tensor): rows of different warps share the batch, each exact for its own warped law.
    logprobs: also return, per generated token, its log-probability under the warped target law it
    was sampled from ("raw": under the target's raw law, its log-softmax, vLLM's default) (read back with
    the tokens, no extra device read). compile: False (eager HF
    forwards), True (Llama / Qwen2 models run `spectr.native`'s forward under torch.compile; other
    models stay eager) or "auto" (compiled where it pays: `spectr.native.auto_compile`). min_p (vLLM's: 0 =
    off) and logit_bias (a {token id: bias} dict): one value, or one per prompt; applied to both models'
    logits like the other warps (`spectr.warps`). top_logprobs=N: also each token's N most likely tokens and
    their log-probabilities, from the same law as `logprobs` (`output.top_logprobs`). presence_penalty,
    frequency_penalty, repetition_penalty and min_tokens (vLLM's; one value or one per prompt): counted, at every
    node of the draft tree, on that node's own path, on both models' logits (`spectr.penalties`). Bad input raises
    ValueError naming the argument and, per prompt, the row. row_fields: structured_outputs (with `tokenizer`),
    allowed_token_ids, bad_words (vLLM's; one for every row or one per prompt), as `Generation` takes them.
    """
    return _run(Generation(target, draft, prompts, method=method, num_drafts=num_drafts, draft_length=draft_length,
                           max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                           eos_token_id=eos_token_id, seed=seed, batch_size=batch_size, logprobs=logprobs,
                           compile=compile, min_p=min_p, logit_bias=logit_bias, top_logprobs=top_logprobs,
                           presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                           repetition_penalty=repetition_penalty, min_tokens=min_tokens, **row_fields))


def _run(generation: Generation) -> GenerationOutput:
    models = [m.model for m in (generation.target, generation.draft) if m is not None]
    was_training = [m.training for m in models]
    try:
        for m in models:
            m.eval()  # dropout off: the output law is the model's, not a dropout ensemble's
        with torch.inference_mode():
            generation.start()
            while not generation.done:
                generation.step()
            generation.finish()
    finally:
        for m, training in zip(models, was_training):
            m.train(training)
    return generation.output()


def structured_specs(value, count: int, tokenizer, target) -> list[StructuredSpec | None] | None:
    """`structured_outputs` (None, one spec for every row, or one per prompt) -> checked specs with a compiler of
    `tokenizer` (a `StructuredCompiler` is used as is, else one is made for the target's vocabulary). ValueError
    naming the prompt and the problem."""
    if value is None:
        return None
    per_row = isinstance(value, (list, tuple))
    if per_row and len(value) != count:
        raise ValueError(f"structured_outputs has {len(value)} entries but there are {count} prompts")
    values = list(value) if per_row else [value] * count
    parsed: dict[int, StructuredSpec | None] = {}
    specs = []
    for row, item in enumerate(values):
        if id(item) not in parsed:  # one parse of a value shared by many rows
            parsed[id(item)] = parse_structured(item, f"prompt {row}: structured_outputs")
        specs.append(parsed[id(item)])
    if not any(specs):
        return None
    if tokenizer is None:
        raise ValueError("structured_outputs need the tokenizer: pass tokenizer= (the pair's fast tokenizer)")
    compiler = tokenizer if isinstance(tokenizer, StructuredCompiler) else StructuredCompiler(
        tokenizer, vocab_size=getattr(getattr(target, "config", None), "vocab_size", None))
    for row, spec in enumerate(specs):
        if spec is not None:
            try:
                compiler.matcher(spec)  # compiled once per text; an invalid one is this prompt's error
            except ValueError as error:
                raise ValueError(f"prompt {row}: {error}") from None
    return [None if spec is None else spec.with_compiler(compiler) for spec in specs]


def bad_word_ids(value, count: int, tokenizer) -> list | None:
    """`bad_words` (one list for every row, or one list or None per prompt; strings or token-id sequences) -> one
    tuple of token-id sequences per prompt (strings tokenized as vLLM's, `spectr.bad_words.bad_words_token_ids`)."""
    if not value:
        return None
    per_row = all(w is None or (isinstance(w, (list, tuple)) and not any(isinstance(t, int) for t in w))
                  for w in value)
    if per_row and len(value) != count:
        raise ValueError(f"bad_words has {len(value)} entries but there are {count} prompts")
    rows = list(value) if per_row else [value] * count
    out = []
    for row, words in enumerate(rows):
        strings = [w for w in words or () if isinstance(w, str)]
        if strings and not hasattr(tokenizer, "encode"):
            raise ValueError(f"prompt {row}: bad_words as strings need the tokenizer (tokenizer=, with .encode)")
        ids = bad_words_token_ids(strings, tokenizer) if strings else ()
        out.append(ids + tuple(tuple(w) for w in words or () if not isinstance(w, str)))
    return out if any(out) else None


def check_batch_size(batch_size) -> None:
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be None or an int >= 1, got {batch_size!r}")


class Generation:
    """One `generate` call, step by step: `start()` (first admission), `step()` until `done`, `finish()`.

    `spectr.generate` is the usual entry point; this class exists so that tests (and callers
    that want to inspect caches between iterations) can drive the loop themselves. It admits
    every prompt to a `ContinuousBatcher` sized for them (`batch_size` slots, capacity from the
    longest prompt + budget) and puts the finished rows back in prompt order. The constructor
    validates everything and raises ValueError naming the bad argument or row. `make_batcher`
    (default `ContinuousBatcher`, same arguments) lets a caller above the engine run the rows on
    another batcher with that surface (`spectr.planner.AutoBatcher`). Drive it under
    `torch.inference_mode()` with models in eval mode.

    vLLM's row fields beyond the warps (each one value for every row, or one per prompt): structured_outputs (an
    object with one of `json`, `json_object`, `regex`, `choice`, `grammar`, or a `spectr.structured.StructuredSpec`)
    masks each row's law by its grammar at every node of the draft tree (`spectr.structured`), with `tokenizer` (the
    pair's fast tokenizer, or a `StructuredCompiler` to share compiled grammars across calls); allowed_token_ids (a
    list of ids) lets only those be sampled; bad_words (strings, tokenized by `tokenizer` as vLLM does, or token-id
    sequences) refuses a word's last token wherever the output so far ends with the rest of it (`spectr.bad_words`).
    """

    def __init__(self, target, draft, prompts, *, method="spectr", num_drafts=4, draft_length=4,
                 max_new_tokens=64, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, seed=0,
                 batch_size: int | None = None, pack_below: float | None = None, make_batcher=None,
                 logprobs: bool | str = False, compile: bool | str = False, min_p=0.0, logit_bias=None,
                 top_logprobs: int = 0, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                 min_tokens=0, structured_outputs=None, tokenizer=None, allowed_token_ids=None, bad_words=None):
        self.prompts = check_prompts(prompts)
        check_batch_size(batch_size)
        specs = structured_specs(structured_outputs, len(self.prompts), tokenizer, target)
        (temperature, top_k, top_p), warps = split_row_warps(temperature, top_k, top_p, len(self.prompts), min_p,
                                                             logit_bias, presence_penalty, frequency_penalty,
                                                             repetition_penalty, min_tokens, specs,
                                                             allowed_token_ids,
                                                             bad_word_ids(bad_words, len(self.prompts), tokenizer))
        self.settings = Settings.from_arguments(
            self.prompts, methods=known_methods(), method=method, num_drafts=num_drafts,
            draft_length=draft_length, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
            top_p=top_p, eos_token_id=eos_token_id, seed=seed)
        count = len(self.prompts)
        longest = max((len(p) + n for p, n in zip(self.prompts, self.settings.max_new_tokens)), default=2)
        self.batcher = (make_batcher or ContinuousBatcher)(
            target, draft, batch_size=max(1, min(batch_size or count, count)), max_length=longest,
            method=method, num_drafts=num_drafts, draft_length=draft_length, temperature=temperature, top_k=top_k,
            top_p=top_p, eos_token_id=eos_token_id, pack_below=pack_below, logprobs=logprobs, compile=compile,
            top_logprobs=top_logprobs)
        self.batcher.admit(self.prompts, max_new_tokens=list(self.settings.max_new_tokens),
                           seed=list(self.settings.seeds), warps=warps)
        self.logprobs: list[list[float]] | None = None
        self.top_logprobs: list | None = None
        self.target, self.draft = self.batcher.target, self.batcher.draft
        self.method = self.settings.method
        self.finished: dict[int, FinishedRow] = {}
        self.tokens: list[list[int]] = [[] for _ in self.prompts]
        self.stats = self.batcher.stats

    @property
    def done(self) -> bool:
        return self.batcher.idle

    @property
    def rows(self):
        """The pool's row state (`spectr.rows.RowState`): running, pending, caches, drafter."""
        return self.batcher.rows

    def start(self) -> None:
        """Prefill the first `batch_size` prompts (every token but the last, which becomes pending). No host sync."""
        self.batcher.fill()

    def step(self) -> None:
        """One iteration (admitting waiting prompts into free slots first)."""
        for row in self.batcher.step():
            self.finished[row.request] = row

    def finish(self) -> None:
        """Put the rows in prompt order and close the timers (reads nothing more from the device)."""
        self.batcher.loop.timer.finish(self.stats)
        self.stats.compile_seconds = self.batcher.compile_seconds()
        rows = [self.finished[i] for i in range(len(self.prompts))]
        self.tokens = [row.tokens for row in rows]
        if rows and rows[0].logprobs is not None:
            self.logprobs = [row.logprobs for row in rows]
        if rows and rows[0].top_logprobs is not None:
            self.top_logprobs = [row.top_logprobs for row in rows]
        for row in rows:
            self.stats.add_row(row)

    def output(self) -> GenerationOutput:
        return GenerationOutput(tokens=self.tokens, stats=self.stats, logprobs=self.logprobs,
                                top_logprobs=self.top_logprobs)

    def row_sequences(self) -> list[list[int]]:
        """Prompt + generated tokens of the row in each occupied slot, in slot order (reads the device: for tests)."""
        lengths = self.batcher.records.lengths.tolist()
        tokens = self.batcher.records.tokens.tolist()
        occupants = self.batcher._in_slot
        return [self.prompts[r.request] + tokens[slot][: lengths[slot]]
                for slot, r in enumerate(occupants) if r is not None]
