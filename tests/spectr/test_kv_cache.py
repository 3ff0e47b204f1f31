"""The per-row KV cache: unit behaviour, and caches == fresh full forwards after real iterations."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import full_last_logits, tiny_model

from spectr.generate import Generation
from spectr.kv_cache import RowKVCache, tree_attention

# --- unit ---------------------------------------------------------------------------------


def test_write_keep_path_advance_and_select_rows():
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
    cache.select_rows(torch.tensor([1]))
    assert cache.batch_size == 1 and cache.lengths.tolist() == [4]
    assert cache.keys[0].shape == (1, 1, 8, 1)


def test_capacity_is_enforced():
    cache = RowKVCache(num_layers=1, batch_size=1, capacity=4, device="cpu")
    with pytest.raises(RuntimeError, match="capacity"):
        cache.begin_forward(torch.zeros(1, 1, dtype=torch.int64), view_length=5)


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
    assert bool(generation.running.all())  # nobody finished: every row is checked
    sequences = generation.row_sequences()
    if method != "autoregressive":
        # rows accepted different numbers of tokens, so they sit at different cache lengths
        assert len({len(s) - len(p) for s, p in zip(sequences, PROMPTS)}) > 1

    # target: the cache holds every committed token but the last, which is pending
    lengths = generation.target_cache.rows.lengths.tolist()
    assert lengths == [len(s) - 1 for s in sequences]
    assert generation.pending.tolist() == [s[-1] for s in sequences]
    ones = torch.ones(len(sequences), dtype=torch.int64)
    cached = next_logits_through_cache(generation.target, generation.target_cache, generation.pending[:, None],
                                       ones, lengths)
    torch.testing.assert_close(cached, full_last_logits(target, sequences), atol=1e-4, rtol=0)

    if method != "autoregressive":
        # draft: the cache holds all but the 1 or 2 pending tokens (2 after an all-accepted iteration)
        drafter = generation.drafter
        draft_lengths = drafter.cache.rows.lengths.tolist()
        num_pending = drafter.num_pending.tolist()
        assert [n + p for n, p in zip(draft_lengths, num_pending)] == [len(s) for s in sequences]
        for row, seq in enumerate(sequences):
            assert drafter.pending[row, : num_pending[row]].tolist() == seq[len(seq) - num_pending[row]:]
        width = max(num_pending)
        cached = next_logits_through_cache(generation.draft, drafter.cache, drafter.pending[:, :width],
                                           drafter.num_pending, draft_lengths)
        torch.testing.assert_close(cached, full_last_logits(draft, sequences), atol=1e-4, rtol=0)


@pytest.mark.parametrize("compact_fraction", [0.0, 1.0], ids=["compact at once", "masked in place"])
def test_finished_rows_leave_the_batch_or_stay_masked_and_the_rest_stay_consistent(pair, compact_fraction):
    target, draft = pair
    budgets = [6, 9, 40, 40]
    generation = Generation(target, draft, PROMPTS, method="spectr", num_drafts=2, draft_length=3,
                            max_new_tokens=budgets, seed=[1, 2, 3, 4], compact_fraction=compact_fraction)
    batch_sizes = []
    with torch.inference_mode():
        generation.start()
        while generation.stats.iterations < 8:
            generation.step()
            batch_sizes.append(generation.target_cache.rows.batch_size)
        # the rows still running: caches equal fresh forwards of their committed tokens
        running = generation.running.tolist()
        sequences = [s for s, r in zip(generation.row_sequences(), running) if r]
        rows = torch.tensor([i for i, r in enumerate(running) if r])
        lengths = generation.target_cache.rows.lengths[rows]
        assert lengths.tolist() == [len(s) - 1 for s in sequences]
        cache = generation.target_cache
        slots = cache.rows.lengths[:, None]
        allowed = tree_attention(cache.rows.lengths, torch.ones(1, 1, dtype=torch.bool),
                                 int(cache.rows.lengths.max()) + 1)
        cached = generation.target.forward(generation.pending[:, None], slots, allowed, cache, slots)[rows, 0]
        torch.testing.assert_close(cached, full_last_logits(target, sequences), atol=1e-4, rtol=0)
        while not generation.done:
            generation.step()
        generation.finish()
    assert [len(t) for t in generation.tokens] == budgets
    assert generation.stats.finish_reason == ["length"] * 4
    if compact_fraction == 0.0:  # the first two rows left as soon as they finished
        assert batch_sizes[0] == 4 and batch_sizes[-1] == 2 and generation.stats.compactions >= 2
    else:
        assert batch_sizes == [4] * 8 and generation.stats.compactions == 0


def test_compaction_does_not_change_the_output(pair):
    target, draft = pair
    outputs = []
    for compact_fraction in (0.0, 0.5, 1.0):
        generation = Generation(target, draft, PROMPTS, method="spectr", num_drafts=2, draft_length=3,
                                max_new_tokens=[6, 9, 40, 25], seed=[1, 2, 3, 4], compact_fraction=compact_fraction)
        with torch.inference_mode():
            generation.start()
            while not generation.done:
                generation.step()
            generation.finish()
        outputs.append(generation.tokens)
    assert outputs[0] == outputs[1] == outputs[2]
