"""The generation loop: `spectr.generate` over a Hugging Face draft/target pair, batched.

Each iteration has four phases for every row of the batch:

1) draft   - `TreeDrafter.propose`: K drafts x L tokens as a prefix tree (spectr.tree), one
             draft forward per position, returned with the draft-model rows they were drawn from;
2) verify  - one target forward over the tree of every row: the last committed token, then
             one token per unique tree node, after the row's cached prefix (4D mask + explicit
             position ids), padded to the widest tree of the batch;
3) select  - `spectr.sequence.select_tree` (SpecTr, SpecInfer, speculative sampling, or block
             verification), on the node's own p and q;
4) commit  - both KV caches keep only the accepted path (`keep_path`, one gather and one
             scatter per cache), rows advance by different amounts, and `spectr.records`
             appends the emitted tokens and marks rows that finished.

`method="autoregressive"` is the plain target-only loop with the same cache, warps and
random streams (one target forward per token).

Host syncs: one per iteration for autoregressive and the single-draft methods (speculative,
block), two for multi-draft methods (spectr, specinfer with K > 1). The last (or only) one
copies a few ints after the commit: how many rows still run and the longest cache rows,
which size the next forwards. With K > 1 the widest tree's node count is also copied before
the verify forward, which sets its width (one draft is always a chain of L + 1 nodes).
Everything per row (tokens, EOS and length cuts, finish reasons, statistics) stays on the
device until `finish`.

Finished rows stay in the batch, masked (their caches and outputs are frozen), until the
batch is compacted: when at least `compact_fraction` of its rows have finished, the running
rows are copied out in one index_select per cache.

Randomness: each row's uniforms come from its counter-based stream (spectr.rng), keyed by its
seed and its own iteration count, so a row's output does not depend on its batch.

This module knows nothing about tokenizers, Ray or files: prompts are lists of token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spectr.drafting import TreeDrafter, nonfinite_rows
from spectr.hf import HFCausalLM
from spectr.kv_cache import tree_attention
from spectr.records import DRAFT_NONFINITE, TARGET_NONFINITE, Records
from spectr.rng import IterationSlots, counter_uniforms, row_keys, sample_categorical
from spectr.sequence import row_splits, select_tree, sequence_methods
from spectr.settings import AUTOREGRESSIVE, Settings, check_prompts, check_prompts_fit
from spectr.stats import GenerationStats, PhaseTimer
from spectr.tree import verify_layout

# Compact the batch once this fraction of its rows has finished (0: at every finished row).
# On the CPU a finished row costs about as much per iteration as a running one and the copy
# is cheap: measured with scripts/bench_engine.py (embedded pair, spectr K=4 L=4, B=16, EOS
# on, 8 interleaved rounds) at 146 / 134 / 114 tokens per CPU second for 0 / 0.5 / 1. On
# CUDA a copy of every cache is expensive at large batch and a masked row is cheap while the
# forward is memory-bound, so rows are kept until half the batch has finished (not measured
# on a GPU yet).
DEFAULT_COMPACT_FRACTION = {"cpu": 0.0, "cuda": 0.5}


def known_methods() -> list[str]:
    return [AUTOREGRESSIVE, *sequence_methods()]


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
    max_new_tokens: int | Sequence[int] = 64,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    seed: int | Sequence[int] = 0,
    batch_size: int | None = None,
) -> GenerationOutput:
    """Generate up to `max_new_tokens` tokens per prompt from `target`, exactly its (warped) distribution.

    target, draft: Hugging Face causal LMs sharing a vocabulary (`draft` may be None for
    "autoregressive"). prompts: list of token-id lists. method: "autoregressive",
    "speculative" (one draft: num_drafts is taken as 1), "spectr", "specinfer" or "block"
    (block verification of one draft, num_drafts taken as 1).
    max_new_tokens: an int or one int per prompt. eos_token_id: None, an int or a list of ints.
    top_k=0 / top_p=1.0 mean no truncation; temperature=0 is greedy (and drafts one path:
    K identical argmax drafts would add nothing). seed: an int (row i uses seed + i) or one
    int per prompt; a row's output depends only on its prompt, its seed, the models and the
    settings. batch_size: rows in flight; None = all prompts at once, else consecutive groups
    of batch_size prompts (a finished row's slot is not refilled yet; the output is the same).
    """
    checked = check_prompts(prompts)
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be None or an int >= 1, got {batch_size!r}")
    arguments = dict(method=method, num_drafts=num_drafts, draft_length=draft_length, max_new_tokens=max_new_tokens,
                     temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id, seed=seed)
    if batch_size is None or batch_size >= len(checked):
        return _run(Generation(target, draft, checked, **arguments))
    settings = Settings.from_arguments(checked, methods=known_methods(), **arguments)
    output = None
    for start in range(0, len(checked), batch_size):
        rows = slice(start, start + batch_size)
        part = _run(Generation(target, draft, checked[rows], **(arguments | dict(
            max_new_tokens=list(settings.max_new_tokens[rows]), seed=list(settings.seeds[rows])))))
        if output is None:
            output = part
        else:
            output.tokens.extend(part.tokens)
            output.stats.extend(part.stats)
    return output


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


def prefill(model: HFCausalLM, cache, prompts: list[list[int]], device) -> None:
    """Write every prompt but its last token into `cache` (right-padded batch, causal mask). No host sync."""
    width = max(len(p) for p in prompts) - 1
    if width == 0:
        return
    padded = torch.tensor([p[:-1] + [0] * (width + 1 - len(p)) for p in prompts], dtype=torch.int64, device=device)
    positions = torch.arange(width, device=device).expand(len(prompts), width)  # [B, P]
    causal = positions[0][:, None] >= positions[0][None, :]  # [P, P]
    # Padded queries see only real keys before them (or themselves); real keys never see padding.
    allowed = tree_attention(cache.rows.lengths, causal, width)
    model.forward(padded, positions, allowed, cache, positions, last_only=True)
    cache.rows.lengths = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.int64, device=device)


def _load_models(target, draft, settings: Settings, prompts) -> tuple[HFCausalLM, HFCausalLM | None]:
    target_lm = HFCausalLM(target, role="target")
    draft_lm = None
    if settings.speculative:
        if draft is None:
            raise ValueError(f"method {settings.method!r} needs a draft model; got draft=None")
        draft_lm = HFCausalLM(draft, role="draft")
        if draft_lm.vocab_size != target_lm.vocab_size:
            raise ValueError(
                f"target and draft must share a vocabulary: target vocab size {target_lm.vocab_size} "
                f"({target_lm.model_type}), draft vocab size {draft_lm.vocab_size} ({draft_lm.model_type})"
            )
        if draft_lm.device != target_lm.device:
            raise ValueError(
                f"target and draft must be on the same device: target on {target_lm.device}, "
                f"draft on {draft_lm.device}"
            )
    for model in (target_lm, draft_lm):
        if model is not None:
            check_prompts_fit(prompts, model, settings.max_new_tokens)
    return target_lm, draft_lm


class Generation:
    """One batched generation, step by step: `start()` (prefill), `step()` until `done`, `finish()`.

    `spectr.generate` is the usual entry point; this class exists so that tests (and callers
    that want to inspect caches between iterations) can drive the loop themselves. The
    constructor validates everything and raises ValueError naming the bad argument or row.
    Drive it under `torch.inference_mode()` with models in eval mode.

    Row state (all [B], device): `row_prompt` (prompt index of each row), `running`,
    `pending` (the last committed token, not yet in the target cache), `row_iteration`.
    """

    def __init__(self, target, draft, prompts, *, method="spectr", num_drafts=4, draft_length=4,
                 max_new_tokens=64, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, seed=0,
                 compact_fraction: float | None = None):
        self.prompts = check_prompts(prompts)
        self.settings = Settings.from_arguments(
            self.prompts, methods=known_methods(), method=method, num_drafts=num_drafts,
            draft_length=draft_length, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
            top_p=top_p, eos_token_id=eos_token_id, seed=seed)
        self.target, self.draft = _load_models(target, draft, self.settings, self.prompts)
        self.method, self.warp = self.settings.method, self.settings.warp
        self.num_drafts, self.draft_length = self.settings.num_drafts, self.settings.draft_length
        self.device = self.target.device
        if compact_fraction is None:
            compact_fraction = DEFAULT_COMPACT_FRACTION.get(self.device.type, 0.5)
        self.compact_fraction = float(compact_fraction)
        self.stats = GenerationStats(method=self.method, num_drafts=self.num_drafts, draft_length=self.draft_length)
        self.slots = IterationSlots(self.num_drafts, self.draft_length)
        self.records = Records(len(self.prompts), self.settings.max_new_tokens, self.draft_length + 1,
                               self.draft_length, self.settings.eos_ids, self.device)
        self.rows_running = 0  # host copy of running.sum()
        self.timer = PhaseTimer(self.device)
        self.tokens: list[list[int]] = [[] for _ in self.prompts]

    @property
    def done(self) -> bool:
        return self.rows_running == 0

    def output(self) -> GenerationOutput:
        return GenerationOutput(tokens=self.tokens, stats=self.stats)

    def row_sequences(self) -> list[list[int]]:
        """Prompt + generated tokens of each row of the batch, in batch order (reads the device: for tests)."""
        prompts = self.row_prompt.tolist()
        lengths = self.records.lengths.tolist()
        tokens = self.records.tokens.tolist()
        return [self.prompts[p] + tokens[p][: lengths[p]] for p in prompts]

    # -- setup ------------------------------------------------------------------------
    def _new_cache(self, model: HFCausalLM, tree_width: int):
        longest = max(len(p) + n for p, n in zip(self.prompts, self.settings.max_new_tokens))
        cache = model.new_cache(len(self.prompts), longest + tree_width)
        with self.timer.phase("target" if model is self.target else "draft"):
            prefill(model, cache, self.prompts, self.device)
        return cache

    def start(self) -> None:
        """Prefill both caches with every prompt but its last token (which becomes pending). No host sync."""
        self.timer = PhaseTimer(self.device)
        budgets = self.settings.max_new_tokens
        if not self.prompts or max(budgets) == 0:
            return
        device = self.device
        self.row_prompt = torch.arange(len(self.prompts), device=device)  # [B]
        self.running = torch.tensor([n > 0 for n in budgets], device=device)  # [B]
        self.rows_running = sum(n > 0 for n in budgets)
        self.row_keys = row_keys(self.settings.seeds, device)  # [B]
        self.row_iteration = torch.zeros(len(self.prompts), dtype=torch.int64, device=device)  # [B]
        self.records.start(self.running)
        last_tokens = torch.tensor([p[-1] for p in self.prompts], dtype=torch.int64, device=device)
        self.pending = last_tokens  # [B]
        self.target_longest = max(len(p) for p in self.prompts) - 1  # host: max target cache length
        self.target_cache = self._new_cache(self.target, 1 + self.num_drafts * self.draft_length)
        if self.settings.speculative:
            draft_cache = self._new_cache(self.draft, 2 + self.num_drafts * self.draft_length)
            self.drafter = TreeDrafter(self.draft, draft_cache, self.warp, self.num_drafts, self.draft_length,
                                       last_tokens)
            self.draft_extent = (self.target_longest + 1, 1)  # host: max(lengths + pending), max pending

    def step(self) -> None:
        """One iteration for every row of the batch."""
        if self.method == AUTOREGRESSIVE:
            self._autoregressive_step()
        else:
            self._speculative_step()
        self.row_iteration += 1
        self.stats.iterations += 1
        self._sync()

    def finish(self) -> None:
        """Read the results back (one host copy) and close the timers."""
        self.tokens = self.records.read(self.stats, self._describe_error)
        self.timer.finish(self.stats)

    # -- autoregressive ---------------------------------------------------------------
    def _autoregressive_step(self) -> None:
        lengths = self.target_cache.rows.lengths  # [B]
        with self.timer.phase("target"):
            slots = lengths[:, None]  # [B, 1]
            self_only = torch.ones(1, 1, dtype=torch.bool, device=self.device)  # [1, 1]
            allowed = tree_attention(lengths, self_only, self.target_longest + 1)
            logits = self.target.forward(self.pending[:, None], slots, allowed, self.target_cache, slots)  # [B, 1, V]
        with self.timer.phase("selection"):
            errors = nonfinite_rows(logits)[:, 0].to(torch.int64) * TARGET_NONFINITE  # [B]
            probs = self.warp.probs(logits[:, 0])  # [B, V]
            uniforms = counter_uniforms(self.row_keys, self.row_iteration, 1)  # [B, 1]
            next_tokens = sample_categorical(probs, uniforms[:, 0])  # [B]
        still = self.records.record(self.row_prompt, self.running, next_tokens[:, None],
                                    torch.ones_like(next_tokens), errors)
        self.stats.verify_tokens += 1
        self.target_cache.rows.advance(still.to(torch.int64))
        self.pending = torch.where(still, next_tokens, self.pending)
        self.running = still

    # -- speculative ------------------------------------------------------------------
    def _speculative_step(self) -> None:
        uniforms = counter_uniforms(self.row_keys, self.row_iteration, self.slots.num_slots)  # [B, S]
        draft_uniforms, selection_uniforms = self.slots.split(uniforms)  # [B, L, K], [B, L+1, K+1]
        with self.timer.phase("draft"):
            tree = self.drafter.propose(draft_uniforms, self.draft_extent, self.running)
        width, row_splits = self._tree_extent(tree)
        with self.timer.phase("target"):
            logits = self._verify(tree, width)  # [B, W, V]
        with self.timer.phase("selection"):
            real = torch.arange(width, device=self.device) < tree.num_nodes[:, None]  # [B, W]
            target_nonfinite = (nonfinite_rows(logits) & real).any(1)  # [B]
            target_probs = self.warp.probs(logits)  # [B, W, V]
            selection = select_tree(tree.tokens, tree.draft_probs, target_probs, tree.node_of, selection_uniforms,
                                    method=self.method, row_splits=row_splits)
        errors = target_nonfinite.to(torch.int64) * TARGET_NONFINITE + tree.nonfinite.to(torch.int64) * DRAFT_NONFINITE
        accepted = selection.num_accepted  # [B]
        self.records.record_acceptance(self.running, accepted, tree.num_nodes)
        still = self.records.record(self.row_prompt, self.running, selection.tokens, accepted + 1, errors)
        self.stats.verify_tokens += width
        self._commit(tree, selection, still)

    def _tree_extent(self, tree) -> tuple[int, list | None]:
        """The verify width and, per draft position, the rows that may meet several alive drafts there.

        One draft is a chain of L + 1 nodes and needs no device read. With K > 1 this is the
        iteration's first host sync: the widest tree, and how many rows share a node at each depth.
        """
        if self.num_drafts == 1:
            return 1 + self.draft_length, None
        extent = torch.cat([tree.num_nodes.max()[None], tree.shared.sum(0)])  # [1 + L]
        host = extent.tolist()  # host sync 1 of 2
        return host[0], row_splits(tree.shared, host[1:])

    def _verify(self, tree, width: int) -> torch.Tensor:
        """The target forward over every row's tree, padded to `width` nodes -> logits [B, W, V]."""
        lengths = self.target_cache.rows.lengths  # [B]
        input_ids, depth, visible = verify_layout(tree, self.pending, width)  # [B, W], [B, W], [B, W, W]
        slots = lengths[:, None] + torch.arange(width, device=self.device)  # [B, W] node n at lengths + n
        allowed = tree_attention(lengths, visible, self.target_longest + width)
        return self.target.forward(input_ids, lengths[:, None] + depth, allowed, self.target_cache, slots)

    def _commit(self, tree, selection, still: torch.Tensor) -> None:
        """Both caches keep the accepted path of the chosen draft, for the rows still running."""
        length = self.draft_length
        lengths = self.target_cache.rows.lengths  # [B]
        accepted = torch.where(still, selection.num_accepted, 0)  # [B]
        next_tokens = selection.tokens.gather(1, selection.num_accepted[:, None]).squeeze(1)  # [B] correction/bonus
        chosen = selection.draft_index[:, None, None].expand(-1, 1, length + 1)  # [B, 1, L + 1]
        path_nodes = tree.node_of.gather(1, chosen)[:, 0, 1:]  # [B, L] nodes of the chosen draft's tokens
        depth = torch.arange(length, device=self.device)  # [L]
        dest = lengths[:, None] + 1 + depth  # [B, L] right after the root
        source = lengths[:, None] + path_nodes  # [B, L]
        self.target_cache.rows.keep_path(torch.where(depth < accepted[:, None], source, dest), dest)
        self.target_cache.rows.advance(torch.where(still, 1 + accepted, 0))
        self.pending = torch.where(still, next_tokens, self.pending)
        self.drafter.commit(tree, selection.draft_index, selection.num_accepted, next_tokens, still)
        self.running = still

    # -- host sync, compaction ---------------------------------------------------------
    def _sync(self) -> None:
        """The iteration's host copy: running rows and the longest cache rows; compacts if due."""
        extent = torch.stack([self.running.sum(), self.target_cache.rows.lengths.max()])  # [2]
        if self.settings.speculative:
            extent = torch.cat([extent, self.drafter.host_extent()])  # [4]
        host = extent.tolist()  # the host sync of every iteration (the only one with a single draft)
        self.rows_running, self.target_longest = host[0], host[1]
        if self.settings.speculative:
            self.draft_extent = (host[2], host[3])
        batch = self.running.shape[0]
        finished = batch - self.rows_running
        if self.rows_running and finished and finished >= self.compact_fraction * batch:
            self._compact()

    def _compact(self) -> None:
        """Drop finished rows: the running ones, in order, are copied out of every per-row tensor."""
        order = torch.argsort((~self.running).to(torch.int8), stable=True)  # running rows first
        rows = order[: self.rows_running]  # [B'] (the count is the host copy of this iteration)
        self.row_prompt, self.running = self.row_prompt[rows], self.running[rows]
        self.pending, self.row_keys = self.pending[rows], self.row_keys[rows]
        self.row_iteration = self.row_iteration[rows]
        self.target_cache.rows.select_rows(rows)
        if self.settings.speculative:
            self.drafter.select_rows(rows)
        self.stats.compactions += 1

    def _describe_error(self, prompt: int, flags: int, generated: int) -> str:
        models = [m.description for bit, m in ((TARGET_NONFINITE, self.target), (DRAFT_NONFINITE, self.draft))
                  if flags & bit]
        return (f"row {prompt}: the {' and the '.join(models)} produced non-finite logits (NaN or inf) after "
                f"{generated} generated tokens; the row stopped there")
