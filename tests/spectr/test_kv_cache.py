"""The per-row KV cache: unit behaviour (row views, resets), and caches == fresh full forwards after real
iterations, with rows finishing, slots reset and refilled, and live rows packed into emptied slots."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import full_last_logits, tiny_model

from spectr.generate import Generation
from spectr.kv_cache import RowKVCache, tree_attention

# --- unit ---------------------------------------------------------------------------------


def test_write_keep_path_and_advance():
    cache = RowKVCache(num_layers=1, batch_size=2, capacity=8, device="cpu")
    cache.lengths = torch.tensor([1, 3])
    # 4 new tokens per row, values = 10 * row + token index, written after each row's prefix
    new = (torch.arange(4.0)[None, :] + torch.tensor([[0.0], [10.0]]))[:, None, :, None]  # [B, H=1, T, D=1]
    slots = cache.lengths[:, None] + torch.arange(4)  # [B, T]
    cache.begin_forward(slots, view_length=7)
    keys, values = cache.write(0, new, new + 100)
    assert keys.shape == (2, 1, 7, 1)
    assert keys[0, 0, 1:5, 0].tolist() == [0, 1, 2, 3] and keys[1, 0, 3:7, 0].tolist() == [10, 11, 12, 13]
    assert values[1, 0, 3, 0] == 110
    # keep new tokens 0 and 2 of row 0 (a path that skips token 1), only token 0 of row 1
    source = torch.tensor([[1, 3], [3, 4]])
    dest = torch.tensor([[1, 2], [3, 4]])  # row 1 pads with source == dest: a no-op
    cache.keep_path(source, dest)
    cache.advance(torch.tensor([2, 1]))
    assert cache.lengths.tolist() == [3, 4]
    assert cache.committed(0, 0)[0][0, :, 0].tolist() == [0, 0, 2]
    assert cache.committed(0, 1)[1][0, 3:, 0].tolist() == [110]


def test_capacity_is_enforced():
    cache = RowKVCache(num_layers=1, batch_size=1, capacity=4, device="cpu")
    with pytest.raises(RuntimeError, match="capacity"):
        cache.begin_forward(torch.zeros(1, 1, dtype=torch.int64), view_length=5)


def test_a_row_view_writes_reads_commits_and_advances_only_its_rows():
    cache = RowKVCache(num_layers=2, batch_size=4, capacity=6, device="cpu")
    full = torch.arange(4.0)[:, None, None, None].expand(4, 1, 2, 1)  # [B, H=1, T=2, D=1]: value = row
    cache.begin_forward(torch.tensor([[0, 1]] * 4), view_length=2)
    for layer in range(2):
        cache.write(layer, full, full)
    cache.lengths = torch.tensor([2, 2, 2, 2])
    view = cache.view(torch.tensor([3, 1]))
    assert view.batch_size == 2 and view.lengths.tolist() == [2, 2]
    new = torch.tensor([30.0, 10.0])[:, None, None, None].expand(2, 1, 2, 1)  # [R, H, T, D]
    view.begin_forward(view.lengths[:, None] + torch.arange(2), view_length=4)
    keys, values = view.write(1, new, new + 1)
    assert keys.shape == (2, 1, 4, 1)  # the view's rows only, gathered
    assert keys[:, 0, :, 0].tolist() == [[3, 3, 30, 30], [1, 1, 10, 10]] and values[0, 0, 2, 0] == 31
    assert cache.buffer[1, 0, :, 0, :4, 0].tolist() == [[0, 0, 0, 0], [1, 1, 10, 10], [2, 2, 0, 0], [3, 3, 30, 30]]
    view.keep_path(torch.tensor([[3], [2]]), torch.tensor([[2], [2]]))  # row 3 keeps slot 3 at 2; row 1: no-op
    view.advance(torch.tensor([1, 2]))
    assert cache.lengths.tolist() == [2, 4, 2, 3]
    view.lengths = torch.tensor([5, 0])
    assert cache.lengths.tolist() == [2, 0, 2, 5]
    cache.reset_rows(torch.tensor([0, 3]))
    assert cache.lengths.tolist() == [0, 0, 2, 0] and cache.buffer[:, :, 3].abs().sum() > 0  # entries kept
    cache.reset_rows(torch.tensor([3]), zero=True)
    assert cache.buffer[:, :, 3].abs().sum() == 0 and cache.buffer[:, :, 2].abs().sum() > 0


def test_tree_attention_pattern():
    prefix = torch.tensor([2, 0])
    visible = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])  # root + 2 leaves
    allowed = tree_attention(prefix, visible, view_length=6)  # [B, T, S]
    assert allowed[0].int().tolist() == [
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 1, 0],
    ]
    assert allowed[1].int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
    ]


# --- caches through the engine --------------------------------------------------------------

PROMPTS = [[5, 9, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [7], [3, 3, 8, 1, 30, 2, 6]]


@pytest.fixture(scope="module")
def pair():
    # peaked random models: acceptance differs a lot between rows and iterations
    target = tiny_model(vocab_size=32, hidden_size=32, num_layers=2, init_std=0.3, seed=11)
    draft = tiny_model(vocab_size=32, hidden_size=16, num_layers=2, init_std=0.3, seed=12)
    return target, draft


@torch.inference_mode()
def next_logits_through_cache(model, cache, pending: torch.Tensor, num_pending: torch.Tensor, lengths_host):
    """Logits after each row's committed tokens, feeding only the pending tokens through the cache.

    pending: [B, W] tokens not yet in the cache (row b has num_pending[b] real ones)."""
    lengths = cache.rows.lengths
    width = pending.shape[1]
    offsets = torch.arange(width)
    slots = lengths[:, None] + offsets  # [B, W]
    allowed = tree_attention(lengths, offsets[:, None] >= offsets[None, :], max(lengths_host) + width)
    logits = model.forward(pending, slots, allowed, cache, slots)  # [B, W, V]
    return logits[torch.arange(len(pending)), num_pending - 1]  # [B, V]


def check_caches_against_full_forwards(generation, target, draft, method):
    """Every running row's caches equal fresh full forwards of its committed tokens (target and draft)."""
    rows = generation.rows
    occupied = [slot for slot, r in enumerate(generation.batcher._in_slot) if r is not None]
    running = rows.running.tolist()
    live = [i for i, slot in enumerate(occupied) if running[slot]]
    sequences = [generation.row_sequences()[i] for i in live]
    slots = torch.tensor([occupied[i] for i in live])
    lengths = rows.target_cache.rows.lengths
    assert lengths[slots].tolist() == [len(s) - 1 for s in sequences]
    assert rows.pending[slots].tolist() == [s[-1] for s in sequences]
    ones = torch.ones(len(lengths), dtype=torch.int64)
    cached = next_logits_through_cache(generation.target, rows.target_cache, rows.pending[:, None], ones,
                                       lengths.tolist())[slots]
    torch.testing.assert_close(cached, full_last_logits(target, sequences), atol=1e-4, rtol=0)
    if method == "autoregressive":
        return sequences
    # draft: the cache holds all but the 1 or 2 pending tokens (2 after an all-accepted iteration)
    drafter = rows.drafter
    draft_lengths = drafter.cache.rows.lengths.tolist()
    num_pending = drafter.num_pending.tolist()
    for seq, slot in zip(sequences, slots.tolist()):
        assert draft_lengths[slot] + num_pending[slot] == len(seq)
        assert drafter.pending[slot, : num_pending[slot]].tolist() == seq[len(seq) - num_pending[slot]:]
    width = max(num_pending)
    cached = next_logits_through_cache(generation.draft, drafter.cache, drafter.pending[:, :width],
                                       drafter.num_pending, draft_lengths)[slots]
    torch.testing.assert_close(cached, full_last_logits(draft, sequences), atol=1e-4, rtol=0)
    return sequences


@pytest.mark.parametrize("method", ["autoregressive", "speculative", "spectr", "specinfer", "block"])
def test_caches_equal_fresh_full_forward_after_iterations(pair, method):
    target, draft = pair
    generation = Generation(target, draft, PROMPTS, method=method, num_drafts=3, draft_length=3,
                            max_new_tokens=40, seed=[4, 5, 6, 7])
    with torch.inference_mode():
        generation.start()
        for _ in range(10):  # until rows sit at different lengths (or 10 iterations)
            generation.step()
            generated = {len(s) - len(p) for s, p in zip(generation.row_sequences(), PROMPTS)}
            if len(generated) > 1 and generation.stats.iterations >= 3:
                break
        assert bool(generation.rows.running.all())  # nobody finished: every row is checked
        sequences = check_caches_against_full_forwards(generation, target, draft, method)
    if method != "autoregressive":
        # rows accepted different numbers of tokens, so they sit at different cache lengths
        assert len({len(s) - len(p) for s, p in zip(sequences, PROMPTS)}) > 1


@pytest.mark.parametrize("pack_below", [0.0, 1.0], ids=["masked in place", "live rows packed"])
@pytest.mark.parametrize("method", ["autoregressive", "spectr"])
def test_slots_are_reset_and_refilled_and_every_running_row_stays_consistent(pair, method, pack_below):
    """Six prompts through 3 slots: rows finish, their slots take the next prompts (a slot's stale
    entries stay behind, masked) or, at the tail, the live rows move down into them; after every
    iteration each running row's caches are exact."""
    target, draft = pair
    prompts = PROMPTS + [[2, 4, 6, 8, 10, 12, 14], [9, 9]]
    budgets = [6, 9, 30, 12, 5, 20]
    generation = Generation(target, draft, prompts, method=method, num_drafts=2, draft_length=3,
                            max_new_tokens=budgets, seed=[1, 2, 3, 4, 5, 6], batch_size=3, pack_below=pack_below)
    buffer = None
    with torch.inference_mode():
        generation.start()
        while not generation.done:
            generation.step()
            if generation.batcher.rows_running:
                check_caches_against_full_forwards(generation, target, draft, method)
            buffer = buffer if buffer is not None else generation.rows.target_cache.rows.buffer
            assert generation.rows.target_cache.rows.buffer is buffer  # the pool is never reallocated
        generation.finish()
    assert [len(t) for t in generation.tokens] == budgets
    assert generation.stats.finish_reason == ["length"] * 6
    assert generation.stats.admissions >= 3
    assert (generation.stats.packed_rows > 0) == (pack_below == 1.0)


def test_packing_live_rows_does_not_change_the_output(pair):
    target, draft = pair
    outputs = []
    for pack_below in (0.0, 0.5, 1.0):
        out = run(Generation(target, draft, PROMPTS, method="spectr", num_drafts=2, draft_length=3,
                             max_new_tokens=[6, 9, 40, 25], seed=[1, 2, 3, 4], pack_below=pack_below))
        outputs.append((out.tokens, out.stats.target_calls, out.stats.packed_rows, out.stats.narrow_iterations))
    assert outputs[0][:2] == outputs[1][:2] == outputs[2][:2]
    assert outputs[0][2] == 0 < outputs[1][2] <= outputs[2][2]  # rows 0 and 1 finish first: 2 then 1 live
    assert outputs[2][3] > outputs[0][3] > 0  # slots above the top row are skipped even without packing


def test_move_rows_copies_used_slots_and_empties_the_sources():
    cache = RowKVCache(num_layers=1, batch_size=4, capacity=6, device="cpu")
    values = torch.arange(4.0)[:, None, None, None].expand(4, 1, 6, 1) + 1  # [B, H, S, D]: row b holds b + 1
    cache.begin_forward(torch.arange(6).expand(4, 6), view_length=6)
    cache.write(0, values, values)
    cache.lengths = torch.tensor([0, 3, 0, 4])
    cache.move_rows(torch.tensor([3]), torch.tensor([0]), used_slots=4)
    assert cache.lengths.tolist() == [4, 3, 0, 0]
    assert cache.buffer[0, 0, 0, 0, :, 0].tolist() == [4, 4, 4, 4, 1, 1]  # used slots moved, scratch untouched
    prefix = cache.prefix(2)
    prefix.advance(torch.tensor([1, 1]))
    assert cache.lengths.tolist() == [5, 4, 0, 0] and prefix.buffer.data_ptr() == cache.buffer.data_ptr()


def run(generation):
    with torch.inference_mode():
        generation.start()
        while not generation.done:
            generation.step()
        generation.finish()
    return generation.output()
