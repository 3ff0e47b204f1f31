"""Sampling warps: logit bias, temperature, min-p, top-k, then top-p, turning logits into probabilities.

The same `SamplingWarp` is applied to the draft's and the target's logits, so the draft
distribution p and the target distribution q are warped identically; speculative methods
then reproduce the *warped* target distribution exactly. The semantics follow Hugging
Face's `TemperatureLogitsWarper`, `TopKLogitsWarper` and `TopPLogitsWarper` (min_tokens_to_keep=1):

- logit bias (vLLM's `logit_bias`, each value clamped to [-100, 100] as vLLM does, an infinite one refused) and
  vLLM's `allowed_token_ids` (every other token at -inf): added to the logits before everything else
  (greedy included: the argmax of the biased logits);
- temperature: logits / temperature; `temperature == 0` means greedy, a one-hot on the argmax
  (the first index among ties, as `torch.argmax` and HF's greedy search pick it);
- min-p (vLLM's `min_p`, `min_p > 0`): after temperature, remove the tokens whose probability is below
  min_p times the most likely token's (the most likely token is always kept);
- top-k (`top_k > 0`; 0 and -1 are off, as vLLM's): keep every token whose logit is >= the k-th largest (ties
  are kept);
- top-p (`top_p < 1`): keep the smallest set of most likely tokens whose mass reaches top_p
  (tokens whose ascending cumulative mass is <= 1 - top_p are removed; the top token is always kept).

vLLM's penalties and min_tokens (`SamplingWarp.presence_penalty`, ... `min_tokens`) come after the bias and
before temperature, but depend on the row's own tokens: `RowWarps` applies them per node of the draft tree
with that node's path (`spectr.penalties`); `SamplingWarp.probs` alone does not. So does a grammar
(`SamplingWarp.structured`, vLLM's structured outputs, `spectr.structured`): its mask comes first of all (the
refused tokens' logits at -inf, as vLLM applies the grammar bitmask before its sampler), per node with the
node's own path.

The order, as vLLM's: grammar mask, logit bias, min_tokens, penalties, temperature (greedy: argmax here),
min-p, top-k, top-p.

Masks that together allow no token (a grammar against allowed_token_ids, bad words or min_tokens' stop mask) leave
a law of zeros: `EmptyLaws` makes such a law uniform (defined, the same for the draft and the target) and flags a
row that kept a token drawn from one, whose error (`EMPTY_LAW`, `RowWarps.grammar_error`) the batcher reports.

This module is not a sampler: it only maps logits to probabilities. Sampling with per-row
uniforms is `spectr.rng.sample_categorical`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from spectr.bad_words import RowBadWords
from spectr.penalties import NEUTRAL as PENALTIES_OFF
from spectr.penalties import NodePaths, RowPenalties, validate_penalties
from spectr.structured import RowGrammars, StructuredSpec


@dataclass(frozen=True)
class SamplingWarp:
    """Temperature / top-k / top-p / min-p settings and a logit bias; `top_k=0`, `top_p=1.0`, `min_p=0.0` and
    `logit_bias=()` mean none. logit_bias: ((token id, bias), ...), sorted by id. vLLM's presence_penalty,
    frequency_penalty (0 = off), repetition_penalty (1 = off) and min_tokens (0 = off) are per row and
    path-dependent: applied by the pool (`RowWarps`, `spectr.penalties`), not by `probs`; so is `structured`, a
    grammar (`spectr.structured.StructuredSpec`, None: none)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    structured: StructuredSpec | None = None
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: only these may be sampled (empty: every token)
    bad_words: tuple = ()  # vLLM's, as token-id sequences (`spectr.bad_words`; strings: a caller tokenizes them)

    def __post_init__(self) -> None:
        validate_sampling(self.temperature, self.top_k, self.top_p)
        validate_extras(self.min_p, self.logit_bias, self.allowed_token_ids)
        validate_penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty, self.min_tokens)
        if not isinstance(self.bad_words, tuple) or not all(
                isinstance(w, str) or (isinstance(w, tuple) and w and all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in w)) for w in self.bad_words):
            raise ValueError(f"bad_words must be strings or token-id sequences, got {self.bad_words!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredSpec):
            raise ValueError(f"structured must be a spectr.structured.StructuredSpec or None, got "
                             f"{type(self.structured).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalty_settings(self) -> tuple[float, float, float, int]:
        """(presence, frequency, repetition, min_tokens)."""
        return (self.presence_penalty, self.frequency_penalty, self.repetition_penalty, self.min_tokens)

    @property
    def path_dependent(self) -> bool:
        """Whether this warp has a penalty, min_tokens or a grammar (its law at a node depends on the node's path)."""
        return self.penalty_settings != PENALTIES_OFF or self.structured is not None or bool(self.bad_words)

    def probs(self, logits: torch.Tensor, paths=None) -> torch.Tensor:
        """Warped probabilities, float32, same shape as `logits` ([..., V]). Penalties and min_tokens are not
        applied here (`paths` is ignored: they need the row's counts, see `RowWarps`); nor is a grammar."""
        if self.logit_bias or self.allowed_token_ids:
            logits = logits.float() + dense_bias(self.logit_bias, logits.shape[-1], logits.device,
                                                 self.allowed_token_ids)
        return warp_probs(logits, self.temperature, self.top_k, self.top_p, self.min_p)


BIAS_LIMIT = 100.0  # vLLM clamps each logit bias to [-100, 100]


def validate_extras(min_p: float, logit_bias, allowed_token_ids=()) -> None:
    """Raise ValueError naming min_p, logit_bias or allowed_token_ids when out of range. A bias must be finite (an
    infinite one would make every law NaN); finite ones are clamped to +-100 as vLLM's (`dense_bias`)."""
    if isinstance(min_p, bool) or not isinstance(min_p, (int, float)) or not (0 <= min_p <= 1):
        raise ValueError(f"min_p must be in [0, 1] (0 = off), got {min_p!r}")
    for entry in logit_bias:
        if (not isinstance(entry, tuple) or len(entry) != 2 or isinstance(entry[0], bool)
                or not isinstance(entry[0], int) or entry[0] < 0 or isinstance(entry[1], bool)
                or not isinstance(entry[1], (int, float)) or math.isnan(entry[1])):
            raise ValueError(f"logit_bias must map token ids (ints >= 0) to numbers, got entry {entry!r}")
        if not math.isfinite(entry[1]):
            raise ValueError(f"logit_bias must be finite (vLLM clamps to [-100, 100]), got {entry[1]!r} for token "
                             f"{entry[0]}")
    if not isinstance(allowed_token_ids, tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in allowed_token_ids):
        raise ValueError(f"allowed_token_ids must be token ids (ints >= 0), got {allowed_token_ids!r}")


def dense_bias(logit_bias, vocab_size: int, device, allowed_token_ids=()) -> torch.Tensor:
    """((token id, bias), ...) -> [V] float32, each bias clamped to [-100, 100] as vLLM's; with allowed_token_ids
    (vLLM's), every other token at -inf. ValueError for an id outside the vocabulary."""
    for token in [t for t, _ in logit_bias] + list(allowed_token_ids):
        if token >= vocab_size:
            raise ValueError(f"logit_bias / allowed_token_ids: token id {token} is outside the vocabulary of "
                             f"{vocab_size}")
    bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
    if logit_bias:  # one copy of ids and values to the device, no read back
        ids = torch.tensor([t for t, _ in logit_bias], dtype=torch.int64, device=device)
        values = [min(BIAS_LIMIT, max(-BIAS_LIMIT, float(v))) for _, v in logit_bias]
        bias.index_put_((ids,), torch.tensor(values, dtype=torch.float32, device=device))
    if allowed_token_ids:
        refused = torch.ones(vocab_size, dtype=torch.bool, device=device)
        refused[torch.tensor(list(allowed_token_ids), dtype=torch.int64, device=device)] = False
        bias = bias.masked_fill(refused, -math.inf)
    return bias


def validate_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Raise ValueError naming the argument that is out of range."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
        raise ValueError(f"top_k must be an int >= 0, or -1 (0 and -1 = no top-k truncation, as vLLM's), got "
                         f"{top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not (0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (1.0 = no top-p truncation), got {top_p!r}")


def warp_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
                ) -> torch.Tensor:
    """Temperature-scaled, truncated logits (removed tokens are -inf), float32. temperature > 0.

    logits: [..., V]; returns [..., V].
    """
    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    if min_p > 0:
        scores = _min_p(scores, min_p)
    vocab_size = scores.shape[-1]
    if 0 < top_k < vocab_size:
        kth_largest = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth_largest, -math.inf)
    if top_p < 1.0:
        sorted_scores, sorted_indices = torch.sort(scores, dim=-1, descending=False)  # [..., V]
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # [..., V]
        sorted_remove = cumulative <= (1 - top_p)
        sorted_remove[..., -1] = False  # keep at least the most likely token
        remove = sorted_remove.scatter(-1, sorted_indices, sorted_remove)
        scores = scores.masked_fill(remove, -math.inf)
    return scores


def _min_p(scores: torch.Tensor, min_p) -> torch.Tensor:
    """Remove the tokens whose probability is below min_p x the top token's: p(x) < min_p * max p, i.e.
    score(x) < max score + log(min_p). scores [..., V]; min_p a float or a tensor broadcasting to [..., 1]."""
    top = scores.max(dim=-1, keepdim=True).values  # [..., 1]
    if isinstance(min_p, torch.Tensor):
        floor = top + torch.where(min_p > 0, min_p, 1.0).log()
        return scores.masked_fill((min_p > 0) & (scores < floor), -math.inf)
    return scores.masked_fill(scores < top + math.log(min_p), -math.inf)


def warp_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
               ) -> torch.Tensor:
    """Warped probabilities (float32) from logits [..., V]; temperature 0 gives a one-hot argmax."""
    if temperature == 0:
        greedy = logits.argmax(dim=-1, keepdim=True)  # [..., 1]
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, greedy, 1.0)
    return warp_logits(logits, temperature, top_k, top_p, min_p).softmax(dim=-1)


def row_warp_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   truncate: tuple[bool, bool] = (True, True), min_p: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Warped probabilities (float32) with one warp per row: the same law as `warp_probs` row by row.

    logits: [R, ..., V]; temperature [R] float (0: greedy), top_k [R] int64 (0: off), top_p [R]
    float (1: off); min_p [R] float (0: off) or None; bias [R, V] float (added first) or None.
    truncate: host flags (any row uses top-k, any row uses top-p), so that a batch
    with no truncation skips the sorts. Returns [R, ..., V].
    """
    shape = (logits.shape[0],) + (1,) * (logits.dim() - 1)  # [R, 1, ..., 1]
    temperature = temperature.to(torch.float32).view(shape)
    greedy = temperature == 0
    if bias is not None:
        logits = logits.float() + bias.view(logits.shape[0], *(1,) * (logits.dim() - 2), -1)  # [R, ..., V]
    scores = logits.float() / torch.where(greedy, 1.0, temperature)  # [R, ..., V]
    if min_p is not None:
        scores = _min_p(scores, min_p.to(torch.float32).view(shape))
    vocab_size = scores.shape[-1]
    if truncate[0]:
        k = top_k.view(shape)
        ranked = torch.sort(scores, dim=-1, descending=True).values  # [R, ..., V]
        kth_largest = ranked.gather(-1, (k - 1).clamp(0, vocab_size - 1).expand(*scores.shape[:-1], 1))
        cut = (k > 0) & (k < vocab_size) & (scores < kth_largest)
        scores = scores.masked_fill(cut, -math.inf)
    if truncate[1]:
        p = top_p.to(torch.float32).view(shape)
        sorted_scores, sorted_indices = torch.sort(scores, dim=-1, descending=False)  # [R, ..., V]
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # [R, ..., V]
        sorted_remove = (cumulative <= (1 - p)) & (p < 1)
        sorted_remove[..., -1] = False  # keep at least the most likely token
        remove = sorted_remove.scatter(-1, sorted_indices, sorted_remove)
        scores = scores.masked_fill(remove, -math.inf)
    one_hot = torch.zeros(scores.shape, dtype=torch.float32, device=logits.device).scatter_(
        -1, logits.argmax(dim=-1, keepdim=True), 1.0)  # [R, ..., V]
    return torch.where(greedy, one_hot, scores.softmax(dim=-1))


class RowWarps:
    """One warp per slot of the pool (temperature, top-k, top-p, min-p as [B] tensors; a logit bias as one [B, V]
    tensor, made when a row first brings one), set at admission.

    `probs(logits)` warps [R, ..., V] logits of the rows [0, R) of the pool (R <= B: an iteration
    may run on a prefix of the pool). Host flags say whether any admitted row truncates, so that a
    pool without top-k / top-p never sorts (nor min-p / a bias computes). Penalties and min_tokens
    (`spectr.penalties.RowPenalties`, made when a row first brings one; `vocab_size` sizes it) are
    path-dependent: `probs(logits, paths)` then needs each node's path (`path_dependent` says so).
    """

    def __init__(self, num_slots: int, default: SamplingWarp, device, vocab_size: int | None = None):
        self.temperature = torch.full((num_slots,), default.temperature, dtype=torch.float32, device=device)  # [B]
        self.top_k = torch.full((num_slots,), default.top_k, dtype=torch.int64, device=device)  # [B]
        self.top_p = torch.full((num_slots,), default.top_p, dtype=torch.float32, device=device)  # [B]
        self.min_p = torch.full((num_slots,), default.min_p, dtype=torch.float32, device=device)  # [B]
        self.bias: torch.Tensor | None = None  # [B, V] once a row has a logit bias
        self._pending_bias: dict[int, tuple] = {}  # slot -> logit_bias, folded into `bias` at the next probs
        self.truncate = (default.top_k > 0, default.top_p < 1.0)
        self.uses_min_p = default.min_p > 0
        self.default = default
        self.vocab_size = vocab_size
        self.row_penalties: RowPenalties | None = None  # once a row has a penalty or min_tokens
        self.grammars: RowGrammars | None = None  # once a row has a grammar (`spectr.structured`)
        self.bad_words: RowBadWords | None = None  # once a row has bad words (`spectr.bad_words`)
        self.empty_laws: EmptyLaws | None = None  # with path-dependent masks: rows whose masks left no token

    @property
    def path_dependent(self) -> bool:
        """Host flag: some admitted row has a penalty, min_tokens or a grammar (`probs` needs the nodes' paths)."""
        return self.row_penalties is not None or self.grammars is not None or self.bad_words is not None

    @property
    def penalties(self):
        """What follows the commits (`commit(slots, emitted, lengths)`, called by the iteration): the penalties'
        counts and the grammars' matchers; None when the pool has neither."""
        if self.grammars is None and self.bad_words is None and self.empty_laws is None:
            return self.row_penalties
        return _Commits(self.row_penalties, self.grammars, self.bad_words, self.empty_laws)

    def grammar_error(self, slot: int) -> str | None:
        """The error of the row in `slot` from its masks: `EMPTY_LAW` when its masks together left no token to sample
        at a token it kept (`EmptyLaws`), else its grammar's (`spectr.structured.RowGrammars.error`), or None.
        Read at the row's retirement (one host read of its flag when the pool has path-dependent masks)."""
        if self.empty_laws is not None and bool(self.empty_laws.flags[slot]):
            return EMPTY_LAW  # the cause, before what its grammar made of the tokens drawn after it
        return None if self.grammars is None else self.grammars.error(slot)

    def set(self, slots: torch.Tensor, warps: list[SamplingWarp], host_slots: list[int] | None = None, *,
            prompts=None, stops=None) -> None:
        """Rows in `slots` ([N] int64; `host_slots`: the same on the host, so that a logit bias reads no device
        value) take `warps` (N of them); prompts / stops: their token ids and stop tokens (host lists), read by
        penalties (repetition counts the prompt) and min_tokens (masks the stop tokens)."""
        device = self.temperature.device
        self.temperature.index_copy_(0, slots, torch.tensor([w.temperature for w in warps], dtype=torch.float32,
                                                            device=device))
        self.top_k.index_copy_(0, slots, torch.tensor([w.top_k for w in warps], dtype=torch.int64, device=device))
        self.top_p.index_copy_(0, slots, torch.tensor([w.top_p for w in warps], dtype=torch.float32, device=device))
        self.min_p.index_copy_(0, slots, torch.tensor([w.min_p for w in warps], dtype=torch.float32, device=device))
        self.truncate = (self.truncate[0] or any(w.top_k > 0 for w in warps),
                         self.truncate[1] or any(w.top_p < 1.0 for w in warps))
        self.uses_min_p = self.uses_min_p or any(w.min_p > 0 for w in warps)
        if self.bias is not None or any(w.logit_bias or w.allowed_token_ids for w in warps):  # admission only
            for slot, warp in zip(slots.tolist() if host_slots is None else host_slots, warps):
                self._pending_bias[slot] = (warp.logit_bias, warp.allowed_token_ids)
        if self.row_penalties is not None or any(w.penalty_settings != PENALTIES_OFF for w in warps):
            self._set_penalties(slots, warps, prompts, stops)
        if self.grammars is not None or any(w.structured is not None for w in warps):
            if self.grammars is None:
                if self.vocab_size is None:
                    raise ValueError("structured outputs need the pool's vocab_size (RowWarps(vocab_size=...))")
                self.grammars = RowGrammars(self.temperature.shape[0], self.vocab_size)
            self.grammars.set(slots.tolist() if host_slots is None else host_slots, [w.structured for w in warps],
                              stops or [[]] * len(warps))
        if self.bad_words is not None or any(w.bad_words for w in warps):
            if any(isinstance(word, str) for w in warps for word in w.bad_words):
                raise ValueError("bad_words as strings need the tokenizer: give token-id sequences "
                                 "(spectr.bad_words.bad_words_token_ids)")
            if self.bad_words is None:
                if self.vocab_size is None:
                    raise ValueError("bad_words need the pool's vocab_size (RowWarps(vocab_size=...))")
                self.bad_words = RowBadWords(self.temperature.shape[0], self.vocab_size)
            self.bad_words.set(slots.tolist() if host_slots is None else host_slots, [w.bad_words for w in warps])
        if self.empty_laws is not None or any(_masks_may_empty(w) for w in warps):
            if self.empty_laws is None:
                self.empty_laws = EmptyLaws(self.temperature.shape[0], device)
            self.empty_laws.reset(slots)

    def _set_penalties(self, slots: torch.Tensor, warps: list[SamplingWarp], prompts, stops) -> None:
        """Penalties and min_tokens of the new rows: their prompts (repetition) and stop tokens (min_tokens) as
        host lists (None: empty)."""
        if self.row_penalties is None:
            if self.vocab_size is None:
                raise ValueError("penalties and min_tokens need the pool's vocab_size (RowWarps(vocab_size=...))")
            self.row_penalties = RowPenalties(self.temperature.shape[0], self.vocab_size, self.temperature.device)
        count = len(warps)
        self.row_penalties.set(slots, [w.penalty_settings for w in warps], prompts or [[]] * count,
                               stops or [[]] * count)

    def move(self, source: torch.Tensor, dest: torch.Tensor, host: tuple[list[int], list[int]] | None = None) -> None:
        """Rows in slots `source` move to `dest` ([M] int64 each; `host`: the same two on the host)."""
        for tensor in (self.temperature, self.top_k, self.top_p, self.min_p,
                       *(() if self.bias is None else (self.bias,))):
            tensor.index_copy_(0, dest, tensor.index_select(0, source))
        if self._pending_bias:
            moves = dict(zip(*((source.tolist(), dest.tolist()) if host is None else host)))
            self._pending_bias = {moves.get(slot, slot): bias for slot, bias in self._pending_bias.items()}
        if self.row_penalties is not None:
            self.row_penalties.move(source, dest)
        if self.empty_laws is not None:
            self.empty_laws.move(source, dest)
        for rows in (self.grammars, self.bad_words):
            if rows is not None:
                rows.move(*((source.tolist(), dest.tolist()) if host is None else host))

    def probs(self, logits: torch.Tensor, paths: NodePaths | None = None) -> torch.Tensor:
        """Warped probabilities of rows [0, R) of the pool: logits [R, ..., V] -> [R, ..., V] float32.

        paths: each node's draft tokens (`spectr.penalties.NodePaths`), needed when `path_dependent`: the grammar
        and bad-words masks of the node's path (`spectr.structured`, `spectr.bad_words`), the logit bias (with
        allowed_token_ids), then the penalties and min_tokens with the node's path counts, then the other warps."""
        rows, raw = logits.shape[0], logits
        if self._pending_bias:
            self._fold_bias(logits.shape[-1], logits.device)
        bias = None if self.bias is None else self.bias[:rows]
        if self.path_dependent and paths is None:
            raise ValueError("this pool has penalties, min_tokens or a grammar: probs needs the nodes' paths")
        for masks in (self.grammars, self.bad_words):  # first of all, as vLLM's grammar bitmask and bad words
            allowed = None if masks is None else masks.allowed(paths, rows, logits.device)  # [R, ..., V] or None
            if allowed is not None:
                logits = logits.float().masked_fill(~allowed, -math.inf)
        if self.row_penalties is not None:
            if bias is not None:
                logits = logits.float() + bias.view(rows, *(1,) * (logits.dim() - 2), -1)  # [R, ..., V]
                bias = None
            logits = self.row_penalties.apply(logits, paths)
        probs = row_warp_probs(logits, self.temperature[:rows], self.top_k[:rows], self.top_p[:rows], self.truncate,
                               self.min_p[:rows] if self.uses_min_p else None, bias)
        return probs if self.empty_laws is None else self.empty_laws.note(probs, raw, paths)

    def _fold_bias(self, vocab_size: int, device) -> None:
        if self.bias is None:
            self.bias = torch.zeros(self.temperature.shape[0], vocab_size, dtype=torch.float32, device=device)
            if self.default.logit_bias or self.default.allowed_token_ids:
                self.bias[:] = dense_bias(self.default.logit_bias, vocab_size, device, self.default.allowed_token_ids)
        for slot, (logit_bias, allowed) in self._pending_bias.items():
            self.bias[slot] = dense_bias(logit_bias, vocab_size, device, allowed)
        self._pending_bias = {}


EMPTY_LAW = ("the row's masks leave no token to sample: structured_outputs, allowed_token_ids, bad_words and "
             "min_tokens (which holds back the stop tokens) together allow none at a token the row kept; its tokens "
             "from there on are not from its law")


def _masks_may_empty(warp: SamplingWarp) -> bool:
    """Whether a row's masks may together leave no token (one mask alone cannot, bad words aside: a grammar's dead
    end is its own error, allowed_token_ids is never empty, min_tokens holds back only the stop tokens)."""
    masks = (warp.structured is not None, bool(warp.allowed_token_ids), bool(warp.bad_words), warp.min_tokens > 0)
    return sum(masks) >= 2 or bool(warp.bad_words)


class EmptyLaws:
    """Rows that kept a token drawn where their masks (a grammar, allowed_token_ids, bad words, min_tokens' stop mask)
    together allowed no token: a law of all zeros, which softmax makes NaN. `note` (each `RowWarps.probs` call)
    marks such nodes and gives them a uniform law instead (the same for the draft and the target, so that a
    selection over them stays defined), and `commit` (the iteration's commit hook) flags the rows whose kept
    tokens passed through one: a node whose path is a prefix of the row's new tokens and which drew one of them.
    On the device: no host read (the flag is read once, when the row retires: `RowWarps.grammar_error`)."""

    def __init__(self, num_slots: int, device):
        self.flags = torch.zeros(num_slots, dtype=torch.bool, device=device)  # [B] drew a kept token from no law
        self.generated = torch.zeros(num_slots, dtype=torch.int64, device=device)  # [B] output tokens so far
        self.seen: list[tuple[torch.Tensor, torch.Tensor | int, torch.Tensor]] = []  # since the last commit

    def reset(self, slots: torch.Tensor) -> None:
        self.flags.index_fill_(0, slots, False)
        self.generated.index_fill_(0, slots, 0)

    def move(self, source: torch.Tensor, dest: torch.Tensor) -> None:
        for tensor in (self.flags, self.generated):
            tensor.index_copy_(0, dest, tensor.index_select(0, source))

    def note(self, probs: torch.Tensor, logits: torch.Tensor, paths: NodePaths | None) -> torch.Tensor:
        """probs [R, ..., V] of rows [0, R) (from finite `logits`: non-finite logits are the model's error, counted
        apart) with their empty laws made uniform; their nodes are kept for `commit`."""
        empty = ~(probs.sum(-1) > 0) & torch.isfinite(logits.amax(-1))  # [R, ...]
        if paths is not None:
            self.seen.append((paths.tokens, paths.depth, empty))
        return torch.where(empty[..., None], 1.0 / probs.shape[-1], probs)

    def commit(self, slots: torch.Tensor, emitted: torch.Tensor, lengths: torch.Tensor) -> None:
        """Rows `slots` ([R]) kept emitted [R, E] tokens up to `lengths` ([R]): flag those whose j-th new token
        was drawn at an empty node (path = their first j new tokens)."""
        kept = lengths - self.generated[slots]  # [R] new tokens
        for tokens, depth, empty in self.seen:
            rows, lead = empty.shape[0], empty.dim() - 1
            depth = depth if isinstance(depth, torch.Tensor) else torch.full_like(empty, depth, dtype=torch.int64)
            width = min(tokens.shape[-1], emitted.shape[1])
            new = emitted[:rows, :width].view(rows, *(1,) * lead, width)  # [R, 1.., m]
            on_path = torch.arange(width, device=emitted.device) < depth[..., None]  # [R, ..., m]
            same = ((tokens[..., :width] == new) | ~on_path).all(-1)  # [R, ...] the path is the new tokens' prefix
            drew = empty & same & (depth < kept[:rows].view(rows, *(1,) * lead))  # [R, ...]
            self.flags[slots[:rows]] |= drew.reshape(rows, -1).any(-1)
        self.seen = []
        self.generated[slots] = lengths


class _Commits:
    """The commit hook of a pool with grammars or bad words: the penalties' counts, the grammars' matchers, the bad
    words' committed tails (those the pool has)."""

    def __init__(self, *parts):
        self.parts = [part for part in parts if part is not None]

    def commit(self, slots: torch.Tensor, emitted: torch.Tensor, lengths: torch.Tensor) -> None:
        for part in self.parts:
            part.commit(slots, emitted, lengths)


def split_row_warps(temperature, top_k, top_p, count: int, min_p=0.0, logit_bias=None, presence_penalty=0.0,
                    frequency_penalty=0.0, repetition_penalty=1.0, min_tokens=0, structured=None,
                    allowed_token_ids=None, bad_words=None
                    ) -> tuple[tuple[float, int, float], list[SamplingWarp] | None]:
    """Scalars, or one value per row (lists or [N] tensors), -> (the run's warp settings, per-row warps).

    All scalars, no min_p, no logit_bias, no penalty and no min_tokens: (those scalars, None). Any of them per row,
    or a min_p / a logit bias (a {token id: bias} dict, or one dict or None per row) / a penalty / min_tokens: (the
    defaults (1.0, 0, 1.0), one `SamplingWarp` per row, scalars broadcast). structured: None, one
    `spectr.structured.StructuredSpec` for every row, or one (or None) per row: per-row warps too; so do
    allowed_token_ids (vLLM's: a list of ids for every row, or one list or None per row). ValueError names the
    argument and the row.
    """
    values = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
              "presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty,
              "repetition_penalty": repetition_penalty, "min_tokens": min_tokens}
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            values[name] = value.tolist()
    per_row = {name: v for name, v in values.items() if isinstance(v, (list, tuple))}
    biases = logit_bias if isinstance(logit_bias, (list, tuple)) else [logit_bias] * count
    specs = list(structured) if isinstance(structured, (list, tuple)) else [structured] * count
    allowed_per_row = bool(allowed_token_ids) and all(a is None or isinstance(a, (list, tuple))
                                                      for a in allowed_token_ids)
    allowed = list(allowed_token_ids) if allowed_per_row else [allowed_token_ids] * count
    words_per_row = bool(bad_words) and all(  # one list (or None) per row, not one list of words for every row
        w is None or (isinstance(w, (list, tuple)) and not any(isinstance(t, int) for t in w)) for w in bad_words)
    words = list(bad_words) if words_per_row else [bad_words] * count
    if not per_row and not min_p and not logit_bias and (presence_penalty, frequency_penalty, repetition_penalty,
                                                         min_tokens) == PENALTIES_OFF and not any(specs) \
            and not any(allowed) and not any(words):
        return (temperature, top_k, top_p), None
    lists = [(name, value) for name, value, given in (
        ("logit_bias", biases, isinstance(logit_bias, (list, tuple))), ("allowed_token_ids", allowed, allowed_per_row),
        ("structured", specs, isinstance(structured, (list, tuple))), ("bad_words", words, words_per_row)) if given]
    for name, value in (*per_row.items(), *lists):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries but there are {count} prompts")
    warps = []
    for row in range(count):
        row_values = [v[row] if name in per_row else v for name, v in values.items()]
        try:
            bias = biases[row] or {}
            if not isinstance(bias, dict):
                raise ValueError(f"logit_bias must be a {{token id: bias}} dict, got {bias!r}")
            bias = tuple(sorted((int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k, v)
                                for k, v in bias.items()))
            row_allowed = tuple(allowed[row] or ())
            validate_sampling(*row_values[:3])
            validate_extras(row_values[3], bias, row_allowed)
            validate_penalties(*row_values[4:])
        except (ValueError, TypeError) as error:
            raise ValueError(f"prompt {row}: {error}") from None
        if specs[row] is not None and not isinstance(specs[row], StructuredSpec):
            raise ValueError(f"prompt {row}: structured must be a StructuredSpec or None, got {specs[row]!r}")
        warps.append(SamplingWarp(float(row_values[0]), int(row_values[1]), float(row_values[2]),
                                  float(row_values[3]), bias, *map(float, row_values[4:7]), int(row_values[7]),
                                  specs[row], row_allowed,
                                  tuple(w if isinstance(w, str) else tuple(w) for w in words[row] or ())))
    return (1.0, 0, 1.0), warps
