"""Structured outputs (vLLM's `structured_outputs`): a grammar mask as one more path-dependent warp of both laws.

A row may carry a `StructuredSpec` (vLLM's keys: `json` a JSON schema, `json_object`, `regex`, `choice`, `grammar`
(Lark, as llguidance reads it; GBNF is converted), plus `whitespace_pattern` / `disable_any_whitespace`;
`parse_structured` reads them). Its grammar is compiled by llguidance (`StructuredCompiler`: the tokenizer's
vocabulary is given to it once, each grammar compiled once per text and copied per row).

The law at a node of the draft tree: the target's (or the draft's) logits with the tokens the grammar refuses after
*that node's own path* (the row's committed tokens + the node's draft ancestors) at -inf, then the other warps
(`spectr.warps.RowWarps.probs`: the mask first, as vLLM applies the grammar bitmask before its sampler). Both
models' laws are masked identically at every node, so every selection rule reproduces the masked target law.
End-of-sequence: the row's stop tokens are allowed exactly where the grammar accepts; once the grammar can take no
more text only they are, so a completed grammar ends the row on a stop token (finish_reason "stop").

`RowGrammars` holds one llguidance matcher per slot of the pool, at the row's committed tokens. A node's mask is
computed by advancing that matcher by the node's path, filling the bitmask, and rolling it back (the engine's
rollback: nothing re-parses the output); masks are cached per (slot, path) until the row's next commit, so the
verify reuses the drafter's masks of the same nodes. `commit` advances the matchers by the tokens the iteration
kept. A path through a stop token or one the grammar refuses never reaches the output (drafts are sampled from
masked laws; such nodes are padding, or follow the end of the row): its law is left unmasked.

Cost: only rows with a grammar are read back (their nodes' paths, once per `allowed` call, and their kept tokens
once per commit); masks stay llguidance bitmasks (V / 32 int32 words per node) until one copy per call, expanded
on the device; a pool without a grammar has no `RowGrammars` at all.

A grammar with no allowed token at a row's committed state (a dead end), or a kept token the matcher refuses, is the
row's error (`RowGrammars.error`, `RowWarps.grammar_error(slot)` for the batcher that retires it); that row then may
only end. This module masks logits; it does not sample.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar")
OPTIONS = ("whitespace_pattern", "disable_any_whitespace")
KNOWN_KEYS = KINDS + OPTIONS
ALIASES = ("structured_outputs", "guided_decoding")  # vLLM's name, and its older one
DEAD_END = "structured_outputs: the grammar allows no token here (a dead end of the grammar on this vocabulary)"
NO_STOP = ("structured_outputs: the grammar completed but the row has no stop token to end it (ignore_eos without "
           "stop_token_ids)")


@dataclass(frozen=True)
class StructuredSpec:
    """One row's grammar, as data: `kind` (one of KINDS) and `text` (the schema's JSON text, the regex, the choices'
    JSON list, the grammar; "" for json_object). `compiler` (not compared): the `StructuredCompiler` that compiles
    it on the pool (a caller above the engine sets it: `with_compiler`)."""

    kind: str
    text: str
    whitespace_pattern: str | None = None
    compact: bool = False  # vLLM's disable_any_whitespace: JSON without free whitespace
    compiler: Any = field(default=None, compare=False, hash=False, repr=False)

    def with_compiler(self, compiler: Any) -> StructuredSpec:
        return replace(self, compiler=compiler)

    def grammar(self) -> str:
        """The llguidance grammar of this spec (its text, not yet checked)."""
        import llguidance

        if self.kind in ("json", "json_object"):
            options: dict[str, Any] = {"whitespace_flexible": not self.compact}
            if self.whitespace_pattern is not None:
                options["whitespace_pattern"] = self.whitespace_pattern
            schema = self.text if self.kind == "json" else '{"type": "object"}'
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.text)
        if self.kind == "choice":
            choices = json.loads(self.text)
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        text = self.text
        if "::=" in text:  # GBNF (llama.cpp's, as vLLM's xgrammar backend reads it): llguidance converts it
            from llguidance.gbnf_to_lark import gbnf_to_lark

            text = gbnf_to_lark(text)
        return llguidance.LLMatcher.grammar_from_lark(text)

    def check(self) -> None:
        """ValueError with llguidance's message when the schema, regex or grammar is invalid (no tokenizer needed)."""
        import llguidance

        try:
            grammar = self.grammar()
        except Exception as error:  # noqa: BLE001 - llguidance's own parse errors, as the row's message
            raise ValueError(f"invalid {self.kind}: {error}") from None
        message = llguidance.LLMatcher.validate_grammar(grammar, None)
        if message and not message.startswith("WARNING"):
            raise ValueError(f"invalid {self.kind}: {message.strip()}")


def parse_structured(value: Any, where: str = "structured_outputs") -> StructuredSpec | None:
    """vLLM's `structured_outputs` value (an object, its JSON text, or a `StructuredSpec`) -> a checked spec, or None
    (None / an empty object). Exactly one of KINDS; unknown keys are refused with the list of known ones. ValueError
    naming `where` and the problem."""
    if value is None or isinstance(value, StructuredSpec):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise ValueError(f"{where}: not a JSON object: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected an object with one of {', '.join(KINDS)}, got {type(value).__name__}")
    unknown = sorted(str(k) for k in value if k not in KNOWN_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(KNOWN_KEYS)}")
    given = [k for k in KINDS if value.get(k) not in (None, False)]
    if not given:
        if any(value.get(k) not in (None, False) for k in OPTIONS):
            raise ValueError(f"{where}: {', '.join(OPTIONS)} need one of {', '.join(KINDS)}")
        return None
    if len(given) > 1:
        raise ValueError(f"{where}: exactly one of {', '.join(KINDS)} may be set, got {', '.join(given)}")
    kind = given[0]
    raw = value[kind]
    if kind == "json":
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except ValueError as error:
                raise ValueError(f"{where}: json is not a JSON schema: {error}") from None
        if not isinstance(raw, (dict, bool)):
            raise ValueError(f"{where}: json must be a JSON schema (an object or its text), got {raw!r}")
        text = json.dumps(raw, sort_keys=True)
    elif kind == "json_object":
        if raw is not True:
            raise ValueError(f"{where}: json_object must be true, got {raw!r}")
        text = ""
    elif kind == "choice":
        if isinstance(raw, (str, bytes)) or not isinstance(raw, (list, tuple)) or not raw or not all(
                isinstance(c, str) for c in raw):
            raise ValueError(f"{where}: choice must be a non-empty list of strings, got {raw!r}")
        text = json.dumps(list(raw))
    else:
        if not isinstance(raw, str) or not raw:
            raise ValueError(f"{where}: {kind} must be a non-empty string, got {raw!r}")
        text = raw
    pattern = value.get("whitespace_pattern")
    if pattern is not None and not isinstance(pattern, str):
        raise ValueError(f"{where}: whitespace_pattern must be a string (a regex), got {pattern!r}")
    compact = value.get("disable_any_whitespace", False)
    if not isinstance(compact, bool):
        raise ValueError(f"{where}: disable_any_whitespace must be true or false, got {compact!r}")
    spec = StructuredSpec(kind, text, pattern, compact)
    try:
        spec.check()
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    return spec


def llg_tokenizer(tokenizer: Any, vocab_size: int | None = None, eos_token_id: Any = None):
    """An llguidance `LLTokenizer` from: an `LLTokenizer` (as is), a Hugging Face fast tokenizer (its tokenizer.json
    text, once), or an object with `tokens` (bytes per id), `eos_token_id` and `__call__` (llguidance's wrapper)."""
    import llguidance

    if isinstance(tokenizer, llguidance.LLTokenizer):
        return tokenizer
    if hasattr(tokenizer, "backend_tokenizer"):
        eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        return llguidance.LLTokenizer(tokenizer.backend_tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos)
    if hasattr(tokenizer, "tokens"):
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(tokenizer), n_vocab=vocab_size)
    raise ValueError(f"structured outputs need a fast Hugging Face tokenizer (or an llguidance tokenizer), got "
                     f"{type(tokenizer).__name__}")


class StructuredCompiler:
    """One tokenizer's grammars: the vocabulary given to llguidance once (per actor), each spec compiled once
    (`compiled` counts the compilations) and copied per row (`matcher`)."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, eos_token_id: Any = None):
        self.tokenizer = llg_tokenizer(tokenizer, vocab_size, eos_token_id)
        self.vocab_size = self.tokenizer.vocab_size
        self.eos_tokens = tuple(self.tokenizer.eos_tokens)
        self._templates: dict[tuple, Any] = {}
        self.compiled = 0

    def matcher(self, spec: StructuredSpec):
        """A fresh llguidance matcher of `spec` at its start (ValueError naming the problem when it is invalid)."""
        import llguidance

        key = (spec.kind, spec.text, spec.whitespace_pattern, spec.compact)
        template = self._templates.get(key)
        if template is None:
            try:
                grammar = spec.grammar()
            except Exception as error:  # noqa: BLE001 - llguidance's parse error, as the row's message
                raise ValueError(f"structured_outputs: invalid {spec.kind}: {error}") from None
            template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if template.is_error():
                raise ValueError(f"structured_outputs: invalid {spec.kind}: {template.get_error().strip()}")
            self._templates[key] = template
            self.compiled += 1
        return template.deep_copy()


def bits_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's bitmask [..., ceil(V' / 32)] int32 (bit j of word w: token 32 w + j) -> [..., vocab_size] bool
    (tokens past the mask's vocabulary: refused), on the bitmask's device."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask[..., None] >> shifts) & 1).reshape(*bitmask.shape[:-1], -1).bool()  # [..., 32 W]
    if bits.shape[-1] >= vocab_size:
        return bits[..., :vocab_size]
    return torch.cat([bits, bits.new_zeros(*bits.shape[:-1], vocab_size - bits.shape[-1])], -1)


def bool_to_bits(mask: torch.Tensor, words: int) -> torch.Tensor:
    """[V] bool -> [words] int32, llguidance's layout (the inverse of `bits_to_bool`)."""
    padded = torch.zeros(words * 32, dtype=torch.int64)
    padded[: mask.shape[0]] = mask.to(torch.int64)
    packed = (padded.view(words, 32) << torch.arange(32, dtype=torch.int64)).sum(1)  # [W] in [0, 2^32)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


@dataclass
class _Row:
    """One slot's grammar: its matcher at the committed tokens, stop tokens, tokens counted so far, mask cache."""

    matcher: Any
    compiler: StructuredCompiler
    stops: frozenset
    stop_bits: torch.Tensor  # [W] int32, host: the row's stop tokens
    eos_bits: torch.Tensor  # [W] int32, host: the grammar's own EOS and the row's stop tokens
    generated: int = 0
    masks: dict = field(default_factory=dict)  # path -> [W] int32 allowed bits (None: unmasked), until the commit
    error: str | None = None


class RowGrammars:
    """The grammar of each slot of the pool (None: the row has none); see the module docstring."""

    def __init__(self, num_slots: int, vocab_size: int):
        self.rows: list[_Row | None] = [None] * num_slots
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # the bitmask's width
        self.errors: dict[int, str] = {}  # slot -> the row's grammar error (kept until the slot is set again)

    @property
    def active(self) -> bool:
        return any(r is not None for r in self.rows)

    def set(self, slots: Sequence[int], specs: Sequence[StructuredSpec | None], stops: Sequence[Sequence[int]]) -> None:
        """Rows in `slots` (host ints) start with `specs` (None: no grammar) and their stop tokens. ValueError
        (naming the problem) for a spec without a compiler or an invalid one."""
        for slot, spec, row_stops in zip(slots, specs, stops):
            self.errors.pop(slot, None)
            if spec is None:
                self.rows[slot] = None
                continue
            if spec.compiler is None:
                raise ValueError("structured_outputs need the tokenizer: the spec has no compiler "
                                 "(spectr.generate(..., tokenizer=...), or StructuredSpec.with_compiler)")
            stop_set = frozenset(int(t) for t in row_stops if 0 <= int(t) < self.vocab_size)
            stop_mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            stop_mask[list(stop_set)] = True
            eos_mask = stop_mask.clone()
            eos_mask[[t for t in spec.compiler.eos_tokens if 0 <= t < self.vocab_size]] = True
            self.rows[slot] = _Row(spec.compiler.matcher(spec), spec.compiler, stop_set,
                                   bool_to_bits(stop_mask, self.words), bool_to_bits(eos_mask, self.words))

    def move(self, sources: Sequence[int], dests: Sequence[int]) -> None:
        for source, dest in zip(sources, dests):
            self.rows[dest], self.rows[source] = self.rows[source], None
            self.errors.pop(dest, None)  # a finished row's error leaves with it, not with the row moved in
            if source in self.errors:
                self.errors[dest] = self.errors.pop(source)

    def error(self, slot: int) -> str | None:
        """The row's grammar error (a dead end, or a kept token the grammar refused), or None."""
        return self.errors.get(slot)

    # -- the masks ----------------------------------------------------------------------------------------------
    def allowed(self, paths, rows: int, device) -> torch.Tensor | None:
        """[R, ..., V] bool for rows [0, rows): the tokens each node's grammar allows after its own path
        (`spectr.penalties.NodePaths`, tokens [R, ..., P]); True everywhere for rows without a grammar. None when
        no row of [0, rows) has one. One host read of the grammar rows' paths."""
        grammar_rows = [r for r in range(rows) if self.rows[r] is not None]
        if not grammar_rows:
            return None
        tokens = paths.tokens[:rows]
        node_shape = tuple(tokens.shape[1:-1])
        nodes = math.prod(node_shape)
        index = torch.tensor(grammar_rows, dtype=torch.int64, device=tokens.device)
        host_tokens = tokens.index_select(0, index).reshape(len(grammar_rows), nodes, tokens.shape[-1])
        if isinstance(paths.depth, torch.Tensor):
            depth = paths.depth[:rows].index_select(0, index).reshape(len(grammar_rows), nodes)
            host_tokens, depth = torch.cat([host_tokens.reshape(len(grammar_rows), -1), depth], 1).cpu().split(
                [nodes * tokens.shape[-1], nodes], 1)  # one host read for both
            host_tokens = host_tokens.reshape(len(grammar_rows), nodes, -1).tolist()
            depth = depth.tolist()
        else:
            host_tokens = host_tokens.cpu().tolist()
            depth = [[paths.depth] * nodes for _ in grammar_rows]
        bitmask = torch.full((rows, nodes, self.words), -1, dtype=torch.int32)  # all allowed
        for i, slot in enumerate(grammar_rows):
            for n in range(nodes):
                bits = self._node_bits(slot, tuple(host_tokens[i][n][: depth[i][n]]))
                if bits is not None:
                    bitmask[slot, n] = bits
        # one copy of the bitmask (V / 32 words per node), expanded on the device
        return bits_to_bool(bitmask.to(device), self.vocab_size).reshape(rows, *node_shape, self.vocab_size)

    def _node_mask(self, slot: int, path: tuple[int, ...]) -> torch.Tensor | None:
        """[V] bool after the row's committed tokens + `path`; None: unmasked (a path the output never takes)."""
        bits = self._node_bits(slot, path)
        return None if bits is None else bits_to_bool(bits, self.vocab_size)

    def _node_bits(self, slot: int, path: tuple[int, ...]) -> torch.Tensor | None:
        """[W] int32 allowed bits after the row's committed tokens + `path`, cached until the next commit."""
        row = self.rows[slot]
        if path in row.masks:
            return row.masks[path]
        bits = self._compute(slot, row, path)
        row.masks[path] = bits
        return bits

    def _compute(self, slot: int, row: _Row, path: tuple[int, ...]) -> torch.Tensor | None:
        if row.error is not None:  # the row errs: it may only end (on a stop token, else anything)
            return row.stop_bits if row.stops else None
        matcher = row.matcher
        if any(t in row.stops for t in path) or matcher.validate_tokens(list(path)) < len(path):
            return None  # after the row's end, or a path no masked draft takes (padding): never in the output
        if path and not matcher.consume_tokens(list(path)):
            return None
        words = (row.compiler.vocab_size + 31) // 32
        grammar = torch.zeros(max(words, self.words), dtype=torch.int32)  # the tokenizer's vocabulary's words
        matcher.unsafe_compute_mask_ptr(grammar.data_ptr(), words * 4)
        accepting = matcher.is_accepting()
        if path:
            matcher.rollback(len(path))
        grammar = grammar[: self.words]  # tokens past the model's vocabulary dropped
        if self.vocab_size % 32:  # and the last word's bits past it
            grammar[-1] &= (1 << (self.vocab_size % 32)) - 1
        # the grammar's own EOS is replaced by the row's stop tokens, allowed exactly where the grammar accepts
        bits = (grammar & ~row.eos_bits) | (row.stop_bits if accepting else 0)
        if not bool((bits != 0).any()):
            if path:
                return None  # a dead end below the root: if a row ever commits into it, the commit errs
            row.error = self.errors[slot] = NO_STOP if accepting else DEAD_END
            return row.stop_bits if row.stops else None
        return bits

    # -- the commits --------------------------------------------------------------------------------------------
    def commit(self, slots: torch.Tensor, emitted: torch.Tensor, lengths: torch.Tensor) -> None:
        """An iteration's commit: rows `slots` ([R]) emitted [R, E] tokens, of which their output now has `lengths`
        ([R]): each grammar row's matcher consumes its new ones (up to a stop token). One host read."""
        rows = slots.shape[0]
        if not any(self.rows[r] is not None for r in range(min(rows, len(self.rows)))):
            return
        host = torch.cat([slots[:, None], lengths[:, None], emitted], 1).tolist()  # [R, 2 + E]
        for slot, length, *tokens in host:
            row = self.rows[slot]
            if row is None:
                continue
            new = tokens[: max(0, length - row.generated)]
            row.generated = max(row.generated, length)
            row.masks = {}
            if row.error is not None:
                continue
            for token in new:
                if token in row.stops:
                    break
                completed = row.matcher.is_stopped()
                if not row.matcher.consume_token(token):
                    row.error = self.errors[slot] = (
                        NO_STOP if completed else
                        f"{DEAD_END} (token {token} came after the grammar's last allowed token; "
                        f"{row.matcher.get_error().strip().splitlines()[0][:160]})")
                    break
