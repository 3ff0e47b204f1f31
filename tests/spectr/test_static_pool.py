"""The compiled path made predictable (`spectr.native`): one static KV pool per model, a known set of graphs, a
self-check that sees replays and the keys/values written, and CUDA-side faults that are not answered eagerly.

All on the CPU path, with dynamo's counting / eager backends (graphs traced and counted, not compiled to
kernels). Faults are injected from outside the engine: a replay hook that perturbs the compiled core's outputs
from each shape class's first replay on (a recorded graph that replays wrong), and a backend whose graph raises a
CUDA error. Each has its control: with the self-check off the perturbed replays change the tokens, so the equality
with eager is the self-check's doing; a plain compiler error still falls back eagerly.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hf_tiny import noisy_copy, tiny_model
from torch._dynamo.testing import CompileCounter

import spectr
import spectr.native as native
from spectr.batching import ContinuousBatcher

PROMPTS = [[3, 17, 42, 8, 1], [9], [5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", vocab_size=72, num_layers=1, init_std=0.2, seed=41)
    return target, noisy_copy(target, noise_std=0.05, seed=42)


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(native, "_CORES", native.weakref.WeakKeyDictionary())  # no pool, graph or check of before
    monkeypatch.setattr(native, "_SELECTION", {})
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def calls(seed: int):
    """Three `generate` calls' prompts and budgets: other prompt counts, lengths and budgets each time."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(5, (1, 9), 12), (6, (8, 20), 16), (7, (1, 4), 6)]  # (prompts, prompt lengths, budget)
    return [([torch.randint(1, 72, (int(n),), generator=generator).tolist()
              for n in torch.randint(lo, hi + 1, (count,), generator=generator)], budget)
            for count, (lo, hi), budget in shapes]


def test_three_calls_of_other_lengths_share_one_pool_and_compile_nothing_after_the_first(pair, monkeypatch):
    """One compiled model, three `generate` calls of other prompt lengths, counts and budgets: after the first
    call (the warm-up) no new graph is traced, and every call's caches are views of the same pool per model
    (one allocation each); the tokens are the eager path's."""
    counter = CompileCounter()
    monkeypatch.setattr(native, "COMPILE_BACKEND", counter)
    target, draft = pair
    pools, graphs, shapes = [], [], []
    for prompts, budget in calls(seed=3):
        out = spectr.generate(target, draft, prompts, method="speculative", draft_length=3, max_new_tokens=budget,
                              temperature=0.0, batch_size=4, compile=True)
        assert out.stats.compiled and out.stats.compile_fallbacks == 0
        eager = spectr.generate(target, draft, prompts, method="speculative", draft_length=3, max_new_tokens=budget,
                                temperature=0.0, batch_size=4)
        assert out.tokens == eager.tokens
        pools.append(tuple(native.model_state(m).pool for m in (target, draft)))
        graphs.append(counter.frame_count)
        shapes.append(out.stats.graph_shapes)  # the stat: the pair's concrete compiled shapes so far
    assert graphs[0] > 0 and graphs[1] == graphs[2] == graphs[0], f"graphs per call: {graphs}"
    assert 0 < shapes[0] <= shapes[1] <= shapes[2]
    assert pools[0] == pools[1] == pools[2] and None not in pools[0]
    assert [native.model_state(m).pools_allocated for m in (target, draft)] == [1, 1]


def test_a_batcher_moves_its_prefilled_rows_onto_the_pool(pair, monkeypatch):
    """Rows prefilled before the compile decision (generate fills first) are copied onto the static pool: the
    cache's buffers are views of the pool, and the tokens are the eager path's."""
    monkeypatch.setattr(native, "COMPILE_BACKEND", "eager")
    target, draft = pair
    batcher = ContinuousBatcher(target, draft, batch_size=3, max_length=30, method="speculative", draft_length=2,
                                temperature=0.0, compile=True)
    batcher.admit(PROMPTS, max_new_tokens=6)
    batcher.fill()  # prefilled into the batcher's own buffers: nothing is decided yet
    own = batcher.target_cache.rows.buffer
    rows = {row.request: row.tokens for row in batcher.finished()}
    pool = native.model_state(target).pool
    view = batcher.target_cache.rows.buffer
    assert view is not own and view.untyped_storage().data_ptr() == pool.buffers[0].untyped_storage().data_ptr()
    assert [rows[i] for i in range(3)] == spectr.generate(target, draft, PROMPTS, method="speculative",
                                                           draft_length=2, max_new_tokens=6, temperature=0.0).tokens


def test_a_reserved_pool_serves_a_longer_call_without_a_new_pool(pair, monkeypatch):
    """`reserve_pool` sizes the pool once for the configuration; without it a longer call grows the pool."""
    monkeypatch.setattr(native, "COMPILE_BACKEND", "eager")
    target = pair[0]

    def run(length):
        spectr.generate(target, None, [[1] * length, [2] * 3], method="autoregressive", max_new_tokens=4,
                        compile=True)
        return native.model_state(target).pools_allocated

    assert run(5) == 1 and run(100) == 2  # 5 + 4 fits 64 slots; 100 + 4 does not: a larger pool
    monkeypatch.setattr(native, "_CORES", native.weakref.WeakKeyDictionary())
    native.reserve_pool(target, rows=2, capacity=110)
    assert run(5) == 1 and run(100) == 1
    assert native.model_state(target).pool.capacity >= 110


def test_pool_sizes_and_the_enumerated_graph_classes():
    assert native.pool_size(3, 20) == (4, 64) and native.pool_size(4, 65) == (4, 128)
    assert native.pool_size(5, 300) == (8, 384)  # at most 1.5x the slots asked for
    assert [native.view_bucket(v, 10_000) for v in (1, 64, 65, 129, 200, 257, 1000)] == [64, 64, 128, 192, 256,
                                                                                         384, 1024]
    assert native.view_bucket(1000, 700) == 700  # never past the pool
    rows, widths, views = native.graph_classes(batch_size=16, max_new=13, capacity=1024)
    assert (rows, widths, views) == (5, 8, 8)  # {1,2,4,8,16} x {1,2,3,4,6,8,12,16} x 64 x the same


@pytest.mark.parametrize("part", [pytest.param("logits", marks=pytest.mark.slow), "keys/values"])  # 5 s each
def test_a_wrong_replay_is_caught_by_the_self_check_and_answered_eagerly(pair, monkeypatch, part):
    """A compiled core whose replays go wrong (the test-only REPLAY_HOOK: from each shape class's first replay
    on, the logits flipped, or the keys/values it writes shifted) passes its first call's check but not its
    replay's: the model falls back to eager, loudly, and the tokens are the eager path's."""
    monkeypatch.setattr(native, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(native, "REPLAY_HOOK", wrong_replay(part))
    target, draft = pair
    with pytest.warns(RuntimeWarning, match=f"self-check failed: {part} differ from eager"):
        out = greedy(target, draft, True)
    assert out.tokens == greedy(target, draft, False).tokens
    assert out.stats.compile_fallbacks >= 1


@pytest.mark.parametrize("part", [pytest.param("logits", marks=pytest.mark.slow), "keys/values"])
def test_control_without_the_self_check_a_wrong_replay_changes_the_tokens(pair, monkeypatch, part):
    monkeypatch.setattr(native, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(native, "REPLAY_HOOK", wrong_replay(part))
    monkeypatch.setattr(native, "SELF_CHECK", False)
    target, draft = pair
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback
        out = greedy(target, draft, True)
    assert out.tokens != greedy(target, draft, False).tokens
    assert out.stats.compile_fallbacks == 0


def test_a_cuda_fault_is_not_answered_eagerly(pair, monkeypatch):
    """A CUDA-side fault inside the compiled core poisons the context: `DeviceFault` reaches the caller (the job's
    actor is then sick), no eager fallback. Control: any other error of the compiled code falls back."""
    def faulting(graph, inputs):
        def run(*args):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return run

    monkeypatch.setattr(native, "COMPILE_BACKEND", faulting)
    target, draft = pair
    with pytest.raises(native.DeviceFault, match="illegal memory access"):
        greedy(target, draft, True)
    assert native.is_device_fault(RuntimeError("CUDA error: device-side assert triggered"))
    assert not native.is_device_fault(RuntimeError("injected: the compiler is broken"))
    assert not native.is_device_fault(ValueError("CUDA error in a ValueError is not a fault of the device"))
    assert native.is_device_fault(native.DeviceFault("raised by the guard"))  # callers above re-raise it


def wrong_replay(part: str):
    def hook(logits, new_kv):
        if part == "logits":
            return logits.flip(-1), new_kv
        return logits, tuple(kv + 1.0 for kv in new_kv)
    return hook


def greedy(target, draft, compile):
    return spectr.generate(target, draft, PROMPTS, method="speculative", draft_length=3, max_new_tokens=10,
                           temperature=0.0, compile=compile)


@pytest.mark.slow  # 8 s; the CPU-path pool test above stays in the default suite
def test_under_the_cuda_rules_the_shapes_of_three_calls_stay_within_the_enumerated_classes(pair, monkeypatch):
    """Under the CUDA shape rules (counted on the CPU), three calls of other lengths on one pool: no graph is traced
    after the first call, and every concrete shape the core ran with (a CUDA graph recording on a GPU) is one of
    the classes `graph_classes` enumerated for the pool up front."""
    counter = CompileCounter()
    monkeypatch.setattr(native, "COMPILE_BACKEND", counter)
    monkeypatch.setattr(native, "CUDA_SHAPE_RULES", True)
    target, draft = pair
    graphs = []
    for prompts, budget in calls(seed=5):
        out = spectr.generate(target, draft, prompts, method="spectr", num_drafts=2, draft_length=3,
                              max_new_tokens=budget, batch_size=4, seed=1, compile=True)
        assert out.stats.compile_fallbacks == 0
        graphs.append(counter.frame_count)
    assert graphs[1] == graphs[2] == graphs[0]
    for model in (target, draft):
        state = native.model_state(model)
        pool = state.pool
        rows, widths, views = native.graph_classes(4, 2 * 3 + 2, pool.capacity)
        assert state.pools_allocated == 1 and pool.graph_bound is not None
        shapes = {shape[1:] for shape in state.graph_shapes}  # (B, T, S, last only)
        assert len(shapes) <= pool.graph_bound and len(shapes) <= 2 * rows * widths * views
        assert {b for b, _, _, _ in shapes} <= {1, 2, 4}
        assert {t for _, t, _, _ in shapes} <= {native.width_bucket(t) for t in range(1, 2 * 3 + 3)}
        assert {s for _, _, s, _ in shapes} <= {native.view_bucket(v, pool.capacity) for v in range(1, pool.capacity + 1)}


def test_a_finished_generate_call_frees_the_pool_without_the_cycle_collector(pair, monkeypatch):
    """The caches hold no reference cycle (a cache's root is itself without a self-reference), so the pool is free
    for the next batcher as soon as a `generate` call returns: no `gc.collect()` per batcher."""
    monkeypatch.setattr(native, "COMPILE_BACKEND", "eager")
    target, draft = pair
    import gc

    gc.disable()
    try:
        for _ in range(2):
            greedy(target, draft, True)
            assert native.model_state(target).pool.free() and native.model_state(draft).pool.free()
    finally:
        gc.enable()
    assert native.model_state(target).pools_allocated == 1
