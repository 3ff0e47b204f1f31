"""The native Llama/Qwen2 forward (`spectr.native`) against the HF path, and the compiled engine's graphs.

Equality: the same sequence of forwards (prefill of a row subset, a decode step, a tree verify, a
catch-up with `last_only`, a draft step writing between stale slots) through `HFCausalLM.forward`
and through `NativeCausalLM.native_forward` on two caches: logits and every cache entry agree
within float tolerance, for Llama and Qwen2 with grouped-query attention (and without).

Graphs: with `COMPILE_BACKEND` set to dynamo's counting backend (graphs are traced and counted,
not compiled to kernels: a test of shapes and breaks, fast on any CPU), a warm-up run and then a
second run with other ragged prompt lengths, rows admitted mid-run and EOS compile no new graph,
with `fullgraph=True` (a graph break would raise); the selection's graphs
(`spectr.native.compiled_select_tree`, forced on as on CUDA) included.
"""

from __future__ import annotations

import threading

import pytest
import torch
from hf_tiny import hf_greedy, noisy_copy, tiny_model
from torch._dynamo.testing import CompileCounter

import spectr
import spectr.native as native
from spectr.batching import ContinuousBatcher
from spectr.hf import HFCausalLM
from spectr.kv_cache import tree_attention
from spectr.native import NativeCausalLM, native_supported
from spectr.rows import prefill


@pytest.fixture(scope="module")
def counter():
    """Compiled cores trace through a CompileCounter (counts graphs) instead of inductor; the module's tests
    share it (and the graphs: the compiled core is kept per model)."""
    with pytest.MonkeyPatch.context() as patch:
        counting = CompileCounter()
        patch.setattr(native, "COMPILE_BACKEND", counting)
        torch._dynamo.reset()
        yield counting
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def greedy_pair():
    target = tiny_model("llama", vocab_size=64, num_layers=1, init_std=0.2, seed=3)
    return target, noisy_copy(target, noise_std=0.05, seed=4)


def _forwards(lm, forward, cache):
    """The engine's kinds of forwards on a 3-row cache; returns their logits."""
    out = []
    rows = torch.tensor([0, 2])
    prefill(lm, cache, [[3, 17, 42, 8, 1], [9, 2, 5]], torch.device("cpu"), rows=rows)  # eager: a RowView
    prefill(lm, cache.view(torch.tensor([1])), [[7, 7, 7, 7, 7, 7, 7]], torch.device("cpu"))
    lengths = cache.rows.lengths.clone()  # [3]
    # decode: one token per row
    slots = lengths[:, None]
    allowed = tree_attention(lengths, torch.ones(1, 1, dtype=torch.bool), int(lengths.max()) + 1)
    out.append(forward(torch.tensor([[1], [5], [9]]), slots, allowed, cache, slots))
    cache.rows.advance(torch.ones(3, dtype=torch.int64))
    lengths = cache.rows.lengths.clone()
    # tree verify: root + 2 branches of 2 tokens, per-row visibility
    visible = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 0, 1, 1]],
                           dtype=torch.bool)
    slots = lengths[:, None] + torch.arange(5)
    depth = torch.tensor([0, 1, 2, 1, 2])
    allowed = tree_attention(lengths, visible, int(lengths.max()) + 5)
    tokens = torch.tensor([[4, 5, 6, 7, 8], [1, 2, 3, 4, 5], [60, 61, 62, 63, 0]])
    out.append(forward(tokens, lengths[:, None] + depth, allowed, cache, slots))
    # a draft step: K=2 tokens at interleaved slots after 2 stale ones, attending their own paths
    base = lengths + 1
    slots = base[:, None] + 2 + torch.arange(2)
    allowed = tree_attention(base, torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool),
                             int(base.max()) + 4)
    out.append(forward(torch.tensor([[9, 8], [7, 6], [5, 4]]), base[:, None].expand(3, 2) + 1, allowed, cache, slots))
    # catch-up: 3 causal tokens, last only
    slots = lengths[:, None] + torch.arange(3)
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    allowed = tree_attention(lengths, causal, int(lengths.max()) + 3)
    out.append(forward(torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]]), slots, allowed, cache, slots,
                       last_only=True))
    return out


@pytest.mark.parametrize("layout", ["module", "kmajor", "kmajor_mkl"])
@pytest.mark.parametrize("arch,kv_heads", [("llama", 2), ("qwen2", 2), ("llama", 4), ("qwen2", 1)])
@torch.inference_mode()
def test_native_forward_equals_the_hf_path(arch, kv_heads, layout, monkeypatch):
    """layout: the HF modules' weights; "kmajor" (fused [K, N] copies, oneDNN's packed copy over 2..32 rows:
    every forward here has 3 to 15 rows); "kmajor_mkl" (no oneDNN: `x @ w` and, with Qwen2's q|k|v bias, addmm)."""
    model = tiny_model(arch, vocab_size=64, num_heads=4, num_kv_heads=kv_heads, init_std=0.2, seed=5)
    assert native_supported(model) is None
    hf = HFCausalLM(model)
    lm = NativeCausalLM(model)
    if layout != "module":
        if layout == "kmajor_mkl":
            monkeypatch.setattr(native, "ONEDNN_MAX_ROWS", 0)
        lm.core.pack()
        assert lm.core.packed is not None
    hf_cache, native_cache = hf.new_cache(3, 32), lm.new_cache(3, 32)
    expected = _forwards(hf, hf.forward, hf_cache)
    got = _forwards(lm, lm.native_forward, native_cache)
    for want, have in zip(expected, got):
        assert have.shape == want.shape
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(native_cache.rows.buffer, hf_cache.rows.buffer, rtol=1e-4, atol=1e-5)
    assert torch.equal(native_cache.rows.lengths, hf_cache.rows.lengths)


@torch.inference_mode()
def test_a_wrong_kmajor_packing_is_caught():
    """Negative control of the layout test above: the same forwards with gate and up swapped in the fused
    copy differ from the HF path (so the equality there is not vacuous)."""
    model = tiny_model("llama", vocab_size=64, num_heads=4, num_kv_heads=2, init_std=0.2, seed=5)
    hf, lm = HFCausalLM(model), NativeCausalLM(model)
    lm.core.pack()
    layers, head = lm.core.packed
    swapped = []
    for qkv, out, (gate_up, bias, _), down in layers:
        gate, up = gate_up.chunk(2, -1)
        wrong = torch.cat([up, gate], -1).contiguous()
        swapped.append((qkv, out, (wrong, bias, torch.ops.mkldnn._reorder_linear_weight(wrong.t().contiguous(), None)),
                        down))
    lm.core.packed = (tuple(swapped), head)
    expected = _forwards(hf, hf.forward, hf.new_cache(3, 32))
    got = _forwards(lm, lm.native_forward, lm.new_cache(3, 32))
    assert not torch.allclose(got[0], expected[0], rtol=1e-4, atol=1e-5)


def test_linear_layout_per_device(monkeypatch, greedy_pair):
    """auto: kmajor on the CPU (packed when the core compiles), the modules on CUDA; "module" drops the copies;
    an unknown layout is refused; only float32 gets oneDNN's copy."""
    monkeypatch.setattr(native, "COMPILE_BACKEND", CompileCounter())
    assert native.linear_layout(torch.device("cpu")) == "kmajor"
    assert native.linear_layout(torch.device("cuda")) == "module"
    model = tiny_model("llama", vocab_size=64, seed=11)
    lm = NativeCausalLM(model)
    assert lm.core.packed is None  # eager: no copies
    lm.set_compiled(True)
    assert lm.core.packed is not None and lm._compiled_core[3]
    assert all(weight.is_contiguous() for layer in lm.core.packed[0] for weight, _, _ in layer)
    monkeypatch.setattr(native, "LINEAR_LAYOUT", "module")
    lm.set_compiled(True)
    assert lm.core.packed is None and not lm._compiled_core[3]
    monkeypatch.setattr(native, "LINEAR_LAYOUT", "rowmajor")
    with pytest.raises(ValueError, match="LINEAR_LAYOUT"):
        lm.set_compiled(True)
    assert native.onednn_packs(torch.ones(2, 2)) == torch.backends.mkldnn.is_available()
    assert not native.onednn_packs(torch.ones(2, 2, dtype=torch.bfloat16))


@pytest.mark.parametrize("batch,new,onednn_calls", [(1, 1, 0), (1, 5, 5), (3, 1, 5), (3, 17, 0)])
@torch.inference_mode()
def test_compiled_core_multiplies_by_onednn_over_2_to_32_rows(batch, new, onednn_calls):
    """Structural count: the compiled core's graph calls oneDNN's packed linear once per fused product (q|k|v,
    o, gate|up, down per layer, and the head: 4 x 1 + 1) when the batch brings 2..32 rows, and none for one row
    or more than 32 (MKL over the kmajor copy there)."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    graphs = EagerAndRecordGraphs()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "COMPILE_BACKEND", graphs)
        model = tiny_model("llama", vocab_size=64, num_layers=1, num_heads=4, num_kv_heads=2, seed=12)
        lm = NativeCausalLM(model, compiled=True)
        cache = lm.new_cache(batch, 40)
        prefill(lm, cache, [[3, 4, 5]] * batch, torch.device("cpu"), rows=torch.arange(batch))  # eager
        lengths = cache.rows.lengths
        slots = lengths[:, None] + torch.arange(new)
        causal = torch.ones(new, new, dtype=torch.bool).tril()
        allowed = tree_attention(lengths, causal, int(lengths.max()) + new)
        ids = torch.full((batch, new), 7)
        torch.testing.assert_close(lm.forward(ids, slots, allowed, cache, slots),
                                   HFCausalLM(model).forward(ids, slots, allowed, _hf_copy(lm, cache), slots),
                                   rtol=1e-4, atol=1e-5)
    assert len(graphs.graphs) == 1
    calls = [node for node in graphs.graphs[0].graph.nodes
             if node.target in (torch.ops.spectr.onednn_linear, torch.ops.spectr.onednn_linear.default)]
    assert len(calls) == onednn_calls


def _hf_copy(lm, cache):
    """A cache for the HF path holding the same prefix as `cache` (built by the same prefill)."""
    hf = HFCausalLM(lm.model)
    copy = hf.new_cache(cache.rows.lengths.shape[0], 40)
    prefill(hf, copy, [[3, 4, 5]] * cache.rows.lengths.shape[0], torch.device("cpu"))
    return copy


@pytest.mark.slow  # 18 s: FlexAttention traced on the CPU (refused under inductor here; a CUDA feature)
@pytest.mark.parametrize("kv_heads", [2, 4])
@torch.inference_mode()
def test_flex_attention_core_equals_the_hf_path(counter, monkeypatch, kv_heads):
    """The compiled core with FlexAttention (`native.ATTENTION = "flex"`: the tree pattern as a block mask)
    traces whole (fullgraph) and computes the HF path's logits and cache writes; an unknown attention is refused."""
    monkeypatch.setattr(native, "ATTENTION", "flex")
    model = tiny_model("llama", vocab_size=64, num_heads=4, num_kv_heads=kv_heads, init_std=0.2, seed=7)
    hf, lm = HFCausalLM(model), NativeCausalLM(model, compiled=True)
    assert lm._compiled_core[2] == "flex"
    graphs = counter.frame_count
    hf_cache, native_cache = hf.new_cache(3, 32), lm.new_cache(3, 32)
    expected = _forwards(hf, hf.forward, hf_cache)
    got = _forwards(lm, lm.forward, native_cache)
    assert counter.frame_count > graphs  # the compiled (flex) core ran, not the eager one
    for want, have in zip(expected, got):
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(native_cache.rows.buffer, hf_cache.rows.buffer, rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(native, "ATTENTION", "sparse")
    with pytest.raises(ValueError, match="ATTENTION"):
        lm.set_compiled(True)


def test_other_architectures_are_not_native():
    assert "gpt_neox" in native_supported(tiny_model("gpt_neox"))
    with pytest.raises(ValueError, match="native"):
        NativeCausalLM(tiny_model("gpt_neox"))


@pytest.mark.parametrize("method", ["autoregressive", "speculative", pytest.param("spectr", marks=pytest.mark.slow)])
def test_compiled_greedy_equals_hugging_face_greedy(counter, greedy_pair, method):
    target, draft = greedy_pair
    prompts = [[3, 17, 42, 8, 1], [9], [5, 6, 7, 8, 9, 10, 11]]
    out = spectr.generate(target, draft, prompts, method=method, num_drafts=2, draft_length=3, max_new_tokens=8,
                          temperature=0.0, compile=True)
    assert out.stats.compiled and counter.frame_count > 0
    assert out.tokens == [hf_greedy(target, p, 8) for p in prompts]


def test_compile_seconds_are_reported(counter):
    """stats.compile_seconds: 0 eager; the seconds dynamo spent on new graphs; 0 when they are reused."""
    target = tiny_model("llama", vocab_size=88, num_layers=1, init_std=0.2, seed=11)  # shapes no other test uses:
    draft = noisy_copy(target, noise_std=0.05, seed=12)  # graphs are shared by models of the same shapes
    prompts = [[3, 17, 42], [9, 8]]

    def stats(compile):
        return spectr.generate(target, draft, prompts, method="speculative", draft_length=2, max_new_tokens=5,
                               seed=[0, 1], compile=compile).stats

    assert stats(False).compile_seconds == 0.0
    first = stats(True)
    assert first.compiled and first.compile_seconds > 0
    assert stats(True).compile_seconds == 0.0  # same shapes: every graph reused


def test_the_recompile_limit_holds_in_any_thread(greedy_pair, monkeypatch):
    """torch's config values are per thread: a compiled engine driven from a thread that did not build it (a
    job's actor generates in a thread of its own) still compiles under `RECOMPILE_LIMIT`, not dynamo's 8, so
    a core's 9th graph does not fail. Recorded at every graph the backend receives, the core's and the
    selection's; the control is the fresh thread's own limit, dynamo's default, before any compiled call."""
    monkeypatch.setattr(native, "SELECTION_RULE", "all")
    monkeypatch.setattr(native, "SELECTION_COMPILE_AFTER", 0)
    seen, before = [], []

    def backend(graph, inputs):
        seen.append(torch._dynamo.config.recompile_limit)
        return graph.forward

    monkeypatch.setattr(native, "COMPILE_BACKEND", backend)
    target, draft = greedy_pair
    batcher = ContinuousBatcher(target, draft, batch_size=2, max_length=24, method="speculative", draft_length=2,
                                compile=True)
    failures = []

    def generate():
        before.append(torch._dynamo.config.recompile_limit)
        try:
            batcher.admit([[1, 2, 3], [4, 5]], max_new_tokens=[6, 4], seed=0)
            list(batcher.finished())
        except Exception as error:  # re-raised below, in the test's thread
            failures.append(error)
        before.append(torch._dynamo.config.recompile_limit)

    thread = threading.Thread(target=generate)
    thread.start()
    thread.join()
    assert not failures, failures
    assert before == [8, 8] and native.RECOMPILE_LIMIT > 8  # the thread's own limit, before and after...
    assert seen and min(seen) >= native.RECOMPILE_LIMIT  # ...but every graph compiles under the raised one


def _run(batcher, prompts, budgets, seed):
    batcher.admit(prompts[:2], max_new_tokens=budgets[:2], seed=seed)
    rows = list(batcher.step())
    batcher.admit(prompts[2:], max_new_tokens=budgets[2:], seed=seed + 10)  # admitted mid-run
    rows += list(batcher.finished())
    return rows


@pytest.mark.parametrize("method,k", [("autoregressive", 1), ("speculative", 1),
                                      pytest.param("spectr", 3, marks=pytest.mark.slow)])
def test_no_new_graph_after_warm_up(counter, greedy_pair, method, k, monkeypatch):
    """Ragged prompts, admissions mid-run, EOS and the tail (rows finishing one by one): after a warm-up
    run, a second run with other prompt lengths and budgets compiles nothing new, the selection's graphs
    included (SELECTION_RULE "all": compiled as on CUDA)."""
    monkeypatch.setattr(native, "SELECTION_RULE", "all")
    monkeypatch.setattr(native, "SELECTION_COMPILE_AFTER", 0)
    target, draft = greedy_pair
    batcher = ContinuousBatcher(target, draft, batch_size=4, max_length=40, method=method, num_drafts=k,
                                draft_length=3, eos_token_id=list(range(0, 64, 3)), compile=True)
    warm = _run(batcher, [[1, 2, 3], [4] * 9, [6, 7], [8, 9, 10, 11], [12] * 6], [12, 6, 9, 3, 14], seed=0)
    graphs = counter.frame_count
    assert batcher.stats.compiled and any(r.finish_reason == "eos" for r in warm)
    again = _run(batcher, [[2] * 11, [3, 4], [9] * 5, [1], [7, 8, 9], [10] * 13, [11]], [9, 15, 4, 11, 7, 5, 10],
                 seed=100)
    assert len(again) == 7
    assert counter.frame_count == graphs, f"{counter.frame_count - graphs} new graphs after warm-up"
    # the single-draft walk's selection is compiled too
    compiled = {key[:2] for key in native._SELECTION if key[-1] is counter}
    assert (("tree", method) in compiled) == (method == "speculative")


def test_compile_options_per_device_and_variant(monkeypatch):
    """CUDA: CUDA graphs; the CPU: inductor's options of the variant (CPU_VARIANT by default: plain inductor);
    a counting backend takes none; an unknown variant is refused by name."""
    monkeypatch.setattr(native, "COMPILE_BACKEND", "inductor")
    assert native.compile_options(True, native.CPU_VARIANT) == {"mode": "reduce-overhead"}
    assert native.compile_options(False, "plain") == {}
    assert native.compile_options(False, "frozen_cpp")["options"]["max_autotune_gemm_backends"] == "CPP,ATEN"
    assert native.CPU_VARIANT in native.CPU_VARIANTS and native.compile_options(False, native.CPU_VARIANT) == {}
    monkeypatch.setattr(native, "COMPILE_BACKEND", CompileCounter())
    assert native.compile_options(False, "frozen") == {}
    with pytest.raises(ValueError, match="variant"):
        NativeCausalLM(tiny_model("llama", vocab_size=64), compiled=True).set_compiled(True, "thawed")


@pytest.mark.slow  # inductor compiles (tens of seconds on 2 busy cores)
@pytest.mark.parametrize("variant", sorted(native.CPU_VARIANTS))
@torch.inference_mode()
def test_inductor_variant_equals_the_hf_path(monkeypatch, variant):
    """Every CPU variant (frozen weights, CPP GEMM template) computes the same forwards and cache writes
    as the HF path: decode, tree verify, interleaved draft step, last-only catch-up over dynamic shapes."""
    monkeypatch.setattr(native, "COMPILE_BACKEND", "inductor")
    model = tiny_model("llama", vocab_size=64, num_heads=4, num_kv_heads=2, init_std=0.2, seed=6)
    hf = HFCausalLM(model)
    lm = NativeCausalLM(model)
    lm.set_compiled(True, variant)
    hf_cache, native_cache = hf.new_cache(3, 32), lm.new_cache(3, 32)
    expected = _forwards(hf, hf.forward, hf_cache)
    got = _forwards(lm, lm.forward, native_cache)
    for want, have in zip(expected, got):
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(native_cache.rows.buffer, hf_cache.rows.buffer, rtol=1e-4, atol=1e-5)


def test_inductor_refuses_flex_attention_on_the_cpu(monkeypatch):
    """Inductor's CPU FlexAttention template fails to compile under the core's dynamic shapes (torch 2.13), so
    compiled mode refuses it there with the reason, before any compile."""
    monkeypatch.setattr(native, "COMPILE_BACKEND", "inductor")
    monkeypatch.setattr(native, "ATTENTION", "flex")
    lm = NativeCausalLM(tiny_model("llama", vocab_size=64, num_heads=4, num_kv_heads=2, seed=8))
    with pytest.raises(ValueError, match="CUDA only"):
        lm.set_compiled(True)
    lm.set_compiled(False)  # eager is fine (it always runs the masked attention)


def test_a_refused_compile_leaves_the_batcher_undecided(monkeypatch):
    """A compile the models refuse (flex attention under inductor on the CPU) raises at the first step and
    leaves nothing half set: the models stay eager, the batcher undecided, its statistics readable."""
    monkeypatch.setattr(native, "COMPILE_BACKEND", "inductor")
    monkeypatch.setattr(native, "ATTENTION", "flex")
    target = tiny_model("llama", vocab_size=64, num_layers=1, seed=9)
    batcher = ContinuousBatcher(target, None, batch_size=2, max_length=32, method="autoregressive", compile=True)
    batcher.admit([[1, 2, 3]], max_new_tokens=4)
    with pytest.raises(ValueError, match="CUDA only"):
        batcher.step()
    assert batcher.compiled is None and not batcher.target.compiled
    assert batcher.snapshot().compile_seconds == 0.0


@pytest.mark.parametrize("attention", ["sdpa", "masked"])
@torch.inference_mode()
def test_prefill_attends_through_sdpa_and_equals_the_hf_path(monkeypatch, attention):
    """Prefill (a row subset, eager) attends through scaled_dot_product_attention with the pattern as a mask, one
    call per layer, not a materialised [B, H, T, S] score matrix; its logits and cache entries are HF's. The
    control ("masked", the old form) makes no such call."""
    monkeypatch.setattr(native, "PREFILL_ATTENTION", attention)
    model = tiny_model("qwen2", vocab_size=64, num_layers=2, init_std=0.2, seed=5, num_kv_heads=2)
    native_lm, hf_lm = NativeCausalLM(model), HFCausalLM(model)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    prompts, rows = [[3, 17, 42, 8, 1, 9, 9], [9, 2, 5]], torch.tensor([2, 0])
    caches = []
    for lm, forward in ((native_lm, native_lm.native_forward), (hf_lm, hf_lm.forward)):
        cache = lm.new_cache(3, 16)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                            lambda *a, native_call=lm is native_lm, **k: calls.append(native_call) or sdpa(*a, **k))
        monkeypatch.setattr(lm, "forward", forward)
        prefill(lm, cache, prompts, torch.device("cpu"), rows=rows)
        caches.append(cache)
    assert calls.count(True) == (2 if attention == "sdpa" else 0)  # one per layer of the native core
    for layer in range(2):
        for row in (0, 2):
            for ours, theirs in zip(caches[0].rows.committed(layer, row), caches[1].rows.committed(layer, row)):
                torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
