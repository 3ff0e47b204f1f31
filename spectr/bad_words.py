"""vLLM's `bad_words`: token sequences a row may not complete, as one more path-dependent mask of both laws.

A bad word is a token sequence w (vLLM tokenizes each string twice, with and without a leading space:
`bad_words_token_ids`). Its last token is refused at a point where the row's output ends with w[:-1] (a one-token
word is refused everywhere). At a node of the draft tree "the output" is the row's committed tokens plus the node's
draft ancestors (its own path, `spectr.penalties.NodePaths`), so the draft's law and the target's law at the node
refuse the same tokens, and every selection rule reproduces the target's law with vLLM's bad words removed.

`RowBadWords` keeps, per slot, the row's words and the last tokens of its committed output (as many as the longest
word needs, on the host: the kept tokens are read once per commit, for rows with bad words only). Like
`spectr.structured.RowGrammars` it gives `allowed(paths, rows, device)`; a pool without bad words has none.
This module masks logits; it does not sample.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


def bad_words_token_ids(words: Sequence[str], tokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of `bad_words` (`SamplingParams.update_from_tokenizer`): each word stripped of leading
    spaces, encoded as is and with one leading space; the spaced form is kept when its first token differs from
    the plain form's and it has as many tokens. `tokenizer.encode(text, add_special_tokens=False)`."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if plain:
            out.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return tuple(dict.fromkeys(out))


def check_bad_words(bad_words) -> None:
    """ValueError unless a tuple of token-id tuples (ints >= 0, each non-empty)."""
    if not isinstance(bad_words, tuple) or not all(
            isinstance(w, tuple) and w and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in w)
            for w in bad_words):
        raise ValueError(f"bad_words must be token-id sequences (tokenize vLLM's strings with "
                         f"spectr.bad_words.bad_words_token_ids), got {bad_words!r}")


@dataclass
class _Row:
    words: tuple[tuple[int, ...], ...]
    tail: tuple[int, ...] = ()  # the last committed tokens (up to the longest word - 1)
    generated: int = 0
    keep: int = field(init=False)

    def __post_init__(self):
        self.keep = max(len(w) for w in self.words) - 1

    def refused(self, path: tuple[int, ...]) -> set[int]:
        """The words' last tokens refused after the committed tail + `path`."""
        history = self.tail + path
        return {w[-1] for w in self.words if len(w) == 1 or (len(history) >= len(w) - 1
                                                            and history[len(history) - len(w) + 1:] == w[:-1])}


class RowBadWords:
    """The bad words of each slot of the pool (None: none); see the module docstring."""

    def __init__(self, num_slots: int, vocab_size: int):
        self.rows: list[_Row | None] = [None] * num_slots
        self.vocab_size = vocab_size

    def set(self, slots: Sequence[int], words: Sequence[tuple]) -> None:
        for slot, row_words in zip(slots, words):
            for word in row_words or ():
                if max(word) >= self.vocab_size:
                    raise ValueError(f"bad_words: token id {max(word)} is outside the vocabulary of {self.vocab_size}")
            self.rows[slot] = _Row(tuple(row_words)) if row_words else None

    def move(self, sources: Sequence[int], dests: Sequence[int]) -> None:
        for source, dest in zip(sources, dests):
            self.rows[dest], self.rows[source] = self.rows[source], None

    def allowed(self, paths, rows: int, device) -> torch.Tensor | None:
        """[R, ..., V] bool for rows [0, rows): False at the tokens that would complete a bad word after each
        node's own path; None when no row of [0, rows) has bad words. One host read of those rows' paths."""
        word_rows = [r for r in range(rows) if self.rows[r] is not None]
        if not word_rows:
            return None
        tokens = paths.tokens[:rows]
        node_shape = tuple(tokens.shape[1:-1])
        nodes = math.prod(node_shape)
        index = torch.tensor(word_rows, dtype=torch.int64, device=tokens.device)
        host = tokens.index_select(0, index).reshape(len(word_rows), nodes, tokens.shape[-1]).tolist()
        if isinstance(paths.depth, torch.Tensor):
            depth = paths.depth[:rows].index_select(0, index).reshape(len(word_rows), nodes).tolist()
        else:
            depth = [[paths.depth] * nodes for _ in word_rows]
        allowed = torch.ones(rows, nodes, self.vocab_size, dtype=torch.bool)
        for i, slot in enumerate(word_rows):
            row = self.rows[slot]
            for n in range(nodes):
                refused = row.refused(tuple(host[i][n][: depth[i][n]]))
                if refused:
                    allowed[slot, n, list(refused)] = False
        return allowed.reshape(rows, *node_shape, self.vocab_size).to(device)

    def commit(self, slots: torch.Tensor, emitted: torch.Tensor, lengths: torch.Tensor) -> None:
        """The kept tokens of an iteration (as `RowPenalties.commit`) extend the rows' committed tails."""
        if not any(self.rows[r] is not None for r in range(min(slots.shape[0], len(self.rows)))):
            return
        for slot, length, *tokens in torch.cat([slots[:, None], lengths[:, None], emitted], 1).tolist():
            row = self.rows[slot]
            if row is None:
                continue
            new = tokens[: max(0, length - row.generated)]
            row.generated = max(row.generated, length)
            if row.keep:
                row.tail = (row.tail + tuple(new))[-row.keep:]
