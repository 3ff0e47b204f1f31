"""The compiled path's guard (`spectr.native.NativeCausalLM.forward`, `spectr.iteration._select`), its shape rules
under CUDA graphs and its weight copies under change.

Faults are injected from outside the engine, as torch.compile backends: one whose compile raises, one whose graph
returns perturbed logits. In both, `spectr.generate(..., compile=True)` returns the eager path's greedy tokens and
counts `compile_fallbacks`; the controls show that the perturbation changes the tokens when the self-check is off,
so the equality is the guard's doing. The shape rules are counted on the CPU (`CUDA_SHAPE_RULES = True`): the
concrete (rows, new tokens, view) shapes the compiled core is called with over a job of varied trees stay within
the buckets' bound.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hf_tiny import hf_greedy, noisy_copy, tiny_model

import spectr
import spectr.native as native
from spectr.batching import ContinuousBatcher

PROMPTS = [[3, 17, 42, 8, 1], [9], [5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", vocab_size=72, num_layers=1, init_std=0.2, seed=21)
    return target, noisy_copy(target, noise_std=0.05, seed=22)


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(native, "_CORES", native.weakref.WeakKeyDictionary())  # no graph of another backend
    monkeypatch.setattr(native, "_SELECTION", {})
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def broken_compiler(graph, inputs):
    raise RuntimeError("injected: the compiler is broken")


def perturbing_compiler(graph, inputs):
    """A backend whose graph runs, then flips the vocabulary axis of its first output (the core's logits)."""
    def run(*args):
        outputs = list(graph.forward(*args))
        if outputs[0].dim() == 3:
            outputs[0] = outputs[0].flip(-1)
        return tuple(outputs)
    return run


def greedy(pair, method, compile, **kw):
    target, draft = pair
    return spectr.generate(target, draft, PROMPTS, method=method, num_drafts=2, draft_length=3, max_new_tokens=8,
                           temperature=0.0, compile=compile, **kw)


@pytest.mark.parametrize("method", ["autoregressive", "speculative"])
def test_a_compiler_that_raises_falls_back_to_eager_loudly(pair, monkeypatch, method):
    monkeypatch.setattr(native, "COMPILE_BACKEND", broken_compiler)
    with pytest.warns(RuntimeWarning, match="injected: the compiler is broken"):
        out = greedy(pair, method, True)
    assert out.tokens == [hf_greedy(pair[0], p, 8) for p in PROMPTS] == greedy(pair, method, False).tokens
    assert out.stats.compiled and out.stats.compile_fallbacks >= 1


@pytest.mark.slow  # 9 s; the compiled core's fallback tests stay in the default suite
def test_a_compiled_selection_that_raises_falls_back_and_stays_eager(pair, monkeypatch):
    """The core compiles (eager backend), the selection's compile raises: one fallback, same tokens."""
    def selection_breaks(graph, inputs):
        if any(node.op == "call_module" or "embedding" in str(node.target) for node in graph.graph.nodes):
            return graph.forward  # the core
        raise RuntimeError("injected: the selection's compiler is broken")

    monkeypatch.setattr(native, "COMPILE_BACKEND", selection_breaks)
    monkeypatch.setattr(native, "SELECTION_RULE", "all")
    monkeypatch.setattr(native, "SELECTION_COMPILE_AFTER", 0)
    with pytest.warns(RuntimeWarning, match="compiled selection of speculative"):
        out = greedy(pair, "speculative", True)
    assert out.tokens == greedy(pair, "speculative", False).tokens
    assert out.stats.compile_fallbacks == 1  # once: that configuration's selection stays eager


def test_a_compiled_core_that_disagrees_with_eager_fails_its_self_check(pair, monkeypatch):
    monkeypatch.setattr(native, "COMPILE_BACKEND", perturbing_compiler)
    with pytest.warns(RuntimeWarning, match="self-check failed: logits differ from eager by up to"):
        out = greedy(pair, "speculative", True)
    assert out.tokens == greedy(pair, "speculative", False).tokens
    assert out.stats.compile_fallbacks >= 1


def test_control_without_the_self_check_the_perturbed_core_changes_the_tokens(pair, monkeypatch):
    monkeypatch.setattr(native, "COMPILE_BACKEND", perturbing_compiler)
    monkeypatch.setattr(native, "SELF_CHECK", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no warning
        out = greedy(pair, "speculative", True)
    assert out.tokens != greedy(pair, "speculative", False).tokens
    assert out.stats.compile_fallbacks == 0


@pytest.mark.slow  # 7 s; the raise / perturb tests keep the guard in the default suite
def test_a_healthy_compiled_core_passes_its_self_check_twice_per_shape_class_and_model(pair, monkeypatch):
    """Each shape class is compared at its first call and its first replay, per model: a second `generate` call
    over the same models checks nothing again (the state lives with the model, not with the batcher)."""
    checks = []
    mismatch = native.logits_mismatch
    monkeypatch.setattr(native, "logits_mismatch", lambda a, b: checks.append(a.shape) or mismatch(a, b))
    monkeypatch.setattr(native, "COMPILE_BACKEND", "eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = greedy(pair, "speculative", True)
        first = len(checks)
        again = greedy(pair, "speculative", True)  # a class seen once so far has its first replay here
        second = len(checks)
        greedy(pair, "speculative", True)
    assert out.stats.compile_fallbacks == again.stats.compile_fallbacks == 0 and out.stats.compiled
    # shape classes on the CPU: (one row?, one new token?, last token only?) per model: a handful, not per call
    assert 1 <= first <= second <= 16  # at most 2 x (2 x 2 x 2) per model, whatever the iterations
    assert len(checks) == second  # every class had its first call and first replay: the third call checks none


@pytest.mark.parametrize("new,bucket", [(1, 1), (2, 2), (3, 3), (4, 4), (5, 6), (6, 6), (7, 8), (9, 12), (13, 16),
                                        (17, 24), (25, 32), (33, 48)])
def test_width_buckets(new, bucket):
    assert native.width_bucket(new) == bucket


@pytest.mark.slow  # 16 s: two compiled jobs traced
def test_cuda_shape_rules_bound_the_shapes_of_a_job_with_varied_trees(pair, monkeypatch):
    """Under the CUDA rules (rows to powers of 2, new tokens to `width_bucket`, the view to CUDA_VIEW_BUCKET) a job
    of spectr trees whose width varies per iteration calls the compiled core with at most |rows| x |widths| x
    |views| shapes; its raw widths are more than its padded ones, and the tokens are the unpadded run's."""
    monkeypatch.setattr(native, "COMPILE_BACKEND", "eager")
    target, draft = pair
    prompts = [[(7 * i + j) % 70 + 1 for j in range(1 + i % 5)] for i in range(12)]

    def run(rules):
        monkeypatch.setattr(native, "CUDA_SHAPE_RULES", rules)
        batcher = ContinuousBatcher(target, draft, batch_size=4, max_length=40, method="spectr", num_drafts=3,
                                    draft_length=3, top_k=3, compile=True)  # top-k: drafts often share prefixes
        batcher.admit(prompts, max_new_tokens=[6 + i % 7 for i in range(12)], seed=5)
        rows = sorted(batcher.finished(), key=lambda row: row.request)
        return [row.tokens for row in rows], batcher

    padded_tokens, padded = run(True)
    raw_tokens, raw = run(False)
    assert padded_tokens == raw_tokens
    assert padded.stats.compile_fallbacks == raw.stats.compile_fallbacks == 0
    shapes = padded.target.shapes | padded.draft.shapes
    widths = {t for _, t, _ in shapes}
    assert widths <= {native.width_bucket(t) for t in range(1, 1 + 3 * 3 + 1 + 40)}
    assert {b for b, _, _ in shapes} <= {1, 2, 4}
    capacities = {padded.target_cache.rows.capacity, padded.rows.drafter.cache.rows.capacity}
    assert all(s % native.CUDA_VIEW_BUCKET == 0 or s in capacities for _, _, s in shapes)
    raw_widths = {t for _, t, _ in raw.target.shapes}
    assert len(raw_widths) > len({t for _, t, _ in padded.target.shapes})  # the padding merged widths
    views = {s for _, _, s in shapes}
    assert len(shapes) <= 3 * len(widths) * len(views)


def test_a_weight_changed_in_place_is_used_by_the_next_compiled_run(monkeypatch):
    """The kmajor copies (and any graph built on them) follow an in-place change of a target weight between two
    generate calls: the second call samples the new law (its greedy tokens are the changed model's), not the old."""
    monkeypatch.setattr(native, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(native, "LINEAR_LAYOUT", "kmajor")
    target = tiny_model("llama", vocab_size=72, num_layers=1, init_std=0.2, seed=31)
    before = spectr.generate(target, None, PROMPTS, method="autoregressive", max_new_tokens=6, temperature=0.0,
                             compile=True)
    assert before.tokens == [hf_greedy(target, p, 6) for p in PROMPTS]
    with torch.no_grad():
        target.lm_head.weight.copy_(torch.roll(target.lm_head.weight, 1, 0))  # the same law, tokens shifted by one
    after = spectr.generate(target, None, PROMPTS, method="autoregressive", max_new_tokens=6, temperature=0.0,
                            compile=True)
    assert after.tokens == [hf_greedy(target, p, 6) for p in PROMPTS] != before.tokens
    assert after.stats.compile_fallbacks == 0  # rebuilt, not caught by the self-check


@pytest.mark.slow  # 11 s: a compiled auto batcher
def test_the_chooser_never_takes_an_iteration_that_compiled_as_a_sample(pair, monkeypatch):
    """method=auto, compiled: an iteration during which the compile timer moved reports measure=False to the
    chooser (its seconds are the compiler's, not its configuration's); the others are samples as before."""
    from spectr.planner.batcher import AutoBatcher

    monkeypatch.setattr(native, "COMPILE_BACKEND", "eager")
    target, draft = pair
    auto = AutoBatcher(target, draft, batch_size=2, max_length=40, max_num_drafts=2, max_draft_length=3,
                       compile=True)
    seen = []
    observe = auto.chooser.observe

    def spy(report, measure=True):
        seen.append((measure, native.compile_seconds_so_far()))
        observe(report, measure=measure)

    monkeypatch.setattr(auto.chooser, "observe", spy)
    auto.admit([[3, 4, 5], [9, 8], [1, 2, 3, 4], [7]], max_new_tokens=12, seed=3)
    before = native.compile_seconds_so_far()
    compiled_during = []
    for _ in auto.finished():
        pass
    for (measure, after), previous in zip(seen, [before] + [s for _, s in seen[:-1]]):
        compiled_during.append((after != previous, measure))
    assert any(moved for moved, _ in compiled_during)  # some iterations compiled...
    assert not any(moved and measure for moved, measure in compiled_during)  # ...none of them is a sample
    assert any(measure for _, measure in compiled_during)


@pytest.mark.slow  # 11 s: four compiled batchers
def test_under_the_cuda_rules_a_new_batcher_takes_the_models_static_pool_once_the_old_one_is_gone(pair, monkeypatch):
    """The static-address pool is allocated once per shape, not per `generate` call: a second batcher of the same
    shape reads the same buffers (zeroed) when the first is gone, and new ones while the first still holds them."""
    monkeypatch.setattr(native, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(native, "CUDA_SHAPE_RULES", True)
    target, draft = pair

    def batcher():
        b = ContinuousBatcher(target, draft, batch_size=2, max_length=30, method="speculative", draft_length=2,
                              compile=True)
        b.admit([[3, 4, 5], [9, 8]], max_new_tokens=4, seed=1)
        tokens = [row.tokens for row in sorted(b.finished(), key=lambda row: row.request)]
        return b, tokens

    first, tokens = batcher()
    address = first.target_cache.rows.buffer.data_ptr()
    second, again = batcher()  # the first still alive: its pool is not shared
    pooled = second.target_cache.rows.buffer.data_ptr()
    assert pooled != address  # the pool is now the second's
    assert again == tokens
    del first, second
    third, once_more = batcher()
    assert third.target_cache.rows.buffer.data_ptr() == pooled  # views of the same pool
    assert once_more == tokens
    del third
    fourth, _ = batcher()
    assert fourth.target_cache.rows.buffer.data_ptr() == pooled
