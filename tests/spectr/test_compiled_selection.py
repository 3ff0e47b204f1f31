"""The selection of compiled mode (`spectr.native.compiled_select_tree`): the same rule as
`spectr.sequence.select_tree`, under torch.compile(fullgraph=True), on tree inputs with shared
prefixes. Under dynamo's counting backend (graphs traced, not compiled to kernels) it gives the eager
tokens, raises on any graph break (fullgraph), and compiles one graph per rule for every row count of
two or more (rows are dynamic). The slow variants run inductor for real, every rule.

Where it compiles (`spectr.native.selection_compiles`): on CUDA; on the CPU only with SELECTION_RULE
"all" (its compile does not pay there; numbers in native.py).
"""

from __future__ import annotations

import pytest
import torch
from hf_tiny import noisy_copy, tiny_model
from torch._dynamo.testing import CompileCounter

from spectr import native
from spectr.batching import ContinuousBatcher
from spectr.rng import sample_categorical
from spectr.sequence import select_tree
from spectr.steps import StepConfig
from spectr.tree import compact_nodes, prefix_leaders

FIELDS = ("tokens", "num_tokens", "num_accepted", "draft_index", "accepted_per_position")


def tree_inputs(rows: int, num_drafts: int, draft_length: int, vocab: int = 6, seed: int = 0):
    """A tree call's inputs: drafts from p over a small vocabulary (so prefixes are shared), q per node."""
    g = torch.Generator().manual_seed(seed)
    draft_probs = torch.randn(rows, num_drafts, draft_length, vocab, generator=g).softmax(-1)
    tokens = sample_categorical(draft_probs, torch.rand(draft_probs.shape[:-1], generator=g, dtype=torch.float64))
    node_of, num_nodes = compact_nodes(prefix_leaders(tokens))
    width = int(num_nodes.max())
    node_target_probs = (torch.randn(rows, width, vocab, generator=g) * 1.5).softmax(-1)
    uniforms = torch.rand(rows, draft_length + 1, num_drafts + 1, generator=g, dtype=torch.float64)
    return tokens, draft_probs, node_target_probs, node_of, uniforms


def assert_same(method: str, num_drafts: int, draft_length: int, rows: int, seed: int) -> None:
    inputs = tree_inputs(rows, num_drafts, draft_length, seed=seed)
    want = select_tree(*inputs, method=method)
    got = native.compiled_select_tree(*inputs, method=method)
    for field in FIELDS:
        assert torch.equal(getattr(got, field), getattr(want, field)), (method, rows, field)


@pytest.fixture
def counting(monkeypatch):
    counter = CompileCounter()
    monkeypatch.setattr(native, "COMPILE_BACKEND", counter)
    monkeypatch.setattr(native, "_SELECTION", {})
    torch._dynamo.reset()
    yield counter
    torch._dynamo.reset()


@pytest.mark.parametrize("method", ["speculative", "block"])
def test_single_draft_walk_compiles_whole_and_equals_eager(counting, method):
    assert_same(method, 1, 3, rows=1, seed=0)  # one row: its own specialised graph
    assert_same(method, 1, 3, rows=3, seed=1)  # rows >= 2: one dynamic graph ...
    graphs = counting.frame_count
    assert graphs == 2
    for rows, seed in [(5, 2), (2, 3), (1, 4)]:
        assert_same(method, 1, 3, rows=rows, seed=seed)
    assert counting.frame_count == graphs, "a new graph for another row count"  # ... for every row count


@pytest.mark.parametrize("method", ["spectr", "specinfer"])
def test_k_draft_token_rule_compiles_and_equals_eager(counting, method):
    for rows, seed in [(1, 0), (3, 1), (4, 2)]:
        assert_same(method, 3, 2, rows=rows, seed=seed)
    assert counting.frame_count > 0


def test_where_the_selection_compiles(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert native.SELECTION_RULE == "auto"
    assert native.selection_compiles(cuda) and not native.selection_compiles(cpu)
    monkeypatch.setattr(native, "SELECTION_RULE", "all")
    assert native.selection_compiles(cpu)
    monkeypatch.setattr(native, "SELECTION_RULE", "none")
    assert not native.selection_compiles(cuda)
    monkeypatch.setattr(native, "SELECTION_RULE", "sometimes")
    with pytest.raises(ValueError, match="SELECTION_RULE"):
        native.selection_compiles(cpu)


def test_a_configuration_compiles_its_selection_only_after_it_ran_eagerly(counting, monkeypatch):
    """The planner's trials stay eager: a configuration's selection compiles once it has run
    SELECTION_COMPILE_AFTER iterations of the batcher (each configuration counted on its own)."""
    monkeypatch.setattr(native, "SELECTION_RULE", "all")
    monkeypatch.setattr(native, "SELECTION_COMPILE_AFTER", 3)
    target = tiny_model("llama", vocab_size=64, num_layers=1, init_std=0.2, seed=3)
    batcher = ContinuousBatcher(target, noisy_copy(target, noise_std=0.05, seed=4), batch_size=2, max_length=64,
                                method="speculative", num_drafts=1, draft_length=2, compile=True)
    batcher.admit([[1, 2, 3], [4, 5]], max_new_tokens=40, seed=0)
    for _ in range(3):
        batcher.step()
    assert not native._SELECTION  # three eager iterations
    batcher.step()
    assert [key[:2] for key in native._SELECTION] == [("tree", "speculative")]
    graphs = counting.frame_count
    batcher.step(StepConfig.of("speculative", 1, 1))  # another configuration counts from zero: eager
    assert counting.frame_count == graphs and batcher.loop.selection_runs[("speculative", 1, 1)] == 1


@pytest.mark.slow  # inductor compiles for real (~1 min in all on 2 cores)
@pytest.mark.parametrize("method,num_drafts", [("speculative", 1), ("block", 1), ("spectr", 3), ("specinfer", 2)])
def test_inductor_selection_equals_eager(monkeypatch, method, num_drafts):
    monkeypatch.setattr(native, "COMPILE_BACKEND", "inductor")
    monkeypatch.setattr(native, "_SELECTION", {})
    torch._dynamo.reset()
    for rows, seed in [(1, 0), (3, 1), (6, 2)]:
        assert_same(method, num_drafts, 3, rows=rows, seed=seed)


def test_a_replaced_rule_is_compiled_anew(counting, monkeypatch):
    """The compiled rule is keyed by the function itself: a rule replaced under the same name (a negative
    control, a patched selector) compiles again instead of running the old one."""
    from spectr import selection

    inputs = tree_inputs(2, 1, 3, seed=5)
    before = native.compiled_select_tree(*inputs, method="speculative")

    def first_draft_always(draft_tokens, alive, draft_probs, target_probs, uniforms):
        return draft_tokens[:, 0], torch.ones_like(draft_tokens[:, 0], dtype=torch.bool)

    monkeypatch.setitem(selection.TOKEN_SELECTORS, "speculative", first_draft_always)
    after = native.compiled_select_tree(*inputs, method="speculative")
    assert torch.equal(after.num_accepted, torch.full((2,), 3)) and not torch.equal(after.tokens, before.tokens)
