"""Path-dependent logit processors: vLLM's repetition, frequency and presence penalties, and min_tokens.

A penalty depends on the tokens the row has produced, so at a node of the draft tree it counts the
tokens on *that node's own path*: the row's committed output plus the draft tokens of the node's
ancestors (and the prompt, for repetition). The draft's law at a node (from which the node's children
are sampled) and the target's law at the node (the q the verify reads) are both penalised with the
same path counts, so the selection reproduces, position by position, the penalised target law: the
law vLLM samples each token from. min_tokens is a mask of the row's stop tokens that depends on the
depth: at a node of depth d of a row with g generated tokens, the stop tokens are -inf iff g + d < m.

Definitions (vLLM's `apply_penalties` and its min-tokens processor), on float32 logits after the logit
bias and before temperature, min-p, top-k and top-p (vLLM's sampler order; greedy reads the penalised
logits too):

- repetition_penalty r (> 0; 1 = off): a token seen in the prompt or the output has its logit divided
  by r when positive, multiplied by r otherwise;
- frequency_penalty f (in [-2, 2]; 0 = off): minus f x the token's count in the output;
- presence_penalty p (in [-2, 2]; 0 = off): minus p when the token occurs in the output;
- min_tokens m (>= 0; 0 = off): the row's stop tokens (its EOS ids, or its own stop_token_ids) are
  -inf while fewer than m tokens are generated.

`RowPenalties` holds them per slot of the pool: the settings ([B]), the output counts ([B, V]), the
prompt's tokens ([B, V] bool), the generated count ([B]) and the stop tokens ([B, V] bool). The counts
follow the commits (`commit`: the kept tokens of an iteration, from the records' lengths, no host read).
`NodePaths` says which draft tokens lie on each node's path: `draft_paths` for the drafter's rows of a
depth, `tree_paths` for the verify's nodes. Host flags (`penalizes`, `uses_min_tokens`) skip what no
admitted row uses; a pool without any of these settings has no `RowPenalties` at all (`spectr.warps`).

This module only changes logits: it does not sample, select or keep outputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

NEUTRAL = (0.0, 0.0, 1.0, 0)  # presence, frequency, repetition, min_tokens: off


def validate_penalties(presence_penalty, frequency_penalty, repetition_penalty, min_tokens) -> None:
    """Raise ValueError naming the setting out of vLLM's range."""
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2 <= value <= 2:
            raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {value!r}")
    if (isinstance(repetition_penalty, bool) or not isinstance(repetition_penalty, (int, float))
            or not math.isfinite(repetition_penalty) or repetition_penalty <= 0):
        raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {repetition_penalty!r}")
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"min_tokens must be an int >= 0 (0 = off), got {min_tokens!r}")


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor, presence,
                    frequency, repetition) -> torch.Tensor:
    """vLLM's penalties: logits [..., V] float32, output counts [..., V], prompt_seen [..., V] bool; the three
    settings are floats or tensors broadcasting to [..., 1]. Returns [..., V] float32."""
    output_seen = counts > 0  # [..., V]
    scaling = torch.where(logits > 0, 1.0 / repetition, repetition)  # [..., V]
    logits = logits * torch.where(prompt_seen | output_seen, scaling, 1.0)
    return logits - frequency * counts - presence * output_seen.to(logits.dtype)


def min_tokens_mask(logits: torch.Tensor, stop_tokens: torch.Tensor, generated, min_tokens) -> torch.Tensor:
    """The stop tokens ([..., V] bool) -inf where `generated` (tokens before the one sampled, [...] or an int)
    is below `min_tokens` ([...] or an int). logits [..., V] -> [..., V]."""
    early = torch.as_tensor(generated < min_tokens, device=logits.device)  # [...]
    return logits.masked_fill(stop_tokens & early[..., None], -math.inf)


@dataclass
class NodePaths:
    """The draft tokens on each node's path, after the row's committed tokens.

    tokens: [R, ..., P] int64, tokens[..., j] lies on the path iff j < depth; depth: [R, ...] int64, or an int
    for a layer whose nodes all have that depth (the drafter's), = the node's number of draft ancestors."""

    tokens: torch.Tensor
    depth: torch.Tensor | int

    def on_path(self) -> torch.Tensor:
        """[R, ..., P] float32: 1 where tokens[..., j] is on the path."""
        offsets = torch.arange(self.tokens.shape[-1], device=self.tokens.device)  # [P]
        depth = self.depth[..., None] if isinstance(self.depth, torch.Tensor) else self.depth
        return (offsets < depth).to(torch.float32).expand(self.tokens.shape)


def draft_paths(tokens: torch.Tensor) -> NodePaths:
    """The drafter's rows at depth i: tokens [R, K, i] (or [R, 0] at the root), every one on the path."""
    return NodePaths(tokens, tokens.shape[-1])


def tree_paths(tokens: torch.Tensor, node_of: torch.Tensor, width: int) -> NodePaths:
    """The verify's nodes: drafts tokens [R, K, L] and node_of [R, K, L + 1] (spectr.tree) -> paths of the
    compact nodes [R, W, L], depths [R, W] (padding nodes: depth 0)."""
    rows, num_drafts, length = tokens.shape
    full = 1 + num_drafts * length
    prefix = torch.arange(length + 1, device=tokens.device)  # [L + 1] prefix length i
    offsets = torch.arange(length, device=tokens.device)  # [L]
    # draft k's prefix of length i holds tokens[:, k, :i]; later entries are 0 (so repeated writes agree)
    per_prefix = tokens[:, :, None, :].expand(rows, num_drafts, length + 1, length)  # [R, K, L + 1, L]
    per_prefix = per_prefix.masked_fill(offsets >= prefix[:, None], 0).reshape(rows, -1, length)
    nodes = node_of.reshape(rows, -1)  # [R, K (L + 1)]
    path = torch.zeros(rows, full, length, dtype=torch.int64, device=tokens.device).scatter_(
        1, nodes[:, :, None].expand(-1, -1, length), per_prefix)  # [R, T, L]
    depth = torch.zeros(rows, full, dtype=torch.int64, device=tokens.device).scatter_(
        1, nodes, prefix.repeat(num_drafts).expand(rows, -1))  # [R, T]
    return NodePaths(path[:, :width], depth[:, :width])


class RowPenalties:
    """Penalties and min_tokens per slot of the pool, with each row's output counts; see the module docstring."""

    def __init__(self, num_slots: int, vocab_size: int, device):
        def full(value, dtype):
            return torch.full((num_slots,), value, dtype=dtype, device=device)

        self.presence, self.frequency = full(0.0, torch.float32), full(0.0, torch.float32)  # [B] each
        self.repetition = full(1.0, torch.float32)  # [B]
        self.min_tokens, self.generated = full(0, torch.int64), full(0, torch.int64)  # [B] each
        self.counts = torch.zeros(num_slots, vocab_size, dtype=torch.float32, device=device)  # [B, V]
        self.prompt_seen = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)  # [B, V]
        self.stop_tokens = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)  # [B, V]
        self.vocab_size = vocab_size
        self.penalizes = False  # host: some admitted row has a penalty (the counts are read)
        self.uses_min_tokens = False  # host: some admitted row has min_tokens

    def set(self, slots: torch.Tensor, settings: Sequence[tuple], prompts: Sequence[Sequence[int]],
            stops: Sequence[Sequence[int]]) -> None:
        """Start rows in `slots` ([N] int64): settings (presence, frequency, repetition, min_tokens) per row, their
        prompts and stop tokens (host lists: admission makes the [N, V] masks with one copy each, reads nothing)."""
        device = self.counts.device
        for tensor, column, dtype in ((self.presence, 0, torch.float32), (self.frequency, 1, torch.float32),
                                      (self.repetition, 2, torch.float32), (self.min_tokens, 3, torch.int64)):
            tensor.index_copy_(0, slots, torch.tensor([s[column] for s in settings], dtype=dtype, device=device))
        self.prompt_seen.index_copy_(0, slots, self._mask(prompts))
        self.stop_tokens.index_copy_(0, slots, self._mask(stops))
        self.counts.index_fill_(0, slots, 0.0)
        self.generated.index_fill_(0, slots, 0)
        self.penalizes = self.penalizes or any(tuple(s[:3]) != NEUTRAL[:3] for s in settings)
        self.uses_min_tokens = self.uses_min_tokens or any(s[3] > 0 for s in settings)

    def _mask(self, token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
        """[N, V] bool from host lists of token ids (ids outside the vocabulary ignored)."""
        vocab = self.vocab_size
        lists = [[t for t in tokens if 0 <= t < vocab] for tokens in token_lists]
        width = max([1, *map(len, lists)])
        padded = torch.tensor([t + [vocab] * (width - len(t)) for t in lists], dtype=torch.int64,
                              device=self.counts.device)  # [N, width], padding at the extra column V
        mask = torch.zeros(len(lists), vocab + 1, dtype=torch.bool, device=self.counts.device)
        return mask.scatter_(1, padded, True)[:, :vocab]

    def move(self, source: torch.Tensor, dest: torch.Tensor) -> None:
        for tensor in (self.presence, self.frequency, self.repetition, self.min_tokens, self.generated, self.counts,
                       self.prompt_seen, self.stop_tokens):
            tensor.index_copy_(0, dest, tensor.index_select(0, source))

    def commit(self, slots: torch.Tensor, emitted: torch.Tensor, lengths: torch.Tensor) -> None:
        """An iteration's commit: rows `slots` ([R]) emitted [R, E] tokens, of which their output now has
        `lengths` ([R], the records' lengths after it): the new ones (lengths - generated) are counted."""
        kept = lengths - self.generated[slots]  # [R]
        offsets = torch.arange(emitted.shape[1], device=emitted.device)  # [E]
        weight = (offsets < kept[:, None]).to(torch.float32)  # [R, E]
        self.counts.index_put_((slots[:, None].expand_as(emitted), emitted.clamp(min=0)), weight, accumulate=True)
        self.generated[slots] = lengths

    def path_state(self, paths: NodePaths, rows: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """At each node of rows [0, rows): (its path's output counts [R, ..., V] float32, or None when no row
        penalises; its path's generated count [R, ...]): the row's committed ones plus the node's draft ones."""
        lead = paths.tokens.dim() - 1  # the node axes after the row axis, plus the path axis
        counts = None
        if self.penalizes:
            counts = self.counts[:rows].view(rows, *(1,) * (lead - 1), -1)  # [R, 1.., V]
            counts = counts.expand(*paths.tokens.shape[:-1], self.vocab_size)
            if paths.tokens.shape[-1]:
                counts = counts.clone().scatter_add_(-1, paths.tokens, paths.on_path())
        generated = self.generated[:rows].view(rows, *(1,) * (lead - 1)) + paths.depth  # [R, ...]
        return counts, generated

    def apply(self, logits: torch.Tensor, paths: NodePaths) -> torch.Tensor:
        """Penalised logits of rows [0, R): logits [R, ..., V] (after the logit bias), the nodes' paths ->
        [R, ..., V] float32."""
        rows = logits.shape[0]
        shape = (rows,) + (1,) * (logits.dim() - 1)  # [R, 1, ..., 1]
        counts, generated = self.path_state(paths, rows)
        scores = logits.float()
        if self.uses_min_tokens:
            stops = self.stop_tokens[:rows].view(rows, *(1,) * (logits.dim() - 2), -1)  # [R, 1.., V]
            scores = min_tokens_mask(scores, stops, generated, self.min_tokens[:rows].view(shape[:-1]))
        if counts is not None:
            seen = self.prompt_seen[:rows].view(rows, *(1,) * (logits.dim() - 2), -1)  # [R, 1.., V]
            scores = apply_penalties(scores, counts, seen, self.presence[:rows].view(shape),
                                     self.frequency[:rows].view(shape), self.repetition[:rows].view(shape))
        return scores


def root_paths(rows: int, device) -> NodePaths:
    """Rows [0, rows) at their committed tokens (the autoregressive step, the drafter's root): no draft token."""
    return draft_paths(torch.zeros(rows, 0, dtype=torch.int64, device=device))
