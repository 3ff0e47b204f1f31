"""The rows of the batch: per-slot device state over the cache pool, admission, live-row subsets.

A *slot* is one row of every per-row tensor, of both KV caches and of `spectr.records`, all
allocated once for the batcher's life (the cache pool). A prompt occupies a slot from its
admission to its last token; then the slot is reset and the next prompt takes it:

- `prefill` writes the new prompts (every token but the last) into their slots only: a
  forward over the N new rows, through a `RowView` of the cache, with the same right-padded
  causal layout whatever else runs; for rows that ask (vLLM's `prompt_logprobs`) it keeps the
  logits at every prompt position, and `prompt_logprob_tensors` / `PromptLogprobs` turn them into
  each prompt token's log-probability, rank and the top N (no extra target pass);
- `RowState.admit` sets the slots' device state: the last prompt token pending, the row's
  random-stream key, iteration 0, running.

`RowState` is also what one iteration works on: the whole pool (`slots` = 0..B-1), or
`prefix(R)`, the slots [0, R) when those above are empty, as views of the same state and
caches (no copy), written back with `put_prefix`. `move` (with `RowKVCache.move_rows` and
`Records.move`) packs live rows into empty lower slots, so that the prefix covers them.

This module does not select tokens, hold outputs or decide when rows are admitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spectr.drafting import TreeDrafter
from spectr.hf import HFCausalLM, HFRowCache
from spectr.kv_cache import tree_attention


def prefill(model: HFCausalLM, cache: HFRowCache, prompts: list[list[int]], device,
            rows: torch.Tensor | None = None, keep_logits: bool = False) -> torch.Tensor | None:
    """Write every prompt but its last token into `cache` (right-padded batch, causal mask). No host sync.

    rows: [N] int64, the cache rows of the N prompts (None: rows 0..N-1 of a cache of N rows);
    their previous lengths are ignored (the rows start empty). keep_logits: return the logits at every
    written position, [N, P, V] (P = longest prompt - 1; position i predicts prompt token i + 1; a
    row's positions from its own length on are padding), else None (only the last position's logits
    are computed).
    """
    if rows is not None:
        cache = cache.view(rows)
    width = max(len(p) for p in prompts) - 1
    lengths = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.int64, device=device)  # [N]
    logits = None
    if width > 0:
        padded = torch.tensor([p[:-1] + [0] * (width + 1 - len(p)) for p in prompts], dtype=torch.int64,
                              device=device)  # [N, P]
        positions = torch.arange(width, device=device).expand(len(prompts), width)  # [N, P]
        causal = positions[0][:, None] >= positions[0][None, :]  # [P, P]
        # Padded queries see only real keys before them (or themselves); real keys never see padding.
        allowed = tree_attention(torch.zeros_like(lengths), causal, width)  # [N, P, P]
        logits = model.forward(padded, positions, allowed, cache, positions, last_only=not keep_logits)
    cache.rows.lengths = lengths
    if keep_logits and logits is None:
        logits = torch.zeros(len(prompts), 0, model.vocab_size, device=device)  # one-token prompts: no position
    return logits if keep_logits else None


@dataclass
class PromptLogprobs:
    """vLLM's `prompt_logprobs` of one row, from the target's prefill: the target's raw log-softmax (vLLM's
    default logprobs mode), for every prompt token after the first (the first has no context: None, as vLLM).

    token_ids: the prompt; logprobs / ranks: per prompt token (None first), its log-probability and its
    rank (1 = the most likely token; ties share the better rank, as vLLM counts tokens strictly more likely);
    top: per prompt token ([] first), the N most likely tokens at that position as (id, log-probability).
    """

    token_ids: list[int]
    logprobs: list[float | None]
    ranks: list[int | None]
    top: list[list[tuple[int, float]]]

    @classmethod
    def read(cls, prompt: list[int], tensors: tuple[torch.Tensor, ...]) -> PromptLogprobs:
        """From `prompt_logprob_tensors`' device tensors (one host copy each; at the row's retirement)."""
        chosen, ranks, top_values, top_ids = (t.tolist() for t in tensors)
        top = [list(zip(ids, values)) for ids, values in zip(top_ids, top_values)]
        return cls(list(prompt), [None, *chosen], [None, *ranks], [[], *top])


def prompt_logprobs_alone(model, prompt: list[int], top: int) -> PromptLogprobs:
    """One row's `PromptLogprobs` from a plain forward of the Hugging Face `model` over its prompt (a row re-run
    alone, outside a batcher)."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        if len(prompt) > 1:
            logits = model(input_ids=torch.tensor([prompt[:-1]], device=device), use_cache=False).logits[0]  # [P, V]
        else:
            logits = torch.zeros(0, model.config.vocab_size, device=device)
        return PromptLogprobs.read(prompt, prompt_logprob_tensors(logits, prompt, top))


def prompt_logprob_tensors(logits: torch.Tensor, prompt: list[int], top: int,
                           chunk: int = 512) -> tuple[torch.Tensor, ...]:
    """One row's prompt log-probabilities on the device, from its prefill logits ([P, V], P >= len(prompt) - 1:
    position i predicts prompt token i + 1): (log-probability [T], rank [T], top-N values [T, N], top-N ids
    [T, N]) for the T = len(prompt) - 1 tokens after the first; float32 log-softmax, `chunk` positions at a time
    (a [chunk, V] float32 copy at most). No host sync."""
    count = len(prompt) - 1
    device = logits.device
    following = torch.tensor(prompt[1:], dtype=torch.int64, device=device)  # [T]
    parts: list[list[torch.Tensor]] = [[], [], [], []]
    for start in range(0, count, chunk):
        logp = logits[start : min(count, start + chunk)].float().log_softmax(-1)  # [c, V]
        chosen = logp.gather(-1, following[start : start + logp.shape[0], None])  # [c, 1]
        parts[0].append(chosen[:, 0])
        parts[1].append((logp > chosen).sum(-1) + 1)  # vLLM's rank: 1 + tokens strictly more likely
        values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)  # [c, N]
        parts[2].append(values)
        parts[3].append(ids)
    if not count:
        empty = torch.zeros(0, device=device)
        return empty, empty.long(), torch.zeros(0, top, device=device), torch.zeros(0, top, dtype=torch.int64,
                                                                                  device=device)
    return tuple(torch.cat(p) for p in parts)


@dataclass
class RowState:
    """Device state of a set of rows (all [R]); see the module docstring."""

    slots: torch.Tensor  # [R] int64, the pool slot (records row) of each row
    running: torch.Tensor  # [R] bool, generating (False: an empty or finished slot, masked)
    pending: torch.Tensor  # [R] int64, the last committed token, not yet in the target cache
    keys: torch.Tensor  # [R] int64, random-stream key of the row's seed (spectr.rng.row_keys)
    iteration: torch.Tensor  # [R] int64, the row's own iteration count
    target_cache: HFRowCache
    drafter: TreeDrafter | None
    prefixes: dict = field(default_factory=dict)  # count -> (target, draft) HF caches over rows [0, count)

    @classmethod
    def pool(cls, num_slots: int, target_cache: HFRowCache, drafter: TreeDrafter | None, device) -> RowState:
        """Every slot of the pool, all empty."""
        def zeros(dtype=torch.int64):
            return torch.zeros(num_slots, dtype=dtype, device=device)

        return cls(slots=torch.arange(num_slots, device=device), running=zeros(torch.bool), pending=zeros(),
                   keys=zeros(), iteration=zeros(), target_cache=target_cache, drafter=drafter)

    @property
    def nbytes(self) -> int:
        tensors = [self.slots, self.running, self.pending, self.keys, self.iteration]
        if self.drafter is not None:
            tensors += self.drafter.row_tensors()
        return sum(t.untyped_storage().nbytes() for t in tensors)

    def admit(self, slots: torch.Tensor, last_tokens: torch.Tensor, keys: torch.Tensor) -> None:
        """Start rows in `slots` ([N] int64): last prompt tokens [N] pending, stream keys [N], iteration 0."""
        self.running.index_fill_(0, slots, True)
        self.pending.index_copy_(0, slots, last_tokens)
        self.keys.index_copy_(0, slots, keys)
        self.iteration.index_fill_(0, slots, 0)
        if self.drafter is not None:
            self.drafter.reset(slots, last_tokens)

    def prefix(self, count: int) -> RowState:
        """Rows [0, count) of the pool: views of its state and caches (no copy); `put_prefix` after."""
        if count not in self.prefixes:  # built once per count: an HF cache has one object per layer
            draft = None if self.drafter is None else self.drafter.cache.prefix(count)
            self.prefixes[count] = (self.target_cache.prefix(count), draft)
        target_cache, draft_cache = self.prefixes[count]
        drafter = None if self.drafter is None else self.drafter.prefix(count, draft_cache)
        return RowState(slots=self.slots[:count], running=self.running[:count], pending=self.pending[:count],
                        keys=self.keys[:count], iteration=self.iteration[:count], target_cache=target_cache,
                        drafter=drafter)

    def put_prefix(self, count: int, part: RowState) -> None:
        """Write back what an iteration rebound in `part = prefix(count)` (the caches are shared)."""
        self.running[:count] = part.running
        self.pending[:count] = part.pending
        self.iteration[:count] = part.iteration
        if self.drafter is not None:
            self.drafter.put_prefix(count, part.drafter)

    def move(self, source: torch.Tensor, dest: torch.Tensor) -> None:
        """Rows `source` take the empty slots `dest` ([M] int64 each); the sources are left empty (the
        caches move with `RowKVCache.move_rows`, the records with `Records.move`)."""
        tensors = [self.running, self.pending, self.keys, self.iteration]
        if self.drafter is not None:
            tensors += self.drafter.row_tensors()
        for tensor in tensors:
            tensor.index_copy_(0, dest, tensor.index_select(0, source))
        self.running.index_fill_(0, source, False)
