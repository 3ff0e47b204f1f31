"""Traversal verification (`spectr.traversal`): exactness by enumeration (V = 3-4, K = 2-3, L = 2-3), its
negative control (children by token id), K = 1 equal to block verification in law and token for token,
and the batched rule equal to the slow reference under the same uniforms, tensor for tensor, on the
per-draft layout, on the engine's compact tree layout and on float32 engine-like inputs with zeros."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from traversal_controls import lexicographic_order, token_order

import spectr.native as native
from spectr.reference import (
    block_output_distribution,
    reference_traversal_sequence,
    traversal_output_distribution,
)
from spectr.sequence import SEQUENCE_RULES, select_sequences, select_tree, sequence_methods
from spectr.traversal import post_order, select_traversal
from spectr.tree import compact_nodes, prefix_leaders

EXACT_SHAPES = [(3, 2, 2), (3, 3, 2), (3, 2, 3), (3, 3, 3), (4, 2, 2), (4, 3, 2), (4, 2, 3)]  # (V, K, L)


def iteration_law(pair, vocab, num_drafts, draft_length, child_order="draft"):
    """{produced tokens: probability} of one call, summed over every set of K i.i.d. drafts from p."""
    singles = [d for d in itertools.product(range(vocab), repeat=draft_length) if pair.sequence_probability(d, "p") > 0]
    weight = {d: pair.sequence_probability(d, "p") for d in singles}
    law: dict[tuple[int, ...], float] = {}
    for drafts in itertools.product(singles, repeat=num_drafts):
        chance = math.prod(weight[d] for d in drafts)
        draft_probs, target_probs = pair.draft_inputs([list(d) for d in drafts])
        for produced, mass in traversal_output_distribution(drafts, draft_probs, target_probs, child_order).items():
            law[produced] = law.get(produced, 0.0) + chance * mass
    return law


def max_error_to_target(pair, vocab, law, total_length):
    """Continue each produced sequence with exact target sampling to total_length tokens; max |law - q|."""
    completed: dict[tuple[int, ...], float] = {}
    for produced, mass in law.items():
        for tail in itertools.product(range(vocab), repeat=total_length - len(produced)):
            full = produced + tail
            tail_mass = math.prod(pair.q(full[:i])[full[i]] for i in range(len(produced), total_length))
            completed[full] = completed.get(full, 0.0) + mass * tail_mass
    return max(abs(completed.get(w, 0.0) - pair.sequence_probability(w, "q"))
               for w in itertools.product(range(vocab), repeat=total_length))


@pytest.mark.parametrize(("vocab", "num_drafts", "draft_length"), EXACT_SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_traversal_law_equals_target_exactly(toy_pair_factory, vocab, num_drafts, draft_length, seed):
    pair = toy_pair_factory(vocab, draft_length, seed)
    law = iteration_law(pair, vocab, num_drafts, draft_length)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    assert all(1 <= len(s) <= draft_length + 1 for s in law)
    assert max_error_to_target(pair, vocab, law, draft_length + 1) < 1e-12


@pytest.mark.slow
def test_traversal_law_equals_target_exactly_v4_k3_l3(toy_pair_factory):
    pair = toy_pair_factory(4, 3, 0)
    assert max_error_to_target(pair, 4, iteration_law(pair, 4, 3, 3), 4) < 1e-12


@pytest.mark.parametrize(("vocab", "num_drafts", "draft_length"), [(3, 2, 2), (3, 3, 2), (4, 2, 3)])
def test_enumeration_rejects_children_in_token_order(toy_pair_factory, vocab, num_drafts, draft_length):
    pair = toy_pair_factory(vocab, draft_length, 0)
    law = iteration_law(pair, vocab, num_drafts, draft_length, child_order="token")
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)  # a law, just not the target's
    assert max_error_to_target(pair, vocab, law, draft_length + 1) > 1e-2


@pytest.mark.parametrize("draft_length", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_draft_is_block_verification_in_law(toy_pair_factory, draft_length, seed):
    pair = toy_pair_factory(3, draft_length, seed)
    for draft in itertools.product(range(3), repeat=draft_length):
        if pair.sequence_probability(draft, "p") <= 0:
            continue
        draft_probs, target_probs = pair.draft_inputs([list(draft)])
        traversal = traversal_output_distribution([draft], draft_probs, target_probs)
        block = block_output_distribution(list(draft), draft_probs[0], target_probs[0])
        # the same outcomes, up to block's h = S / (S + 1 - w) rounding to 1 - 3e-16 where traversal's is 1
        for produced in traversal.keys() | block.keys():
            assert traversal.get(produced, 0.0) == pytest.approx(block.get(produced, 0.0), abs=1e-14)


def test_post_order_of_a_hand_made_tree():
    """Drafts (7, 5), (4, 6), (7, 3): root -> 7 (leader 0) -> 5, 3 (leaders 0, 2); root -> 4 -> 6 (leader 1).
    Post-order, children by leader: 75, 73, 7, 46, 4, root; then the non-nodes. Slots k (L + 1) + d."""
    tokens = torch.tensor([[[7, 5], [4, 6], [7, 3]]])
    assert post_order(prefix_leaders(tokens)).tolist() == [[2, 8, 1, 5, 4, 0, 3, 6, 7]]


# --- batched == reference ---------------------------------------------------------------------------


def assert_equals_reference(batched, draft_tokens, draft_probs, target_probs, uniforms):
    """Row by row: the produced tokens, their count, the draft index, and the per-position counts."""
    for b in range(draft_tokens.shape[0]):
        produced, index = reference_traversal_sequence(draft_tokens[b].tolist(), draft_probs[b].double().tolist(),
                                                       target_probs[b].double().tolist(), uniforms[b].tolist())
        count = len(produced)
        assert batched.tokens[b, :count].tolist() == produced, b
        assert (batched.tokens[b, count:] == -1).all()
        assert int(batched.num_tokens[b]) == count and int(batched.num_accepted[b]) == count - 1
        assert int(batched.draft_index[b]) == index
        # the draft index carries the accepted prefix
        assert draft_tokens[b, index, : count - 1].tolist() == produced[: count - 1]
    accepted = batched.num_accepted
    assert batched.accepted_per_position.tolist() == [int((accepted > i).sum()) for i in range(draft_tokens.shape[2])]


@pytest.mark.parametrize(("vocab", "num_drafts", "draft_length", "seed"),
                         [(3, 2, 2, 0), (3, 3, 3, 1), (4, 4, 3, 2), (3, 5, 2, 3), (5, 3, 4, 4), (4, 8, 2, 5)])
def test_batched_traversal_equals_reference_under_the_same_uniforms(toy_pair_factory, vocab, num_drafts,
                                                                   draft_length, seed):
    pair = toy_pair_factory(vocab, draft_length, seed)
    generator = torch.Generator().manual_seed(seed)
    inputs = pair.sample_draft_set(300, num_drafts, draft_length, generator)
    uniforms = torch.rand(300, draft_length + 1, num_drafts + 1, generator=generator, dtype=torch.float64)
    batched = select_sequences(*inputs, uniforms, method="traversal")
    assert_equals_reference(batched, *inputs, uniforms)
    accepted = batched.num_accepted
    assert int(accepted.min()) == 0 and int(accepted.max()) == draft_length  # both ends reached
    assert bool((batched.draft_index > 0).any())  # some rows accepted a path after its elder sibling was deleted


def compact_tree_inputs(draft_tokens, target_probs):
    """The engine's layout of per-draft target rows: one row per tree node, `node_of` breadth first."""
    batch, num_drafts, length = draft_tokens.shape
    node_of, num_nodes = compact_nodes(prefix_leaders(draft_tokens))  # [B, K, L + 1], [B]
    width = int(num_nodes.max())
    node_probs = torch.zeros(batch, width, target_probs.shape[-1], dtype=target_probs.dtype)
    index = node_of.reshape(batch, -1, 1).expand(-1, -1, target_probs.shape[-1])
    node_probs.scatter_(1, index, target_probs.reshape(batch, num_drafts * (length + 1), -1))
    return node_probs, node_of


def test_the_engine_tree_layout_gives_the_same_selection(toy_pair_factory):
    """select_tree on compact nodes (M = the widest tree: fewer steps) == the per-draft layout."""
    pair = toy_pair_factory(3, 3, 7)
    generator = torch.Generator().manual_seed(7)
    tokens, draft_probs, target_probs = pair.sample_draft_set(400, 4, 3, generator)
    uniforms = torch.rand(400, 4, 5, generator=generator, dtype=torch.float64)
    node_probs, node_of = compact_tree_inputs(tokens, target_probs)
    assert node_probs.shape[1] < 1 + 4 * 3  # some trees share nodes
    tree = select_tree(tokens, draft_probs, node_probs, node_of, uniforms, method="traversal")
    drafts = select_sequences(tokens, draft_probs, target_probs, uniforms, method="traversal")
    for field in ("tokens", "num_tokens", "draft_index", "accepted_per_position"):
        assert torch.equal(getattr(tree, field), getattr(drafts, field)), field


def test_batched_traversal_on_float32_engine_like_inputs_with_zeros():
    """Random float32 laws with zeros (p = 0 where q likes a token, q = 0 on the last token), K = 3."""
    g = torch.Generator().manual_seed(11)
    batch, num_drafts, length, vocab = 200, 3, 3, 6
    draft_logits = torch.randn(batch, num_drafts, length, vocab, generator=g)
    target_logits = torch.cat([draft_logits, draft_logits[:, :, -1:]], 2) + 0.8 * torch.randn(
        batch, num_drafts, length + 1, vocab, generator=g)
    draft_logits[..., 0] = -torch.inf
    target_logits[..., 0] += 2.0
    target_logits[..., -1] = -torch.inf
    # drafts share prefixes: the same first token and the same laws along a shared prefix
    draft_logits[:, 1:, 0] = draft_logits[:, :1, 0]
    target_logits[:, 1:, 0] = target_logits[:, :1, 0]
    draft_probs, target_probs = draft_logits.softmax(-1), target_logits.softmax(-1)
    tokens = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=g).view(batch, num_drafts, length)
    tokens[:, 1:, 0] = tokens[:, :1, 0]
    leader = prefix_leaders(tokens)
    rows, depths = torch.arange(batch)[:, None, None], torch.arange(length)
    draft_probs = draft_probs[rows, leader[:, :, :length], depths]  # laws of one node are one row
    target_probs = target_probs[rows, leader, torch.arange(length + 1)]
    uniforms = torch.rand(batch, length + 1, num_drafts + 1, generator=g, dtype=torch.float64)
    batched = select_sequences(tokens, draft_probs, target_probs, uniforms, method="traversal")
    assert_equals_reference(batched, tokens, draft_probs, target_probs, uniforms)


@pytest.mark.parametrize("draft_length", [1, 2, 4, 6])
def test_one_draft_gives_block_verification_token_for_token(toy_pair_factory, draft_length):
    """K = 1 reads block verification's uniforms (eta_i = [i - 1, 0], the last token [L, 1])."""
    pair = toy_pair_factory(3, draft_length, draft_length)
    generator = torch.Generator().manual_seed(draft_length)
    inputs = pair.sample_draft_set(500, 1, draft_length, generator)
    uniforms = torch.rand(500, draft_length + 1, 2, generator=generator, dtype=torch.float64)
    traversal = select_sequences(*inputs, uniforms, method="traversal")
    block = select_sequences(*inputs, uniforms, method="block")
    for field in ("tokens", "num_tokens", "draft_index", "accepted_per_position"):
        assert torch.equal(getattr(traversal, field), getattr(block, field)), field


def test_traversal_is_a_known_method_with_any_number_of_drafts():
    assert "traversal" in sequence_methods() and SEQUENCE_RULES["traversal"] is select_traversal
    with pytest.raises(ValueError, match="target_probs has shape"):
        select_sequences(torch.zeros(2, 3, 2, dtype=torch.int64), torch.ones(2, 3, 2, 4) / 4,
                         torch.ones(2, 3, 3, 5) / 5, torch.rand(2, 3, 4, dtype=torch.float64), method="traversal")


def test_the_token_order_control_sorts_drafts_and_changes_the_selection(toy_pair_factory):
    tokens = torch.tensor([[[2, 0], [1, 2], [2, 1], [1, 0]]])
    assert lexicographic_order(tokens).tolist() == [[3, 1, 0, 2]]
    pair = toy_pair_factory(3, 2, 3)
    generator = torch.Generator().manual_seed(3)
    inputs = pair.sample_draft_set(400, 3, 2, generator)
    uniforms = torch.rand(400, 3, 4, generator=generator, dtype=torch.float64)
    good = select_sequences(*inputs, uniforms, method="traversal")
    broken = token_order(select_traversal)(inputs[0], inputs[1], inputs[2].reshape(400, 9, -1),
                                           torch.arange(9).view(1, 3, 3).expand(400, -1, -1), uniforms)
    assert not torch.equal(good.tokens, broken.tokens)
    for b in range(400):  # its draft index still carries its accepted prefix
        count = int(broken.num_accepted[b])
        assert inputs[0][b, broken.draft_index[b], :count].tolist() == broken.tokens[b, :count].tolist()


def test_compiled_selection_traces_whole_and_gives_the_same_tokens(toy_pair_factory, monkeypatch):
    """`spectr.native.compiled_select_tree` dispatches "traversal" as a sequence rule: fullgraph, no
    graph break (dynamo traces it; a counting backend runs the traced graph)."""
    counter = CompileCounter()
    monkeypatch.setattr(native, "COMPILE_BACKEND", counter)
    pair = toy_pair_factory(3, 2, 9)
    generator = torch.Generator().manual_seed(9)
    tokens, draft_probs, target_probs = pair.sample_draft_set(64, 2, 2, generator)
    uniforms = torch.rand(64, 3, 3, generator=generator, dtype=torch.float64)
    node_probs, node_of = compact_tree_inputs(tokens, target_probs)
    try:
        compiled = native.compiled_select_tree(tokens, draft_probs, node_probs, node_of, uniforms,
                                               method="traversal")
    finally:
        torch._dynamo.reset()
    eager = select_tree(tokens, draft_probs, node_probs, node_of, uniforms, method="traversal")
    assert counter.frame_count == 1
    for field in ("tokens", "num_tokens", "draft_index", "accepted_per_position"):
        assert torch.equal(getattr(compiled, field), getattr(eager, field)), field
