"""The generation loop: `spectr.generate` over a Hugging Face draft/target pair, batched.

Each iteration has four phases for every active prompt (row):

1) draft   - `TreeDrafter.propose`: K drafts x L tokens, one draft forward per position,
             returned with the draft distributions they were drawn from;
2) verify  - one target forward over all drafts of all rows: per row the last committed
             token followed by the K*L draft tokens, laid out as a tree after the row's
             cached prefix (4D mask + explicit position ids), so target_probs[:, k, 0] is
             q after the last committed token and target_probs[:, k, j] is q after draft
             k's first j tokens;
3) select  - `spectr.sequence.select_sequences` (SpecTr, SpecInfer or speculative sampling);
4) commit  - both KV caches keep only the accepted path (`keep_path`), rows advance by
             different amounts, finished rows (EOS or max_new_tokens) leave the batch.

`method="autoregressive"` is the plain target-only loop with the same cache, warps and
per-row generators (one target forward per token).

Host syncs: one per iteration (the selected tokens are copied to the host for EOS/length
bookkeeping); shapes in the loop are computed from host mirrors of the cache lengths.
(The selection walk in spectr.sequence may sync on its own per draft position.)

This module knows nothing about tokenizers, Ray or files: prompts are lists of token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spectr.drafting import TreeDrafter
from spectr.hf import HFCausalLM
from spectr.kv_cache import tree_attention
from spectr.rng import draw_uniforms, make_generators, sample_categorical
from spectr.selection import TOKEN_SELECTORS
from spectr.sequence import select_sequences
from spectr.stats import GenerationStats, PhaseTimer
from spectr.warps import SamplingWarp, validate_sampling

AUTOREGRESSIVE = "autoregressive"


def known_methods() -> list[str]:
    return [AUTOREGRESSIVE, *sorted(TOKEN_SELECTORS)]


@dataclass
class GenerationOutput:
    """tokens[i]: generated ids of prompt i (prompt excluded, EOS included if produced)."""

    tokens: list[list[int]]
    stats: GenerationStats


def generate(
    target,
    draft,
    prompts: Sequence[Sequence[int]],
    *,
    method: str = "spectr",
    num_drafts: int = 4,
    draft_length: int = 4,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    seed: int | Sequence[int] = 0,
) -> GenerationOutput:
    """Generate up to `max_new_tokens` tokens per prompt from `target`, exactly its (warped) distribution.

    target, draft: Hugging Face causal LMs sharing a vocabulary (`draft` may be None for
    "autoregressive"). prompts: list of token-id lists. method: "autoregressive",
    "speculative" (one draft: num_drafts is taken as 1), "spectr" or "specinfer".
    top_k=0 / top_p=1.0 mean no truncation; temperature=0 is greedy (and drafts one path:
    K identical argmax drafts would add nothing). seed: an int (row i
    uses seed + i) or one int per prompt; a row's output depends only on its prompt, its
    seed, the models and the settings.
    """
    generation = Generation(target, draft, prompts, method=method, num_drafts=num_drafts,
                            draft_length=draft_length, max_new_tokens=max_new_tokens, temperature=temperature,
                            top_k=top_k, top_p=top_p, eos_token_id=eos_token_id, seed=seed)
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


# ---------------------------------------------------------------------------------------
# input checks
# ---------------------------------------------------------------------------------------


def _check_prompts(prompts) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    checked = []
    for row, prompt in enumerate(prompts):
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise ValueError(f"prompt {row} must be a list of token ids, got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise ValueError(f"prompt {row} is empty; every prompt needs at least one token")
        for position, token in enumerate(prompt):
            if isinstance(token, bool) or not isinstance(token, int):
                raise ValueError(f"prompt {row} has a non-integer token {token!r} at position {position}")
        checked.append([int(t) for t in prompt])
    return checked


def _check_prompts_fit(prompts: list[list[int]], model: HFCausalLM, max_new_tokens: int) -> None:
    for row, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= t < model.vocab_size]
        if bad:
            raise ValueError(
                f"prompt {row} has token id {bad[0]} outside the {model.role} vocabulary [0, {model.vocab_size})"
            )
        total = len(prompt) + max_new_tokens
        if model.max_positions is not None and total > model.max_positions:
            raise ValueError(
                f"prompt {row}: {len(prompt)} prompt tokens + max_new_tokens {max_new_tokens} = {total} exceeds "
                f"the {model.role} model's {model.max_positions} positions ({model.model_type})"
            )
        if model.sliding_window is not None and total > model.sliding_window:
            raise ValueError(
                f"prompt {row}: {total} tokens exceed the {model.role} model's sliding window "
                f"{model.sliding_window} ({model.model_type}); the engine's tree mask supports sequences "
                f"within the window only"
            )


def _check_eos(eos_token_id) -> list[int]:
    if eos_token_id is None:
        return []
    ids = [eos_token_id] if isinstance(eos_token_id, int) and not isinstance(eos_token_id, bool) else eos_token_id
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    if not isinstance(ids, Sequence) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ValueError(f"eos_token_id must be None, an int or a list of ints, got {eos_token_id!r}")
    return [int(i) for i in ids]


def _check_seeds(seed, num_prompts: int) -> list[int]:
    if isinstance(seed, int) and not isinstance(seed, bool):
        return [seed + row for row in range(num_prompts)]
    if isinstance(seed, torch.Tensor):
        seed = seed.tolist()
    if not isinstance(seed, Sequence) or any(isinstance(s, bool) or not isinstance(s, int) for s in seed):
        raise ValueError(f"seed must be an int or one int per prompt, got {seed!r}")
    if len(seed) != num_prompts:
        raise ValueError(f"seed has {len(seed)} entries but there are {num_prompts} prompts")
    return [int(s) for s in seed]


# ---------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------


class _UniformBlocks:
    """Per-row uniforms for `block` iterations at a time: [B, block, *shape], one draw per row per block.

    A row consumes block * prod(shape) uniforms every `block` iterations from its own generator,
    whatever the other rows do.
    """

    def __init__(self, generators: list[torch.Generator], shape: tuple[int, ...], block: int, device):
        self.generators, self.shape, self.block, self.device = generators, shape, block, device
        self.buffer: torch.Tensor | None = None
        self.cursor = block

    def next(self) -> torch.Tensor:
        if self.cursor == self.block:
            self.buffer = draw_uniforms(self.generators, (self.block, *self.shape), self.device)
            self.cursor = 0
        out = self.buffer[:, self.cursor]
        self.cursor += 1
        return out

    def select_rows(self, rows: torch.Tensor, generators: list[torch.Generator]) -> None:
        self.generators = generators
        if self.buffer is not None:
            self.buffer = self.buffer.index_select(0, rows)


def prefill(model: HFCausalLM, cache, prompts: list[list[int]], device) -> None:
    """Write every prompt but its last token into `cache` (right-padded batch, causal mask)."""
    width = max(len(p) for p in prompts) - 1
    if width == 0:
        return
    padded = torch.tensor([p[:-1] + [0] * (width + 1 - len(p)) for p in prompts], dtype=torch.int64, device=device)
    positions = torch.arange(width, device=device).expand(len(prompts), width)  # [B, P]
    causal = positions[0][:, None] >= positions[0][None, :]  # [P, P]
    # Padded queries see only real keys before them (or themselves); real keys never see padding.
    allowed = tree_attention(cache.rows.lengths, causal, width)
    model.forward(padded, positions, allowed, cache, positions, last_only=True)
    lengths = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.int64, device=device)
    cache.rows.lengths = lengths


class Generation:
    """One batched generation, step by step: `start()` (prefill), `step()` until `done`, `finish()`.

    `spectr.generate` is the usual entry point; this class exists so that tests (and callers
    that want to inspect caches between iterations) can drive the loop themselves. The
    constructor validates everything and raises ValueError naming the bad argument or row.
    Drive it under `torch.inference_mode()` with models in eval mode.
    """

    def __init__(self, target, draft, prompts, *, method="spectr", num_drafts=4, draft_length=4,
                 max_new_tokens=64, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, seed=0):
        prompts = _check_prompts(prompts)
        if method not in known_methods():
            raise ValueError(f"unknown method {method!r}; expected one of {known_methods()}")
        for name, value in (("num_drafts", num_drafts), ("draft_length", draft_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        validate_sampling(temperature, top_k, top_p)
        self.warp = SamplingWarp(float(temperature), int(top_k), float(top_p))
        self.eos_ids = set(_check_eos(eos_token_id))
        seeds = _check_seeds(seed, len(prompts))
        if method == "speculative" or (self.warp.greedy and method != AUTOREGRESSIVE):
            # speculative sampling is the K = 1 rule; under greedy decoding the K drafts would all
            # be the draft's argmax path, identical, so one draft gives the same output for less work
            num_drafts = 1
        speculative = method != AUTOREGRESSIVE

        self.target = HFCausalLM(target, role="target")
        self.draft = None
        if speculative:
            if draft is None:
                raise ValueError(f"method {method!r} needs a draft model; got draft=None")
            self.draft = HFCausalLM(draft, role="draft")
            if self.draft.vocab_size != self.target.vocab_size:
                raise ValueError(
                    f"target and draft must share a vocabulary: target vocab size {self.target.vocab_size} "
                    f"({self.target.model_type}), draft vocab size {self.draft.vocab_size} ({self.draft.model_type})"
                )
            if self.draft.device != self.target.device:
                raise ValueError(
                    f"target and draft must be on the same device: target on {self.target.device}, "
                    f"draft on {self.draft.device}"
                )
        for model in (self.target, self.draft):
            if model is not None:
                _check_prompts_fit(prompts, model, max_new_tokens)

        self.method, self.max_new_tokens = method, max_new_tokens
        self.num_drafts = num_drafts if speculative else 0
        self.draft_length = draft_length if speculative else 0
        self.prompts = prompts
        self.seeds = seeds
        self.device = self.target.device
        self.stats = GenerationStats(
            method=method,
            num_drafts=self.num_drafts,
            draft_length=self.draft_length,
            generated_tokens=[0] * len(prompts),
            target_calls=[0] * len(prompts),
            finish_reason=["length"] * len(prompts),
            accepted_per_position=[0] * self.draft_length,
            tokens_per_call_histogram=[0] * (max(self.draft_length, 1) + 2),
        )
        self.outputs: list[list[int]] = [[] for _ in prompts]
        self.rows: list[int] = []  # active row -> prompt index; empty until start()
        self.timer = PhaseTimer(self.device)

    @property
    def done(self) -> bool:
        return not self.rows

    def output(self) -> GenerationOutput:
        return GenerationOutput(tokens=self.outputs, stats=self.stats)

    def step(self) -> None:
        """One iteration for every active row."""
        if self.method == AUTOREGRESSIVE:
            self._autoregressive_step()
        else:
            self._speculative_step()

    def finish(self) -> None:
        self.timer.finish(self.stats)

    # -- setup ------------------------------------------------------------------------
    def _prefill(self, model: HFCausalLM, tree_width: int):
        capacity = max(len(p) for p in self.prompts) + self.max_new_tokens + tree_width
        cache = model.new_cache(len(self.prompts), capacity)
        with self.timer.phase("target" if model is self.target else "draft"):
            prefill(model, cache, self.prompts, self.device)
        return cache

    def start(self) -> None:
        """Prefill both caches with every prompt but its last token (which becomes pending)."""
        self.timer = PhaseTimer(self.device)
        if not self.prompts or self.max_new_tokens == 0:
            return
        self.rows = list(range(len(self.prompts)))
        self.generators = make_generators(self.seeds, self.device)
        last_tokens = torch.tensor([p[-1] for p in self.prompts], dtype=torch.int64, device=self.device)
        self.pending = last_tokens  # [B] the last committed token, not yet in the target cache
        self.lengths_host = [len(p) - 1 for p in self.prompts]  # host mirror of target cache lengths
        if self.method == AUTOREGRESSIVE:
            self.target_cache = self._prefill(self.target, 1)
            self.self_only = torch.ones(1, 1, dtype=torch.bool, device=self.device)  # [1, 1]
            self.uniforms = _UniformBlocks(self.generators, (), 32, self.device)
        else:
            k, length = self.num_drafts, self.draft_length
            self.target_cache = self._prefill(self.target, 1 + k * length)
            draft_cache = self._prefill(self.draft, 2 + k * length)
            self.drafter = TreeDrafter(self.draft, draft_cache, self.warp, k, length, last_tokens,
                                       self.lengths_host)
            self.uniforms = _UniformBlocks(self.generators, (k, length), 8, self.device)
            self._tree_shape(k, length)

    def _tree_shape(self, num_drafts: int, draft_length: int) -> None:
        """Static layout of the verification tree: node 0 = last committed token, node 1 + k*L + j = draft k's token j."""
        nodes = 1 + num_drafts * draft_length
        depth = torch.zeros(nodes, dtype=torch.int64)
        ancestors = torch.zeros(nodes, nodes, dtype=torch.bool)  # [T, T] node t may attend node r
        ancestors[:, 0] = True
        for k in range(num_drafts):
            for j in range(draft_length):
                node = 1 + k * draft_length + j
                depth[node] = 1 + j
                ancestors[node, 1 + k * draft_length : node + 1] = True
        # target_probs[:, k, 0] is q after the last committed token, [:, k, j] q after draft k's token j-1
        node_of = torch.zeros(num_drafts, draft_length + 1, dtype=torch.int64)
        for k in range(num_drafts):
            node_of[k, 1:] = 1 + k * draft_length + torch.arange(draft_length)
        self.tree_depth = depth.to(self.device)
        self.tree_ancestors = ancestors.to(self.device)
        self.tree_node_of = node_of.to(self.device)

    # -- autoregressive ---------------------------------------------------------------
    def _autoregressive_step(self) -> None:
        lengths = self.target_cache.rows.lengths  # [B]
        with self.timer.phase("target"):
            slots = lengths[:, None]  # [B, 1]
            allowed = tree_attention(lengths, self.self_only, max(self.lengths_host) + 1)
            logits = self.target.forward(self.pending[:, None], slots, allowed, self.target_cache, slots)
        with self.timer.phase("selection"):
            probs = self.warp.probs(logits[:, 0])  # [B, V]
            next_tokens = sample_categorical(probs, self.uniforms.next())  # [B]
        self.target_cache.rows.advance(torch.ones_like(lengths))
        self.pending = next_tokens
        emitted = next_tokens[:, None].cpu().tolist()  # the one host sync of the iteration
        for row in range(len(self.rows)):
            self.lengths_host[row] += 1
        self._bookkeeping(emitted)

    # -- speculative ------------------------------------------------------------------
    def _speculative_step(self) -> None:
        k, length = self.num_drafts, self.draft_length
        uniforms = self.uniforms.next()  # [B, K, L]
        with self.timer.phase("draft"):
            proposal = self.drafter.propose(uniforms)
        batch = len(self.rows)
        lengths = self.target_cache.rows.lengths  # [B]
        with self.timer.phase("target"):
            tree_tokens = torch.cat([self.pending[:, None], proposal.tokens.reshape(batch, k * length)], 1)  # [B, T]
            slots = lengths[:, None] + torch.arange(tree_tokens.shape[1], device=self.device)  # [B, T]
            positions = lengths[:, None] + self.tree_depth  # [B, T]
            allowed = tree_attention(lengths, self.tree_ancestors, max(self.lengths_host) + tree_tokens.shape[1])
            logits = self.target.forward(tree_tokens, positions, allowed, self.target_cache, slots)  # [B, T, V]
        with self.timer.phase("selection"):
            node_probs = self.warp.probs(logits)  # [B, T, V]
            target_probs = node_probs[:, self.tree_node_of]  # [B, K, L+1, V]
            selection = select_sequences(proposal.tokens, proposal.probs, target_probs, self.generators,
                                         method=self.method, validate=False)
        num_accepted = selection.num_accepted  # [B]
        next_tokens = selection.tokens.gather(1, num_accepted[:, None]).squeeze(1)  # [B] correction or bonus

        # commit: the target keeps the last committed token and the accepted path of the chosen draft
        depth = torch.arange(length, device=self.device)  # [L]
        dest = lengths[:, None] + 1 + depth  # [B, L]
        source = lengths[:, None] + 1 + selection.draft_index[:, None] * length + depth  # [B, L]
        self.target_cache.rows.keep_path(torch.where(depth < num_accepted[:, None], source, dest), dest)
        self.target_cache.rows.advance(1 + num_accepted)
        self.pending = next_tokens

        packed = torch.cat([num_accepted[:, None], selection.tokens], 1).cpu().tolist()  # the host sync
        accepted_host = [row[0] for row in packed]
        self.drafter.commit(proposal, selection.draft_index, num_accepted, next_tokens, accepted_host)
        for row, accepted in enumerate(accepted_host):
            self.lengths_host[row] += 1 + accepted
            for position in range(accepted):
                self.stats.accepted_per_position[position] += 1
            self.stats.tested_positions += min(accepted + 1, length)
        emitted = [row[1 : 2 + row[0]] for row in packed]
        self._bookkeeping(emitted)

    # -- bookkeeping ------------------------------------------------------------------
    def _bookkeeping(self, emitted: list[list[int]]) -> None:
        """Append each active row's new tokens (cut at EOS / max_new_tokens); drop finished rows."""
        keep = []
        for row, tokens in enumerate(emitted):
            prompt_index = self.rows[row]
            out = self.outputs[prompt_index]
            budget = self.max_new_tokens - len(out)
            tokens = tokens[:budget]
            finished = None
            for cut, token in enumerate(tokens):
                if token in self.eos_ids:
                    tokens = tokens[: cut + 1]
                    finished = "eos"
                    break
            out.extend(tokens)
            self.stats.target_calls[prompt_index] += 1
            self.stats.generated_tokens[prompt_index] += len(tokens)
            self.stats.tokens_per_call_histogram[len(tokens)] += 1
            if finished is None and len(out) >= self.max_new_tokens:
                finished = "length"
            if finished is None:
                keep.append(row)
            else:
                self.stats.finish_reason[prompt_index] = finished
        if len(keep) < len(self.rows):
            self._select_rows(keep)

    def _select_rows(self, keep: list[int]) -> None:
        rows = torch.tensor(keep, dtype=torch.int64, device=self.device)
        self.rows = [self.rows[r] for r in keep]
        self.lengths_host = [self.lengths_host[r] for r in keep]
        self.generators = [self.generators[r] for r in keep]
        self.pending = self.pending.index_select(0, rows)
        self.target_cache.rows.select_rows(rows)
        self.uniforms.select_rows(rows, self.generators)
        if self.method != AUTOREGRESSIVE:
            self.drafter.select_rows(rows, keep)
