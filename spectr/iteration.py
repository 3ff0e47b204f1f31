"""One iteration of the loop for a set of rows: draft -> verify -> select -> commit.

Each iteration has four phases for every row it is given (`spectr.rows.RowState`: the whole
pool, or only its live rows):

1) draft   - `TreeDrafter.propose`: K drafts x L tokens as a prefix tree (spectr.tree), one
             draft forward per position, returned with the draft-model rows they were drawn from
             (after autoregressive iterations, first `TreeDrafter.catch_up`: the tokens they
             committed enter the draft cache in one forward);
2) verify  - one target forward over the tree of every row: the last committed token, then
             one token per unique tree node, after the row's cached prefix (4D mask + explicit
             position ids), padded to the widest tree of the rows;
3) select  - `spectr.sequence.select_tree` (SpecTr, SpecInfer, speculative sampling, or block
             verification, by name), on the node's own p and q (compiled mode:
             `spectr.native.compiled_select_tree`, the same rule under torch.compile, where
             `spectr.native.selection_compiles`);
4) commit  - both KV caches keep only the accepted path (`keep_path`, one gather and one
             scatter per cache), rows advance by different amounts, and `spectr.records`
             appends the emitted tokens and marks rows that finished.

`autoregressive_step` is the plain target-only iteration with the same cache, warps and
random streams (one target forward per token). The method, K and L are the `Loop`'s current
ones (`Loop.configure`), so consecutive iterations of the same rows may differ.

Rows that are not running (empty slots, finished rows) go through the same ops, masked:
their caches, pending tokens and records do not change. Host syncs: none here for
autoregressive and the single-draft methods (speculative, block: one draft is always a
chain of L + 1 nodes), one for multi-draft methods (the widest tree's node count, which sets
the verify forward's width); the caller's end-of-iteration copy is the other.

Randomness: each row's uniforms come from its counter-based stream (spectr.rng), keyed by its
seed and its own iteration count, so a row's output does not depend on the other rows.

This module does not admit, retire or order rows (`spectr.batching`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from spectr import native
from spectr.drafting import nonfinite_rows
from spectr.hf import HFCausalLM
from spectr.kv_cache import tree_attention
from spectr.native import compiled_select_tree, selection_compiles
from spectr.penalties import root_paths, tree_paths
from spectr.records import DRAFT_NONFINITE, TARGET_NONFINITE, Records
from spectr.rng import IterationSlots, counter_uniforms, sample_categorical
from spectr.rows import RowState
from spectr.sequence import row_splits, select_tree
from spectr.stats import GenerationStats, PhaseTimer
from spectr.tree import verify_layout
from spectr.warps import SamplingWarp


@dataclass
class Loop:
    """What an iteration needs besides its rows; `target_longest` / `draft_extent` are host ints
    (upper bounds of the rows' cache lengths) that size the forwards without a device read.

    method / num_drafts / draft_length are the current iteration's (`configure`), any within the
    bounds the caches and records were allocated for. `draft_lag` counts the autoregressive
    iterations since the draft cache last saw the committed tokens (host: each one commits at most
    one token per row); the next speculative iteration first catches the draft cache up."""

    target: HFCausalLM
    warp: SamplingWarp
    method: str
    num_drafts: int
    draft_length: int
    records: Records
    stats: GenerationStats
    timer: PhaseTimer
    target_longest: int = 0  # max target cache length
    draft_extent: tuple[int, int] = (0, 1)  # max(draft lengths + pending), max pending
    draft_lag: int = 0  # autoregressive iterations the draft cache has not seen
    compiled: bool = False  # compiled mode: the selection may compile too (`_selection_compiled`)
    selection_runs: dict = field(default_factory=dict)  # (method, K, L) -> speculative iterations run so far
    raw_logprobs: bool = False  # records' logprobs: the raw target log-softmax (vLLM's default), not the warped law
    selection_eager: set = field(default_factory=set)  # (method, K, L) whose compiled selection failed: eager for good
    selection_fallbacks: int = 0  # compiled selections that raised (answered eagerly; that configuration stays eager)

    def configure(self, method: str, num_drafts: int, draft_length: int) -> None:
        self.method, self.num_drafts, self.draft_length = method, num_drafts, draft_length

    @property
    def slots(self) -> IterationSlots:
        return IterationSlots(self.num_drafts, self.draft_length)


def _selection_compiled(loop: Loop, device: torch.device) -> bool:
    """Compiled mode: the selection runs compiled where `spectr.native.selection_compiles` says, for a
    configuration once it has run `SELECTION_COMPILE_AFTER` iterations of this loop eagerly: the planner's
    trials stay eager, the configuration it keeps (or a fixed method's) compiles."""
    if not (loop.compiled and selection_compiles(device)):
        return False
    key = (loop.method, loop.num_drafts, loop.draft_length)
    if key in loop.selection_eager:
        return False
    loop.selection_runs[key] = runs = loop.selection_runs.get(key, 0) + 1
    return runs > native.SELECTION_COMPILE_AFTER


def _select(loop: Loop, compiled: bool, tree, target_probs, uniforms, splits):
    """The iteration's selection: compiled where `_selection_compiled` said so, and eager (the same rule on the
    same inputs, so the same tokens) when the compiled one raises: one warning, `selection_fallbacks` += 1, and
    that configuration's selection stays eager."""
    if compiled:
        try:
            return compiled_select_tree(tree.tokens, tree.draft_probs, target_probs, tree.node_of, uniforms,
                                        method=loop.method)
        except Exception as error:  # noqa: BLE001 - any failure of the compiler or its code: eager, loudly
            if native.is_device_fault(error):  # a poisoned CUDA context: no eager answer
                raise native.DeviceFault(f"the compiled selection of {loop.method} hit a CUDA-side fault "
                                         f"({type(error).__name__}: {error})") from error
            loop.selection_eager.add((loop.method, loop.num_drafts, loop.draft_length))
            loop.selection_fallbacks += 1
            warnings.warn(f"spectr: the compiled selection of {loop.method} (K={loop.num_drafts}, "
                          f"L={loop.draft_length}) failed and runs eager from now on "
                          f"({type(error).__name__}: {error})", RuntimeWarning, stacklevel=2)
    return select_tree(tree.tokens, tree.draft_probs, target_probs, tree.node_of, uniforms, method=loop.method,
                       row_splits=splits)


def autoregressive_step(loop: Loop, rows: RowState) -> None:
    """One target forward per row, one token sampled from the warped target."""
    cache = rows.target_cache
    lengths = cache.rows.lengths  # [R]
    device = lengths.device
    with loop.timer.phase("target"):
        slots = lengths[:, None]  # [R, 1]
        self_only = torch.ones(1, 1, dtype=torch.bool, device=device)  # [1, 1]
        allowed = tree_attention(lengths, self_only, loop.target_longest + 1)
        logits = loop.target.forward(rows.pending[:, None], slots, allowed, cache, slots)  # [R, 1, V]
        features = _features(loop, rows)  # [R, 1, F] for a feature draft, else None
    with loop.timer.phase("selection"):
        errors = nonfinite_rows(logits)[:, 0].to(torch.int64) * TARGET_NONFINITE  # [R]
        paths = root_paths(logits.shape[0], device) if loop.warp.path_dependent else None
        probs = loop.warp.probs(logits[:, 0], paths)  # [R, V]
        uniforms = counter_uniforms(rows.keys, rows.iteration, 1)  # [R, 1]
        next_tokens = sample_categorical(probs, uniforms[:, 0])  # [R]
        logprobs, top = None, None
        if loop.records.logprobs is not None:  # the raw target law (log-softmax), or the law the token was drawn from
            source = logits[:, 0].float().log_softmax(-1) if loop.raw_logprobs else probs.log()  # [R, V]
            logprobs = source.gather(1, next_tokens[:, None])  # [R, 1]
            if loop.records.top:
                values, ids = source.topk(loop.records.top, dim=-1)  # [R, N] each
                top = (ids[:, None], values[:, None])  # [R, 1, N]
    still = loop.records.record(rows.slots, rows.running, next_tokens[:, None], torch.ones_like(next_tokens),
                                errors, logprobs, top)
    _count_committed(loop, rows, next_tokens[:, None])
    loop.stats.verify_tokens += 1
    cache.rows.advance(still.to(torch.int64))
    rows.pending = torch.where(still, next_tokens, rows.pending)
    rows.running = still
    rows.iteration = rows.iteration + 1
    if features is not None:  # the feature draft takes the token with the target's feature before it
        rows.drafter.observe(next_tokens, features[:, 0], still, loop.draft_extent[0])
    else:
        loop.draft_lag += 1


def speculative_step(loop: Loop, rows: RowState) -> None:
    """Draft a tree per row, verify all trees in one target forward, select, commit."""
    uniforms = counter_uniforms(rows.keys, rows.iteration, loop.slots.num_slots)  # [R, S]
    draft_uniforms, selection_uniforms = loop.slots.split(uniforms)  # [R, L, K], [R, L+1, K+1]
    with loop.timer.phase("draft"):
        if loop.draft_lag:
            _catch_up(loop, rows)
        tree = rows.drafter.propose(draft_uniforms, loop.draft_extent, rows.running)
    width, splits = _tree_extent(loop, tree)
    with loop.timer.phase("target"):
        logits = _verify(loop, rows, tree, width)  # [R, W, V]
        features = _features(loop, rows)  # [R, W, F] for a feature draft, else None
    with loop.timer.phase("selection"):
        real = torch.arange(width, device=logits.device) < tree.num_nodes[:, None]  # [R, W]
        target_nonfinite = (nonfinite_rows(logits) & real).any(1)  # [R]
        paths = tree_paths(tree.tokens, tree.node_of, width) if loop.warp.path_dependent else None
        target_probs = loop.warp.probs(logits, paths)  # [R, W, V] (penalties: each node's own path)
        selection = _select(loop, _selection_compiled(loop, logits.device), tree, target_probs, selection_uniforms,
                            splits)
        logprobs, top = None, None
        if loop.records.logprobs is not None:  # the raw law's log-softmax, or the warped law it was drawn from
            source = logits.float().log_softmax(-1) if loop.raw_logprobs else target_probs.log()  # [R, W, V]
            logprobs = _path_logprobs(tree, selection, source)  # [R, L + 1]
            if loop.records.top:
                top = _path_top(tree, selection, source, loop.records.top)  # [R, L + 1, N] ids and values
    errors = target_nonfinite.to(torch.int64) * TARGET_NONFINITE + tree.nonfinite.to(torch.int64) * DRAFT_NONFINITE
    accepted = selection.num_accepted  # [R]
    loop.records.record_acceptance(rows.slots, rows.running, accepted, tree.num_nodes, loop.draft_length)
    still = loop.records.record(rows.slots, rows.running, selection.tokens, accepted + 1, errors, logprobs, top)
    _count_committed(loop, rows, selection.tokens)
    loop.stats.verify_tokens += width
    _commit(loop, rows, tree, selection, still, features)
    rows.iteration = rows.iteration + 1


def _features(loop: Loop, rows: RowState) -> torch.Tensor | None:
    """The target's features from the forward just run, when the drafter reads them (a feature draft)."""
    if rows.drafter is None or not getattr(rows.drafter, "observes", False):
        return None
    return loop.target.tap.take()


def _path_top(tree, selection, log_probs: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` most likely tokens (ids, log-probabilities: [R, L + 1, N] each) of the law each emitted token
    followed: the node of the chosen draft's prefix of its length (as `_path_logprobs`). log_probs: [R, W, V]."""
    chosen = selection.draft_index[:, None, None].expand(-1, 1, tree.node_of.shape[2])  # [R, 1, L + 1]
    path = tree.node_of.gather(1, chosen)[:, 0]  # [R, L + 1]
    laws = log_probs.gather(1, path[:, :, None].expand(-1, -1, log_probs.shape[-1]))  # [R, L + 1, V]
    values, ids = laws.topk(count, dim=-1)  # [R, L + 1, N] each
    return ids, values


def _path_logprobs(tree, selection, target_probs: torch.Tensor) -> torch.Tensor:
    """target_probs (a law per node, or its log) of each emitted token at the node it follows on the chosen
    draft's path -> [R, L + 1].

    Token i of an iteration (accepted draft token, correction or bonus) follows the chosen draft's
    prefix of length i, whose node's warped target law q is the law it was sampled from (exactness:
    the selection reproduces q at every position). target_probs: [R, W, V].
    """
    chosen = selection.draft_index[:, None, None].expand(-1, 1, tree.node_of.shape[2])  # [R, 1, L + 1]
    path = tree.node_of.gather(1, chosen)[:, 0]  # [R, L + 1] node of the prefix of length i
    rows = torch.arange(path.shape[0], device=path.device)[:, None]  # [R, 1]
    return target_probs[rows, path, selection.tokens.clamp(min=0)]  # [R, L + 1] (padding: ignored)


def _count_committed(loop: Loop, rows: RowState, emitted: torch.Tensor) -> None:
    """Penalties: the tokens the records just kept (emitted [R, E], cut at the new lengths) join the rows'
    output counts (`spectr.penalties.RowPenalties.commit`). No host read; nothing without penalties."""
    penalties = getattr(loop.warp, "penalties", None)  # RowWarps' RowPenalties, once a row has one
    if penalties is not None:
        penalties.commit(rows.slots, emitted, loop.records.lengths[rows.slots])


def _catch_up(loop: Loop, rows: RowState) -> None:
    """The draft cache takes the tokens committed by the last `draft_lag` autoregressive iterations,
    in one draft forward (`TreeDrafter.catch_up`); sized by host bounds, no device read."""
    missing = loop.draft_lag
    drafter = rows.drafter
    records = loop.records
    out_lengths = records.lengths[rows.slots]  # [R]
    columns = (out_lengths[:, None] - missing + torch.arange(missing, device=out_lengths.device)).clamp(min=0)
    recent = records.tokens[rows.slots[:, None], columns]  # [R, M] the rows' newest generated tokens
    # committed tokens the target holds (cache + pending) minus those the draft holds
    lag = rows.target_cache.rows.lengths + 1 - drafter.cache.rows.lengths - drafter.num_pending  # [R]
    lag = torch.where(rows.running, lag, 0).clamp(0, missing)
    drafter.catch_up(recent, lag, loop.draft_extent[0] + missing)
    # afterwards a caught-up row holds lengths + 1 = its target length + 1; the others are unchanged
    loop.draft_extent = (max(loop.draft_extent[0], loop.target_longest + 1), loop.draft_extent[1])
    loop.draft_lag = 0
    loop.stats.draft_catch_ups += 1


def _tree_extent(loop: Loop, tree) -> tuple[int, list | None]:
    """The verify width and, per draft position, the rows that may meet several alive drafts there.

    One draft is a chain of L + 1 nodes and needs no device read. With K > 1 this is the
    iteration's first host sync: the widest tree, and how many rows share a node at each depth.
    """
    if loop.num_drafts == 1:
        return 1 + loop.draft_length, None
    extent = torch.cat([tree.num_nodes.max()[None], tree.shared.sum(0)])  # [1 + L]
    host = extent.tolist()  # host sync 1 of 2
    return host[0], row_splits(tree.shared, host[1:])


def _verify(loop: Loop, rows: RowState, tree, width: int) -> torch.Tensor:
    """The target forward over every row's tree, padded to `width` nodes -> logits [R, W, V]."""
    cache = rows.target_cache
    lengths = cache.rows.lengths  # [R]
    input_ids, depth, visible = verify_layout(tree, rows.pending, width)  # [R, W], [R, W], [R, W, W]
    slots = lengths[:, None] + torch.arange(width, device=lengths.device)  # [R, W] node n at lengths + n
    allowed = tree_attention(lengths, visible, loop.target_longest + width)
    return loop.target.forward(input_ids, lengths[:, None] + depth, allowed, cache, slots)


def _commit(loop: Loop, rows: RowState, tree, selection, still: torch.Tensor, features=None) -> None:
    """Both caches keep the accepted path of the chosen draft, for the rows still running (a feature draft
    instead takes the committed tokens with the target's `features` at the nodes before them)."""
    length = loop.draft_length
    cache = rows.target_cache.rows
    lengths = cache.lengths  # [R]
    accepted = torch.where(still, selection.num_accepted, 0)  # [R]
    next_tokens = selection.tokens.gather(1, selection.num_accepted[:, None]).squeeze(1)  # [R] correction/bonus
    chosen = selection.draft_index[:, None, None].expand(-1, 1, length + 1)  # [R, 1, L + 1]
    path_nodes = tree.node_of.gather(1, chosen)[:, 0, 1:]  # [R, L] nodes of the chosen draft's tokens
    depth = torch.arange(length, device=lengths.device)  # [L]
    dest = lengths[:, None] + 1 + depth  # [R, L] right after the root
    source = lengths[:, None] + path_nodes  # [R, L]
    cache.keep_path(torch.where(depth < accepted[:, None], source, dest), dest)
    cache.advance(torch.where(still, 1 + accepted, 0))
    rows.pending = torch.where(still, next_tokens, rows.pending)
    if features is None:
        rows.drafter.commit(tree, selection.draft_index, selection.num_accepted, next_tokens, still)
    else:
        rows.drafter.commit(tree, selection.draft_index, selection.num_accepted, next_tokens, still,
                            emitted=selection.tokens, features=features)
    rows.running = still
