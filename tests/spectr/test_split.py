"""A target split over several devices (`spectr.split`, `model.device_map`), run without GPUs.

No GPU runs here, so the split is made over "devices" that are all the CPU: `dispatch` with a
device_map of three entries mapped to "cpu" gives three groups of layers, so the group-boundary code
runs (the forward hooks, the native core's moves, one cache buffer per group), with no-op moves.
Checked: the split target's tokens are IDENTICAL to the unsplit one's (spectr.generate and the
ContinuousBatcher, autoregressive, speculative and SpecTr K>1, fixed seeds), the native core's
logits and cache entries too, and structurally that the cache holds one buffer per group and commits
with one gather and one scatter per group, not per layer. What runs on real GPUs (cross-device
copies, CUDA graphs over several devices) is not measured yet: the prepared GPU checks run on one GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hf_tiny import noisy_copy, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

import spectr
from spectr.batching import ContinuousBatcher
from spectr.hf import HFCausalLM
from spectr.kv_cache import RowKVCache, tree_attention
from spectr.native import NativeCausalLM
from spectr.rows import prefill
from spectr.split import dispatch, layer_groups

CPU = torch.device("cpu")
# four layers over three "devices": layer 0 | layers 1-2 | layer 3; the head back on the first (as a tied head)
PLAN = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 1,
        "model.layers.2": 1, "model.layers.3": 2, "model.norm": 2, "lm_head": 0}
ON_CPU = {0: "cpu", 1: "cpu", 2: "cpu"}


@pytest.fixture(scope="module")
def models():
    """(target, the same target split by PLAN, draft), every one on the CPU."""
    target = tiny_model(vocab_size=64, num_layers=4, init_std=0.2, seed=3, max_positions=128)
    split = dispatch(copy.deepcopy(target), PLAN, ON_CPU)
    return target, split, noisy_copy(target, noise_std=0.08, seed=4)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run under it, by name (`aten.scatter_.src` -> "scatter_")."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_layer_groups_follow_the_device_map(models, monkeypatch):
    import spectr.split as split_module

    target, split, _ = models
    moves = []
    monkeypatch.setattr(split_module, "moved", lambda tensor, device: moves.append(device) or tensor)
    with torch.inference_mode():
        split(torch.tensor([[1, 2, 3]]))
    assert len(moves) >= 3 * 2  # the hooks fire in HF's forward: hidden state, mask, cos/sin... at each boundary
    assert layer_groups(target, 4) == ((0, 4, CPU),)  # no map: one group, the single-buffer engine
    assert layer_groups(split, 4) == ((0, 1, CPU), (1, 3, CPU), (3, 4, CPU))
    assert HFCausalLM(split).groups == layer_groups(split, 4)
    hooked = [name for name, m in split.named_modules() if m._forward_pre_hooks]
    assert hooked == ["model.layers.1", "model.layers.3", "lm_head"]  # where the device changes, not per layer
    with pytest.raises(ValueError, match="does not have"):
        dispatch(copy.deepcopy(target), {**PLAN, "model.nope": 0}, ON_CPU)
    with pytest.raises(ValueError, match="without a device"):
        dispatch(copy.deepcopy(target), {k: v for k, v in PLAN.items() if k != "lm_head"}, ON_CPU)
    tied = copy.deepcopy(target)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    with pytest.raises(ValueError, match="tied weights"):
        dispatch(tied, {**PLAN, "lm_head": 2}, ON_CPU)


@torch.inference_mode()
def test_a_split_cache_holds_one_buffer_per_group_and_commits_once_per_group():
    groups = [(0, 1, CPU), (1, 3, CPU), (3, 4, CPU)]
    whole, split = RowKVCache(4, 3, 8, CPU), RowKVCache(4, 3, 8, CPU, groups)
    generator = torch.Generator().manual_seed(0)
    for cache in (whole, split):
        cache.begin_forward(torch.tensor([[0, 1, 2, 3]] * 3), 4)
    for layer in range(4):
        keys, values = torch.randn(2, 3, 2, 4, 5, generator=generator)  # [B, H, T, D] each
        for cache in (whole, split):
            cache.write(layer, keys, values)
    assert len(whole.buffers) == 1 and [b.shape[0] for b in split.buffers] == [1, 2, 1]
    assert split.nbytes == whole.nbytes
    counts = {}
    for name, cache in (("whole", whole), ("split", split)):
        cache.advance(torch.tensor([1, 1, 1]))
        with OpCounter() as counter:
            cache.keep_path(torch.tensor([[3], [2], [1]]), torch.tensor([[1], [1], [1]]))
        counts[name] = (counter.counts.get("gather", 0), counter.counts.get("scatter_", 0))
        cache.copy_rows(torch.tensor([0]), torch.tensor([2]), 4)
        cache.reset_rows(torch.tensor([1]), zero=True)
    assert counts == {"whole": (1, 1), "split": (3, 3)}  # one gather + one scatter per group, not per layer
    for layer in range(4):
        assert torch.equal(split.layer(layer), whole.layer(layer))
    assert torch.equal(split.prefix(2).layer(2), whole.prefix(2).layer(2))
    with pytest.raises(RuntimeError, match="3 groups"):
        _ = split.buffer


@pytest.mark.parametrize("method,num_drafts", [("autoregressive", 1), ("speculative", 1), ("spectr", 3)])
def test_a_split_target_generates_the_same_tokens(models, method, num_drafts):
    target, split, draft = models
    prompts = [[5, 9, 2], [7], [1, 2, 3, 4, 5, 6], [11, 12]]
    settings = dict(method=method, num_drafts=num_drafts, draft_length=3, max_new_tokens=12, seed=[1, 2, 3, 4],
                    batch_size=2, logprobs=True)
    want = spectr.generate(target, draft, prompts, **settings)
    got = spectr.generate(split, draft, prompts, **settings)
    assert got.tokens == want.tokens and got.logprobs == want.logprobs


def test_a_split_target_in_the_continuous_batcher(models):
    target, split, draft = models
    outputs = []
    for model in (target, split):
        batcher = ContinuousBatcher(model, draft, batch_size=2, method="spectr", num_drafts=2, draft_length=2)
        assert len(batcher.target_cache.rows.buffers) == (1 if model is target else 3)
        batcher.admit([[3, 4, 5], [8], [9, 9]], max_new_tokens=[6, 9, 4], seed=[7, 8, 9])
        outputs.append(sorted((row.request, row.tokens) for row in batcher.finished()))
    assert outputs[0] == outputs[1]


@torch.inference_mode()
def test_the_native_core_crosses_the_groups(models):
    """The native core (eager) over the split target: the same logits and cache entries as over the whole."""
    target, split, _ = models
    results = []
    for model in (target, split):
        lm = NativeCausalLM(model)
        cache = lm.new_cache(3, 16)
        prefill(lm, cache, [[3, 17, 42, 8], [9, 2], [7, 7, 7]], CPU, rows=torch.tensor([0, 1, 2]))  # row subset
        lengths = cache.rows.lengths.clone()  # [3]
        slots = lengths[:, None] + torch.arange(2)  # [3, 2]: two causal tokens per row
        allowed = tree_attention(lengths, torch.ones(2, 2, dtype=torch.bool).tril(), int(lengths.max()) + 2)
        logits = lm.native_forward(torch.tensor([[1, 2], [3, 4], [5, 6]]), slots, allowed, cache, slots)
        results.append((logits, [cache.rows.layer(i) for i in range(4)]))
    assert len(results[1][1]) == 4 and torch.equal(results[0][0], results[1][0])
    for want, got in zip(results[0][1], results[1][1]):
        assert torch.equal(want, got)


def test_the_boundary_hook_moves_tensors_and_leaves_other_arguments():
    from spectr.split import _mover

    meta = torch.device("meta")
    marker = object()  # e.g. the engine's cache object: passed through as is
    args, kwargs = _mover(meta)(None, (torch.ones(2), marker), {"pair": (torch.ones(1), torch.ones(1)), "n": 3})
    assert args[0].device == meta and args[1] is marker and kwargs["n"] == 3
    assert all(t.device == meta for t in kwargs["pair"])


@pytest.mark.slow  # ~30 s of dynamo tracing (two models' graphs)
def test_the_compiled_native_core_over_a_split_target(models, monkeypatch):
    """Compiled (dynamo's counting backend: graphs traced with fullgraph=True, run eagerly) over the split
    target: one graph for the group boundaries, and the same tokens as the compiled whole target."""
    from torch._dynamo.testing import CompileCounter

    import spectr.native as native

    target, split, draft = models
    monkeypatch.setattr(native, "COMPILE_BACKEND", CompileCounter())
    torch._dynamo.reset()
    try:
        outputs = [spectr.generate(model, draft, [[3, 4, 5], [8, 1]], method="spectr", num_drafts=2,
                                   draft_length=2, max_new_tokens=6, seed=[7, 8], compile=True)
                   for model in (target, split)]
    finally:
        torch._dynamo.reset()
    assert all(out.stats.compiled for out in outputs) and native.COMPILE_BACKEND.frame_count > 0
    assert outputs[0].tokens == outputs[1].tokens
