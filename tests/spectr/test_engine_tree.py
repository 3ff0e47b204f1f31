"""The engine for accelerators: host syncs per iteration, batch invariance in float32, prefix-tree
drafts (widths, and the one row a node's tokens are drawn from), non-finite guards, EOS lists."""

from __future__ import annotations

import importlib

import pytest
import torch
from hf_tiny import noisy_copy, tiny_model

import spectr
from spectr import iteration, selection
from spectr.diagnostics import HostSyncCounter
from spectr.generate import Generation
from spectr.rng import counter_uniforms, sample_categorical
from spectr.tree import compact_nodes, prefix_leaders, verify_layout

METHODS = ["autoregressive", "speculative", "spectr", "specinfer", "block"]
PROMPTS = [[3, 17, 42, 8, 1], [9], [5, 6, 7, 8, 9, 10, 11, 12, 13], [60, 2]]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(vocab_size=64, init_std=0.2, seed=3, max_positions=128)
    return target, noisy_copy(target, noise_std=0.08, seed=4)


def counter(*models) -> HostSyncCounter:
    syncs = HostSyncCounter()
    for model in models:
        syncs.inside_module(model)
    return syncs


# --- host syncs -----------------------------------------------------------------------------------


def drive_counting(target, draft, method, **kwargs):
    """Run a Generation phase by phase, counting the engine's host reads in each phase.

    Returns (syncs of start, [(syncs, rows retired) per step], syncs of finish, kinds read inside
    the models, the generation)."""
    generation = Generation(target, draft, PROMPTS, method=method, **kwargs)
    per_step, model_kinds = [], set()
    with torch.inference_mode():
        with counter(target, draft) as start:
            generation.start()
        while not generation.done:
            retired = len(generation.finished)
            with counter(target, draft) as step:
                generation.step()
            per_step.append((step.total, len(generation.finished) - retired))
            model_kinds |= set(step.model_by_kind)
        with counter(target, draft) as finish:
            generation.finish()
    return start.total, per_step, finish.total, model_kinds, generation


@pytest.mark.parametrize("batch_size", [None, 2], ids=["all at once", "admitted mid-run"])
@pytest.mark.parametrize("method", METHODS)
def test_at_most_one_host_sync_per_iteration_one_draft_two_for_several(pair, method, batch_size):
    """Plus one read-back in an iteration where rows finished (it frees their slots); admission reads nothing."""
    bound = 1 if method in ("autoregressive", "speculative", "block") else 2
    kwargs = dict(num_drafts=3, draft_length=3, max_new_tokens=[20, 9, 30, 14], eos_token_id=[5, 6], seed=4,
                  batch_size=batch_size)
    start, per_step, finish, model_kinds, generation = drive_counting(*pair, method, **kwargs)
    assert start == 0 and finish == 0
    assert len(per_step) == generation.stats.iterations > 3
    assert all(syncs <= bound + (retired > 0) for syncs, retired in per_step), per_step
    assert max(syncs for syncs, retired in per_step if not retired) <= bound
    retirements = sum(retired > 0 for _, retired in per_step)
    if batch_size:
        assert generation.stats.admissions > 1  # rows were admitted into freed slots mid-run
    # inside the models only `.to(x.device)` calls, which on CPU look like host copies
    assert model_kinds <= {"cpu"}
    with counter(*pair) as whole:
        out = spectr.generate(*pair, PROMPTS, method=method, **kwargs)
    assert whole.total <= bound * out.stats.iterations + retirements
    assert out.tokens == generation.tokens


def test_the_sync_count_sees_a_data_dependent_branch(pair, monkeypatch):
    """Negative control: a sampler that checks a device value on the host breaks the bound."""
    def checking_sampler(probs, uniforms):
        assert bool((probs.sum(-1) > 0).all())
        return sample_categorical(probs, uniforms)

    monkeypatch.setattr(importlib.import_module("spectr.iteration"), "sample_categorical", checking_sampler)
    _, per_step, _, _, _ = drive_counting(*pair, "autoregressive", max_new_tokens=6)
    assert min(syncs for syncs, _ in per_step) == 2


# --- batch invariance -----------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_a_prompts_tokens_are_the_same_alone_and_in_a_batch_of_16_others_float32(pair, method):
    generator = torch.Generator().manual_seed(5)
    others = [torch.randint(0, 64, (int(n),), generator=generator).tolist()
              for n in torch.randint(1, 14, (16,), generator=generator)]
    prompt = [7, 3, 30, 12]
    kwargs = dict(method=method, num_drafts=3, draft_length=3, max_new_tokens=24, top_p=0.95, eos_token_id=9)
    alone = spectr.generate(*pair, [prompt], seed=[77], **kwargs)
    batch = others[:9] + [prompt] + others[9:]
    together = spectr.generate(*pair, batch, seed=list(range(9)) + [77] + list(range(9, 16)), **kwargs)
    assert together.tokens[9] == alone.tokens[0]
    assert together.stats.target_calls[9] == alone.stats.target_calls[0]
    assert len({len(t) for t in together.tokens}) > 1  # rows finished at different times (EOS)


def test_batch_size_gives_the_same_output_as_all_at_once(pair):
    kwargs = dict(method="spectr", num_drafts=2, draft_length=3, max_new_tokens=[12, 7, 16, 9], seed=[1, 2, 3, 4])
    whole = spectr.generate(*pair, PROMPTS, **kwargs)
    for batch_size in (1, 3, 4, 9):
        streamed = spectr.generate(*pair, PROMPTS, batch_size=batch_size, **kwargs)
        assert streamed.tokens == whole.tokens
        assert streamed.stats.generated_tokens == whole.stats.generated_tokens == [12, 7, 16, 9]
        assert streamed.stats.target_calls == whole.stats.target_calls
        assert streamed.stats.accepted_per_position == whole.stats.accepted_per_position


# --- the tree -------------------------------------------------------------------------------------


def test_compact_nodes_and_verify_layout_on_a_hand_made_tree():
    # K = 3, L = 2: drafts (4, 5), (4, 6), (4, 5): nodes root, (4), (4,5), (4,6)
    tokens = torch.tensor([[[4, 5], [4, 6], [4, 5]]])
    leader = prefix_leaders(tokens)
    assert leader.tolist() == [[[0, 0, 0], [0, 0, 1], [0, 0, 0]]]
    node_of, num_nodes = compact_nodes(leader)
    assert node_of.tolist() == [[[0, 1, 2], [0, 1, 3], [0, 1, 2]]] and num_nodes.tolist() == [4]

    class Tree:
        pass

    tree = Tree()
    tree.tokens, tree.node_of = tokens, node_of
    ids, depth, visible = verify_layout(tree, torch.tensor([9]), width=5)
    assert ids.tolist() == [[9, 4, 5, 6, 0]] and depth.tolist() == [[0, 1, 2, 2, 0]]
    assert visible[0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [0, 0, 0, 0, 1],  # padding: itself only
    ]


def test_near_greedy_drafts_make_a_chain_of_about_l_plus_1_verified_tokens(pair):
    """Drafts coincide at low temperature: the target reads ~L+1 tokens per row, not 1 + K*L."""
    num_drafts, length = 4, 4
    cold = spectr.generate(*pair, PROMPTS, method="spectr", num_drafts=num_drafts, draft_length=length,
                           max_new_tokens=32, temperature=0.01, seed=1)
    # a row's tree has at least L + 1 nodes; near-ties of the top two tokens split it now and then
    assert length + 1 <= cold.stats.mean_tree_nodes <= 1.25 * (length + 1)
    assert cold.stats.mean_verify_width <= 1.5 * (length + 1)
    # at temperature 1 on near-uniform models the drafts rarely share a prefix: the tree is nearly full
    flat = tiny_model(vocab_size=64, init_std=0.02, seed=5)
    warm = spectr.generate(flat, noisy_copy(flat, 0.02, 6), PROMPTS, method="spectr", num_drafts=num_drafts,
                           draft_length=length, max_new_tokens=32, seed=1)
    assert warm.stats.mean_tree_nodes > 0.85 * (1 + num_drafts * length)
    assert warm.stats.mean_verify_width == 1 + num_drafts * length or warm.stats.mean_verify_width > 15


@pytest.mark.parametrize("method", ["spectr", "specinfer"])
def test_rows_without_shared_nodes_selected_as_one_draft_give_the_same_tokens(monkeypatch, method):
    """The walk's shortcut (rows with no node of two drafts at a depth are selected as one-draft
    nodes there) changes nothing: same tokens as the full masked walk, on splits that really split."""
    target = tiny_model(vocab_size=16, hidden_size=16, num_heads=2, num_kv_heads=1, init_std=0.6, seed=8)
    draft = noisy_copy(target, 0.3, 9)
    prompts = [[1, 2], [3], [4, 5, 6], [7, 8, 9, 10, 11]] * 4
    original = iteration._tree_extent
    outputs, split_sizes = [], []

    def recording(loop, tree):
        width, splits = original(loop, tree)
        split_sizes.extend(len(s[0]) for s in splits[1:])
        return width, splits

    def full_walk(loop, tree):
        return original(loop, tree)[0], None

    for extent in (recording, full_walk):
        monkeypatch.setattr(iteration, "_tree_extent", extent)
        generation = Generation(target, draft, prompts, method=method, num_drafts=4, draft_length=4,
                                max_new_tokens=40, seed=3)
        outputs.append(run_generation(generation).tokens)
    assert outputs[0] == outputs[1]
    assert any(0 < size < len(prompts) for size in split_sizes)  # both kinds of rows were selected


def _recording_selector(records):
    def selector(draft_tokens, alive, draft_probs, target_probs, uniforms):
        records.append((draft_tokens.clone(), alive.clone(), draft_probs.clone()))
        return selection.select_kseq(draft_tokens, alive, draft_probs, target_probs, uniforms)

    return selector


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_draft_token_at_a_node_is_drawn_from_the_row_the_selection_reads(monkeypatch, dtype):
    """Structural exactness: tokens[b, k, i] is the inverse-CDF draw, with the row's own uniform, from
    draft_probs[b, leader, i]; drafts through one node share that leader; the selection at a node
    receives exactly that row (bit for bit)."""
    target = tiny_model(vocab_size=16, hidden_size=16, num_heads=2, num_kv_heads=1, init_std=0.6, seed=8, dtype=dtype)
    draft = noisy_copy(target, 0.3, 9)
    generation = Generation(target, draft, [[1, 2], [3], [4, 5, 6], [7, 8, 9, 10, 11]] * 4, method="spectr",
                            num_drafts=4, draft_length=4, max_new_tokens=40, seed=3)
    records = []
    monkeypatch.setitem(selection.TOKEN_SELECTORS, "spectr", _recording_selector(records))
    original = iteration._tree_extent  # one selector call per position, over every row:
    monkeypatch.setattr(iteration, "_tree_extent", lambda loop, tree: (original(loop, tree)[0], None))
    shared_nodes = differing_duplicates = 0
    trees = []
    with torch.inference_mode():
        generation.start()
        drafter, slots = generation.rows.drafter, generation.batcher.loop.slots
        propose = drafter.propose
        monkeypatch.setattr(drafter, "propose", lambda *args: trees.append(propose(*args)) or trees[-1])
        for _ in range(6):
            uniforms = counter_uniforms(generation.rows.keys, generation.rows.iteration, slots.num_slots)
            draft_uniforms, _ = slots.split(uniforms)  # [B, L, K]
            records.clear()
            trees.clear()
            generation.step()
            tree = trees[0]
            batch, num_drafts, length = tree.tokens.shape
            for b in range(batch):
                for k in range(num_drafts):
                    for i in range(length):
                        lead = int(tree.leader[b, k, i])
                        assert lead <= k and tree.tokens[b, lead, :i].tolist() == tree.tokens[b, k, :i].tolist()
                        drawn = sample_categorical(tree.draft_probs[b, lead, i], draft_uniforms[b, i, k])
                        assert int(drawn) == int(tree.tokens[b, k, i])
                        if lead != k and i > 0:
                            shared_nodes += 1
                            differing_duplicates += not torch.equal(tree.draft_probs[b, k, i],
                                                                    tree.draft_probs[b, lead, i])
            for i, (_, alive, node_p) in enumerate(records):
                for b in range(batch):
                    if bool(alive[b].any()):
                        first = int(alive[b].to(torch.int8).argmax())
                        leaders = {int(tree.leader[b, k, i]) for k in range(num_drafts) if alive[b, k]}
                        assert leaders == {first}
                        assert torch.equal(node_p[b], tree.draft_probs[b, first, i])
    assert shared_nodes > 20  # the regime where drafts really share prefixes was exercised
    if dtype == torch.bfloat16:
        # duplicate rows of one prefix differ numerically in bf16: reading any row but the
        # leader's would not be the distribution the node's tokens were drawn from
        assert differing_duplicates > 0


class _SlotDependentModel:
    """A fake draft model whose logits depend on the input token AND on the cache slot it is written
    to, so two drafts with the same prefix (at different slots) get clearly different rows."""

    vocab_size = 6

    def forward(self, input_ids, position_ids, allowed, cache, write_slots, last_only=False):
        vocab = torch.arange(self.vocab_size, dtype=torch.float32)
        return torch.sin(input_ids[..., None] * 1.7 + vocab) + torch.cos(write_slots[..., None] * 2.3 * (vocab + 1))


def test_drafter_draws_a_nodes_children_from_its_leaders_row_even_when_duplicate_rows_differ():
    from types import SimpleNamespace

    from spectr.drafting import TreeDrafter
    from spectr.kv_cache import RowKVCache
    from spectr.warps import SamplingWarp

    batch, num_drafts, length = 64, 4, 4
    cache = SimpleNamespace(rows=RowKVCache(1, batch, 64, "cpu"))
    cache.rows.lengths = torch.full((batch,), 3)
    drafter = TreeDrafter(_SlotDependentModel(), cache, SamplingWarp(), torch.arange(batch) % 6)  # K, L: uniforms
    uniforms = torch.rand(batch, length, num_drafts, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tree = drafter.propose(uniforms, (4, 1), torch.ones(batch, dtype=torch.bool))
    own_row_mismatches = duplicates = 0
    for b in range(batch):
        for k in range(num_drafts):
            for i in range(length):
                lead = int(tree.leader[b, k, i])
                assert int(sample_categorical(tree.draft_probs[b, lead, i], uniforms[b, i, k])) == int(tree.tokens[b, k, i])
                if lead != k:
                    duplicates += 1
                    own = sample_categorical(tree.draft_probs[b, k, i], uniforms[b, i, k])
                    own_row_mismatches += int(own) != int(tree.tokens[b, k, i])
    # the check is sensitive: drawing from a duplicate's own row would have given other tokens
    assert duplicates > 100 and own_row_mismatches > 10
    assert torch.equal(tree.leader, prefix_leaders(tree.tokens))
    assert torch.equal(tree.num_nodes, compact_nodes(tree.leader)[1])


# --- guards ---------------------------------------------------------------------------------------


def run_generation(generation: Generation):
    with torch.inference_mode():
        generation.start()
        while not generation.done:
            generation.step()
        generation.finish()
    return generation.output()


def _poison(model, row: int, after_calls: int):
    """A forward hook that turns `row`'s logits to NaN from the `after_calls`-th forward on."""
    calls = {"n": 0}

    def hook(module, args, output):
        calls["n"] += 1
        if calls["n"] > after_calls and output.shape[0] > row:
            output = output.clone()
            output[row] = float("nan")
        return output

    return model.lm_head.register_forward_hook(hook)


@pytest.mark.parametrize("method,poisoned", [("autoregressive", "target"), ("spectr", "target"),
                                              ("speculative", "draft"), ("specinfer", "draft")])
def test_non_finite_logits_end_only_that_row_with_an_error_naming_row_and_model(pair, method, poisoned):
    target, draft = pair
    kwargs = dict(method=method, num_drafts=3, draft_length=3, max_new_tokens=24, seed=[1, 2, 3, 4])
    clean = spectr.generate(target, draft, PROMPTS, **kwargs)
    handle = _poison(target if poisoned == "target" else draft, row=2, after_calls=4)
    try:  # no packing of live rows, so that batch row 2 stays prompt 2 while the hook poisons it
        out = run_generation(Generation(target, draft, PROMPTS, pack_below=0.0, **kwargs))
    finally:
        handle.remove()
    assert out.stats.finish_reason[2] == "error"
    assert f"row 2: the {poisoned} model" in out.stats.errors[2] and "non-finite" in out.stats.errors[2]
    generated = out.tokens[2]
    assert generated == clean.tokens[2][: len(generated)] and len(generated) < 24
    assert f"after {len(generated)} generated tokens" in out.stats.errors[2]
    for row in (0, 1, 3):  # the other rows are untouched
        assert out.tokens[row] == clean.tokens[row] and out.stats.errors[row] is None
        assert out.stats.finish_reason[row] == "length"


def test_eos_token_id_accepts_a_list_and_stops_at_the_first_of_them(pair):
    kwargs = dict(method="spectr", num_drafts=2, draft_length=3, max_new_tokens=30, seed=[1, 2, 3, 4])
    free = spectr.generate(*pair, PROMPTS, **kwargs).tokens
    counts = torch.bincount(torch.tensor([t for row in free for t in row[1:]]), minlength=64)
    eos = counts.argsort(descending=True)[:2].tolist()
    cut = spectr.generate(*pair, PROMPTS, eos_token_id=eos, **kwargs)
    for row, tokens in enumerate(free):
        stops = [i for i, t in enumerate(tokens) if t in eos]
        expected = tokens[: stops[0] + 1] if stops else tokens
        assert cut.tokens[row] == expected
        assert cut.stats.finish_reason[row] == ("eos" if stops else "length")
    assert {t[-1] for t, r in zip(cut.tokens, cut.stats.finish_reason) if r == "eos"} <= set(eos)
    assert "eos" in cut.stats.finish_reason
