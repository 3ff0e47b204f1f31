"""Training a feature draft (`draft.kind=eagle`): a one-layer head over the target's hidden states.

One pass of the target over its own completions (`collect`) keeps, for every position, the target's features
(the layers the head reads, float16) and the top `train.top_k` tokens of its law at `train.temperature`
(ids and log-probabilities): the training steps then run the head only. The draft vocabulary is the
`draft.vocab_size` most frequent tokens of the target's completions (FR-Spec); the head's law is zero on the
others, so they never pay for the output layer and the output stays exact.

The head (`spectr.feature_draft.FeatureDraftModel`, EAGLE-1 layout by default: `fc(cat(embed, feature))`, one
decoder layer, the target's output rows for the draft vocabulary as its own trainable `lm_head`) reads the
pair (token x_{j+1}, feature f_j) at position j+1 and is trained, at every completion position, with
- the forward KL from the target's top-k law to its own (the tokens outside the draft vocabulary are left
  out: the head cannot draft them), which is what acceptance sum_x min(p, q) rewards, and
- (EAGLE-1) a smooth-L1 regression of its hidden state onto the target's next feature, so that the head's
  own hidden state can stand in for the target's feature when it drafts deeper than one token; with
  `train.unroll=2` a second pass feeds it exactly that (its own previous hidden states as features:
  EAGLE-3's training-time test), and the loss counts both passes.

Not here: the target's completions (`completions`), the job's output directory and tracking (`training`).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.train_draft.completions import Sequences
from spectr.feature_draft import EAGLE, EAGLE3, FeatureDraftConfig, FeatureDraftModel

log = logging.getLogger("pipeline")


@dataclass
class FeatureSet:
    """Per sequence: token ids [n], the target's features at positions 0..n-1 [n, F] (float16), and its top-k
    law of the next token at positions 0..n-1 (ids [n, k] int32, log-probabilities [n, k] float16)."""

    tokens: list[torch.Tensor]
    features: list[torch.Tensor]
    top_ids: list[torch.Tensor]
    top_log_probs: list[torch.Tensor]
    prompt_lengths: list[int]

    def __len__(self) -> int:
        return len(self.tokens)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for group in (self.features, self.top_ids, self.top_log_probs)
                   for t in group)


def feature_layers(target_config: Any, kind: str) -> list[int]:
    """HF `hidden_states` indices the head reads: the last normed state (EAGLE-1), or EAGLE-3's three layers."""
    layers = int(target_config.num_hidden_layers)
    if kind == EAGLE:
        return [layers]
    return [min(max(i, 0), layers) for i in (2, layers // 2, layers - 3)]  # clamped for very shallow targets


def frequent_tokens(sequences: Sequences, size: int | None, vocab_size: int, always: list[int]) -> torch.Tensor | None:
    """The draft vocabulary: the `size` tokens most frequent in the target's completions (ties: lower id),
    plus `always` (end-of-sequence ids), in ascending id order; None for the whole vocabulary."""
    if size is None or size >= vocab_size:
        return None
    counts = Counter()
    for ids, prompt in zip(sequences.token_ids, sequences.prompt_lengths):
        counts.update(ids[prompt:])
    ranked = sorted(counts, key=lambda token: (-counts[token], token))
    chosen = set(always)
    for token in ranked:
        if len(chosen) >= size:
            break
        chosen.add(token)
    token = 0
    while len(chosen) < size:  # fewer distinct tokens than the size: fill with the lowest ids
        chosen.add(token)
        token += 1
    return torch.tensor(sorted(chosen), dtype=torch.int64)


@torch.no_grad()
def collect(target: Any, sequences: Sequences, layers: list[int], temperature: float, top_k: int, device: str,
            batch_size: int = 16) -> FeatureSet:
    """One target pass over the sequences (sorted by length, batches of `batch_size`): features and top-k laws."""
    count = len(sequences)
    tokens, features, top_ids, top_log_probs = [None] * count, [None] * count, [None] * count, [None] * count
    order = sorted(range(count), key=lambda i: len(sequences.token_ids[i]))
    for first in range(0, count, batch_size):
        rows = order[first: first + batch_size]
        width = max(len(sequences.token_ids[i]) for i in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        attention = torch.zeros(len(rows), width, dtype=torch.long)
        for b, i in enumerate(rows):
            n = len(sequences.token_ids[i])
            ids[b, :n] = torch.tensor(sequences.token_ids[i])
            attention[b, :n] = 1
        out = target(input_ids=ids.to(device), attention_mask=attention.to(device), output_hidden_states=True)
        fused = torch.cat([out.hidden_states[i] for i in layers], -1)  # [B, T, F]
        log_probs = torch.log_softmax(out.logits.float() / max(temperature, 1e-6), -1)  # [B, T, V]
        values, indices = log_probs.topk(top_k, dim=-1)  # [B, T, k]
        for b, i in enumerate(rows):
            n = len(sequences.token_ids[i])
            tokens[i] = ids[b, :n].clone()
            features[i] = fused[b, :n].to("cpu", torch.float16)
            top_ids[i] = indices[b, :n].to("cpu", torch.int32)
            top_log_probs[i] = values[b, :n].to("cpu", torch.float16)
    return FeatureSet(tokens, features, top_ids, top_log_probs, list(sequences.prompt_lengths))


def build_head(target: Any, kind: str, draft_ids: torch.Tensor | None, init: str, seed: int) -> FeatureDraftModel:
    """A trainable head for `target`: its last decoder layer's weights as the start (`init=target`) or random;
    the draft vocabulary's rows of the target's output layer as its own `lm_head`."""
    text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    hidden, heads = int(text.hidden_size), int(text.num_attention_heads)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    config = FeatureDraftConfig(
        kind=kind, hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
        intermediate_size=int(text.intermediate_size), vocab_size=int(target.get_output_embeddings().weight.shape[0]),
        feature_layers=feature_layers(text, kind), rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta") or getattr(text, "rope_theta", 10000.0)),
        rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
        draft_vocab_size=None if draft_ids is None else int(draft_ids.shape[0]),
    )
    generator = torch.random.fork_rng(devices=[])
    with generator:
        torch.manual_seed(seed)
        head = FeatureDraftModel(config, target.get_input_embeddings(), target.get_output_embeddings())
    head = head.to(next(target.parameters()).device, torch.float32)
    with torch.no_grad():
        if draft_ids is not None:
            head.d2t.copy_(draft_ids - torch.arange(draft_ids.shape[0]))
            head.lm_head.weight.copy_(target.get_output_embeddings().weight[draft_ids.to(head.d2t.device)])
        elif head.lm_head is not None:
            head.lm_head.weight.copy_(target.get_output_embeddings().weight)
        if init == "target":
            _copy_last_layer(head, target)
        # start as "the feature passes through": the residual branches add nothing (their output projections at
        # zero) and, for EAGLE-1, fc(cat(e, f)) = f, so the head's first law is the target's at the position
        # before (a far better start than a random or copied layer's, whose output is far off the target's scale)
        head.o_proj.weight.zero_()
        head.down_proj.weight.zero_()
        if kind == EAGLE:
            head.fc.weight.zero_()
            head.fc.weight[:, hidden:].copy_(torch.eye(hidden))
            head.fc.bias.zero_()
    return head.train().requires_grad_(True)


def _copy_last_layer(head: FeatureDraftModel, target: Any) -> None:
    """The target's last decoder layer's attention and MLP weights as the head's start (EAGLE-3's attention
    reads 2H: only its feature half is copied)."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    layer = decoder.layers[-1]
    pairs = [(head.q_proj, layer.self_attn.q_proj), (head.k_proj, layer.self_attn.k_proj),
             (head.v_proj, layer.self_attn.v_proj), (head.o_proj, layer.self_attn.o_proj),
             (head.gate_proj, layer.mlp.gate_proj), (head.up_proj, layer.mlp.up_proj),
             (head.down_proj, layer.mlp.down_proj),
             (head.post_attention_layernorm, layer.post_attention_layernorm)]
    for mine, theirs in pairs:
        weight = theirs.weight.detach().float()
        if mine.weight.shape == weight.shape:
            mine.weight.copy_(weight)
        elif mine.weight.shape[1] == 2 * weight.shape[1]:
            mine.weight[:, weight.shape[1]:].copy_(weight)


def draft_index(head: FeatureDraftModel) -> torch.Tensor | None:
    """[V] target id -> draft index (-1 outside the draft vocabulary); None for the whole vocabulary."""
    ids = head.draft_ids()
    if ids is None:
        return None
    index = torch.full((head.config.vocab_size,), -1, dtype=torch.int64, device=ids.device)
    index[ids] = torch.arange(ids.shape[0], device=ids.device)
    return index


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] x_{j+1}
    features: torch.Tensor  # [B, T, F] f_j
    next_features: torch.Tensor  # [B, T, H] the target's last normed state at j+1 (EAGLE-1's regression target)
    positions: torch.Tensor  # [B, T] j + 1
    mask: torch.Tensor  # [B, T] positions that predict a completion token
    top_ids: torch.Tensor  # [B, T, k] the target's law of x_{j+2}
    top_log_probs: torch.Tensor  # [B, T, k]


def make_batch(data: FeatureSet, rows: list[int], device: str, regression_size: int,
               prompt_positions: bool = False) -> Batch:
    """Pairs (x_{j+1}, f_j) for j = 0 .. n-2 of each chosen sequence, right-padded; the loss reads the pairs
    that predict a completion token, or (`prompt_positions`) every pair: the prompt's text is the target's
    own features and laws too, free data from the same pass."""
    width = max(len(data.tokens[i]) for i in rows) - 1
    size = data.features[rows[0]].shape[-1]
    k = data.top_ids[rows[0]].shape[-1]
    batch = len(rows)
    tokens = torch.zeros(batch, width, dtype=torch.long)
    features = torch.zeros(batch, width, size, dtype=torch.float16)
    following = torch.zeros(batch, width, regression_size, dtype=torch.float16)
    mask = torch.zeros(batch, width, dtype=torch.bool)
    top_ids = torch.zeros(batch, width, k, dtype=torch.int32)
    top_log_probs = torch.full((batch, width, k), -1e4, dtype=torch.float16)
    for b, i in enumerate(rows):
        n = len(data.tokens[i]) - 1
        tokens[b, :n] = data.tokens[i][1:]
        features[b, :n] = data.features[i][:-1]
        following[b, :n] = data.features[i][1:, -regression_size:]
        top_ids[b, :n] = data.top_ids[i][1:]
        top_log_probs[b, :n] = data.top_log_probs[i][1:]
        # pair j predicts token j + 2: a completion token when j + 2 >= prompt length (and it exists: j + 2 < n + 1)
        mask[b, 0 if prompt_positions else max(data.prompt_lengths[i] - 2, 0): n - 1] = True
    positions = torch.arange(1, width + 1).expand(batch, width)
    return Batch(tokens.to(device), features.to(device).float(), following.to(device).float(), positions.to(device),
                 mask.to(device), top_ids.to(device).long(), top_log_probs.to(device).float())


def shuffle_laws(batch: Batch, generator: torch.Generator) -> None:
    """Negative control (`train.shuffle_targets`): the target's laws permuted across the batch's positions."""
    shape = batch.top_ids.shape
    order = torch.randperm(shape[0] * shape[1], generator=generator).to(batch.top_ids.device)
    batch.top_ids = batch.top_ids.reshape(-1, shape[2])[order].reshape(shape)
    batch.top_log_probs = batch.top_log_probs.reshape(-1, shape[2])[order].reshape(shape)
    batch.next_features = batch.next_features.reshape(-1, batch.next_features.shape[-1])[order].reshape(
        batch.next_features.shape)


def _attend(keys: list[tuple[torch.Tensor, torch.Tensor]]):
    """The attention of drafting depth d = len(keys) + 1 at every position j at once (EAGLE-3's training-time
    test): the pairs before the depth-1 node read the target's features (pass 1's keys at i <= j - d + 1), the
    nodes of depths 2 .. d are this position's own chain (pass r's key at j - (d - r)): what the engine's
    drafter attends to when it drafts depth d after the committed tokens."""
    def attend(k: torch.Tensor, v: torch.Tensor):  # k, v: [B, Hkv, T, D]
        width, depth = k.shape[2], len(keys) + 1
        ones = torch.ones(width, width, dtype=torch.bool, device=k.device)
        masks = [ones.tril(-(depth - 1))] + [ones.tril(-(depth - r)) & ones.triu(-(depth - r))
                                             for r in range(2, depth + 1)]
        mask = torch.cat(masks, -1).expand(k.shape[0], width, width * depth)
        return torch.cat([x for x, _ in keys] + [k], 2), torch.cat([y for _, y in keys] + [v], 2), mask
    return attend


def unrolled(head: FeatureDraftModel, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
             passes: int):
    """The head's hidden states [B, T, H] for drafting depths 1 .. `passes` at every position: pass 1 reads the
    target's features; pass d reads, at position j, the head's own state of pass d - 1 at j - 1 (its guess of
    the feature there) and attends as `_attend` says."""
    keys: list[tuple[torch.Tensor, torch.Tensor]] = []
    from_target = True
    for depth in range(1, passes + 1):
        def record(k, v, _depth=depth, _chain=_attend(list(keys))):  # noqa: B008 (bound per pass)
            if _depth < passes:
                keys.append((k, v))
            if _depth > 1:
                return _chain(k, v)
            width = k.shape[2]
            causal = torch.ones(width, width, dtype=torch.bool, device=k.device).tril()
            return k, v, causal.expand(k.shape[0], width, width)
        hidden = head(tokens, features, positions, from_target=from_target,
                      attend=record if passes > 1 else None)  # [B, T, H]
        yield hidden
        features = torch.cat([hidden[:, :1], hidden[:, :-1]], 1)  # position j reads the head's guess of f_j
        from_target = head.config.kind == EAGLE  # EAGLE-1's fc reads H either way; EAGLE-3's reads its own H raw


def head_loss(head: FeatureDraftModel, batch: Batch, index: torch.Tensor | None, unroll: int,
              regression_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    """KL from the target's top-k law (restricted to the draft vocabulary) plus EAGLE-1's feature regression,
    over `unroll` drafting depths (`unrolled`: depth d reads the head's own states of depth d - 1)."""
    total = torch.zeros((), device=batch.tokens.device)
    parts = {}
    mask = batch.mask
    ids = batch.top_ids if index is None else index[batch.top_ids]  # [B, T, k] draft index (-1: none)
    q = batch.top_log_probs.exp() * (ids >= 0)
    for step, hidden in enumerate(unrolled(head, batch.tokens, batch.features, batch.positions, unroll)):
        log_p = torch.log_softmax(head.draft_logits(hidden).float(), -1)  # [B, T, Vd]
        picked = log_p.gather(-1, ids.clamp(min=0))  # [B, T, k]
        kl = (q * (batch.top_log_probs - picked)).sum(-1)  # [B, T]
        loss = kl[mask].mean()
        parts[f"kl{step}"] = float(loss.detach())
        if head.config.kind == EAGLE and regression_weight > 0:
            regression = F.smooth_l1_loss(hidden[mask], batch.next_features[mask])
            parts[f"regression{step}"] = float(regression.detach())
            loss = loss + regression_weight * regression
        total = total + loss
        mask = mask.clone()
        mask[:, step] = False  # depth step + 2 has no chain at position step
    return total / unroll, parts


@torch.no_grad()
def heldout_acceptance(target: Any, head: FeatureDraftModel, heldout: Sequences, temperature: float, device: str,
                       batch_size: int = 8) -> tuple[float, float, int]:
    """(mean sum_x min(p, q) over the held-out completion positions with the target's true features,
    the same when the head reads its own previous state (a second drafted token), positions), at
    `temperature`, with the head's laws mapped to the whole vocabulary (zero outside the draft vocabulary)."""
    layers = head.config.feature_layers
    totals, counted = [0.0, 0.0], 0
    for first in range(0, len(heldout), batch_size):
        rows = list(range(first, min(first + batch_size, len(heldout))))
        width = max(len(heldout.token_ids[i]) for i in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        attention = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width - 1, dtype=torch.bool)
        for b, i in enumerate(rows):
            n = len(heldout.token_ids[i])
            ids[b, :n] = torch.tensor(heldout.token_ids[i])
            attention[b, :n] = 1
            mask[b, max(heldout.prompt_lengths[i] - 2, 0): n - 2] = True
        ids, attention, mask = ids.to(device), attention.to(device), mask.to(device)
        out = target(input_ids=ids, attention_mask=attention, output_hidden_states=True)
        fused = torch.cat([out.hidden_states[i] for i in layers], -1).float()[:, :-1]  # f_j, j = 0 .. T-2
        q = torch.softmax(out.logits.float()[:, 1:-1] / temperature, -1)  # [B, T-2, V] law of x_{j+2}
        tokens = ids[:, 1:]
        positions = torch.arange(1, width, device=device).expand(len(rows), -1)
        depth1, depth2 = unrolled(head, tokens, fused, positions, 2)
        p = torch.softmax(head.full_logits(depth1).float()[:, :-1] / temperature, -1)
        m = mask[:, :-1]
        totals[0] += float(torch.minimum(p, q).sum(-1)[m].sum())
        p2 = torch.softmax(head.full_logits(depth2).float()[:, :-1] / temperature, -1)
        m2 = m.clone()
        m2[:, 0] = False
        totals[1] += float(torch.minimum(p2, q).sum(-1)[m2].sum() / max(int(m2.sum()), 1) * int(m.sum()))
        counted += int(m.sum())
    return totals[0] / max(counted, 1), totals[1] / max(counted, 1), counted


__all__ = ["EAGLE", "EAGLE3", "FeatureSet", "build_head", "collect", "frequent_tokens", "head_loss",
           "heldout_acceptance", "make_batch", "unrolled"]
