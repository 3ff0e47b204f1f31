"""Continuous batching: fewer target calls than static batches, rows independent of their batch and of
when they were admitted, the streaming form an actor uses, a cache pool that never grows, error slots
reset for the next prompt, bad input named by argument and row."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import noisy_copy, tiny_model

import spectr
from spectr.batching import ContinuousBatcher
from spectr.kv_cache import RowKVCache
from spectr.stats import GenerationStats

METHODS = ["autoregressive", "speculative", "spectr", "specinfer", "block"]
SETTINGS = dict(num_drafts=3, draft_length=3, top_p=0.95)


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(vocab_size=64, init_std=0.2, seed=3, max_positions=128)
    return target, noisy_copy(target, noise_std=0.08, seed=4)


def random_prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 13, (count,), generator=generator).tolist()
    return [torch.randint(0, 64, (n,), generator=generator).tolist() for n in lengths]


def alone(pair, prompt, budget, seed, **kwargs) -> list[int]:
    return spectr.generate(*pair, [prompt], max_new_tokens=[budget], seed=[seed], **kwargs).tokens[0]


# --- the mixed-budget workload ---------------------------------------------------------------------


def mixed_budget_run(pair, method):
    """40 prompts, budgets alternating 2 and 30, 8 rows in flight; checked against static batches of 8."""
    prompts, budgets, seeds = random_prompts(40, 1), [2, 30] * 20, list(range(100, 140))
    kwargs = dict(method=method, **SETTINGS)
    continuous = spectr.generate(*pair, prompts, max_new_tokens=budgets, seed=seeds, batch_size=8, **kwargs)
    static_calls = 0
    for start in range(0, 40, 8):  # static batches of 8, one after another
        rows = slice(start, start + 8)
        static = spectr.generate(*pair, prompts[rows], max_new_tokens=budgets[rows], seed=seeds[rows], **kwargs)
        static_calls += static.stats.iterations
        assert static.tokens == continuous.tokens[rows]
    assert continuous.stats.iterations <= 0.7 * static_calls, (continuous.stats.iterations, static_calls)
    assert continuous.stats.admissions > 5  # slots were refilled many times
    assert continuous.stats.generated_tokens == budgets == [len(t) for t in continuous.tokens]
    assert continuous.stats.finish_reason == ["length"] * 40
    return continuous.tokens, prompts, budgets, seeds, kwargs


@pytest.mark.parametrize("method", METHODS)
def test_mixed_budgets_need_far_fewer_target_calls_than_static_batches_and_rows_are_as_alone(pair, method):
    tokens, prompts, budgets, seeds, kwargs = mixed_budget_run(pair, method)
    for row in range(0, 40, 5):  # every row equals its static batch above; these also equal a batch of one
        assert tokens[row] == alone(pair, prompts[row], budgets[row], seeds[row], **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_mixed_budgets_every_row_is_as_alone(pair, method):
    tokens, prompts, budgets, seeds, kwargs = mixed_budget_run(pair, method)
    assert tokens == [alone(pair, p, n, s, **kwargs) for p, n, s in zip(prompts, budgets, seeds)]


def test_rows_admitted_mid_run_stop_at_eos_as_they_do_alone(pair):
    prompts, seeds = random_prompts(12, 2), list(range(12))
    kwargs = dict(method="spectr", eos_token_id=[5, 9], **SETTINGS)
    budgets = [3, 25, 11, 40] * 3
    out = spectr.generate(*pair, prompts, max_new_tokens=budgets, seed=seeds, batch_size=3, **kwargs)
    assert "eos" in out.stats.finish_reason and "length" in out.stats.finish_reason
    for tokens, reason, budget in zip(out.tokens, out.stats.finish_reason, budgets):
        assert len(tokens) <= budget and (reason == "length") == (len(tokens) == budget and tokens[-1] not in (5, 9))
    assert out.tokens == [alone(pair, p, n, s, **kwargs) for p, n, s in zip(prompts, budgets, seeds)]


# --- the streaming form (what an actor calls) ------------------------------------------------------


def test_an_actor_feeds_the_next_shard_into_free_slots_and_reports_rows_as_they_finish(pair):
    prompts = random_prompts(12, 3)
    budgets = [4, 6, 5, 40, 3, 4] + [3, 5, 4, 6, 3, 2]  # shard a ends with a long row
    kwargs = dict(method="spectr", num_drafts=2, draft_length=3)
    batcher = ContinuousBatcher(*pair, batch_size=4, max_length=64, **kwargs)
    shards = [(name, prompts[i : i + 6], budgets[i : i + 6]) for name, i in (("a", 0), ("b", 6))]
    seen, admitted_b_after = [], None
    name, shard, shard_budgets = shards[0]
    ids = batcher.admit(shard, max_new_tokens=shard_budgets, seed=700, tags=[(name, i) for i in range(6)])
    assert ids == list(range(6)) and batcher.waiting == 6 and batcher.in_flight == 0
    while not batcher.idle:
        seen += batcher.step()
        if admitted_b_after is None and batcher.waiting == 0:  # shard a is all in slots: queue shard b
            name, shard, shard_budgets = shards[1]
            assert batcher.admit(shard, max_new_tokens=shard_budgets, seed=800,
                                 tags=[(name, i) for i in range(6)]) == list(range(6, 12))
            admitted_b_after = len(seen)
    tags = [row.tag for row in seen]
    assert sorted(tags) == sorted((n, i) for n in "ab" for i in range(6))
    last_of_a = max(i for i, tag in enumerate(tags) if tag[0] == "a")
    first_of_b = min(i for i, tag in enumerate(tags) if tag[0] == "b")
    assert admitted_b_after < last_of_a and first_of_b < last_of_a  # shard b ran beside shard a's long row
    for row in seen:
        shard_index = 0 if row.tag[0] == "a" else 6
        seed = (700 if row.tag[0] == "a" else 800) + row.tag[1]
        prompt, budget = prompts[shard_index + row.tag[1]], budgets[shard_index + row.tag[1]]
        assert row.request == shard_index + row.tag[1]
        assert row.tokens == alone(pair, prompt, budget, seed, **kwargs) and row.generated_tokens == budget
    # a shard's statistics are the sums of its own rows, whoever shared the batch
    shard_a = GenerationStats(method="spectr", num_drafts=2, draft_length=3)
    for row in sorted((r for r in seen if r.tag[0] == "a"), key=lambda r: r.request):
        shard_a.add_row(row)
    whole = spectr.generate(*pair, prompts[:6], max_new_tokens=budgets[:6], seed=700, **kwargs).stats
    assert shard_a.target_calls == whole.target_calls
    assert shard_a.accepted_per_position == whole.accepted_per_position
    assert shard_a.tokens_per_call_histogram == whole.tokens_per_call_histogram
    assert shard_a.tested_positions == whole.tested_positions and shard_a.tree_nodes == whole.tree_nodes


# --- the cache pool ------------------------------------------------------------------------------


def pool_tensors(batcher: ContinuousBatcher) -> list[torch.Tensor]:
    records = batcher.records
    tensors = [batcher.target_cache.rows.buffer, batcher.target_cache.rows.lengths, records.tokens,
               records.lengths, records.histogram]
    if batcher.rows.drafter is not None:
        tensors += [batcher.rows.drafter.cache.rows.buffer, batcher.rows.drafter.cache.rows.lengths]
    return tensors


# autoregressive: slow (time for tests/spectr/test_split.py); spectr, which holds both models' caches, stays
@pytest.mark.parametrize("method", [pytest.param("autoregressive", marks=pytest.mark.slow), "spectr"])
def test_the_cache_pool_is_allocated_once_and_does_not_grow_over_10_consecutive_batches(pair, method):
    batcher = ContinuousBatcher(*pair, batch_size=4, max_length=48, method=method, num_drafts=2, draft_length=3)
    generator = torch.Generator().manual_seed(9)
    allocated, pointers = [], []
    for batch in range(10):
        prompts = random_prompts(8, 100 + batch)
        budgets = torch.randint(1, 30, (8,), generator=generator).tolist()
        batcher.admit(prompts, max_new_tokens=budgets, seed=1000 * batch)
        rows = list(batcher.finished())
        assert sorted(len(r.tokens) for r in rows) == sorted(budgets)
        allocated.append(batcher.pool_nbytes)
        pointers.append(tuple(t.untyped_storage().data_ptr() for t in pool_tensors(batcher)))
    assert len(set(allocated)) == 1 and len(set(pointers)) == 1, allocated
    # B x capacity: 4 slots x (max_length + the widest tree) per model, nothing more
    buffer = batcher.target_cache.rows.buffer
    tree = 0 if method == "autoregressive" else 2 * 3
    assert buffer.shape[2] == 4 and buffer.shape[4] == 48 + 1 + tree
    assert batcher.pool_nbytes < 1.2 * sum(t.untyped_storage().nbytes() for t in pool_tensors(batcher)[:1]) + 2e5
    assert batcher.loop.timer._events == [] and batcher.in_flight == 0 and batcher.idle


def _poison_row_keys_once(model, row: int, at_call: int):
    """NaN keys of batch row `row` from layer 0 in one forward: its cache slot then holds NaN."""
    calls = {"n": 0}

    def hook(module, args, output):
        calls["n"] += 1
        if calls["n"] != at_call:
            return output
        output = output.clone()
        output[row] = float("nan")
        return output

    return model.model.layers[0].self_attn.k_proj.register_forward_hook(hook)


@pytest.mark.parametrize("zeroed", [True, False], ids=["slot zeroed", "negative control: not zeroed"])
def test_a_slot_left_with_non_finite_entries_is_zeroed_before_the_next_prompt(pair, monkeypatch, zeroed):
    """Prompt 0 fails with NaN keys in its cache; prompt 2 takes its slot while prompt 1, longer, keeps
    the attended view wide enough to cover the stale NaN slot (masked for prompt 2)."""
    target, _ = pair
    prompts, budgets, seeds = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2], [5, 6]], [30, 60, 30], [1, 2, 3]
    if not zeroed:
        reset = RowKVCache.reset_rows
        monkeypatch.setattr(RowKVCache, "reset_rows", lambda self, rows, zero=False: reset(self, rows))
    handle = _poison_row_keys_once(target, row=0, at_call=12)  # call 1 is the prefill: the 11th iteration
    try:
        out = spectr.generate(target, None, prompts, method="autoregressive", max_new_tokens=budgets, seed=seeds,
                              batch_size=2)
    finally:
        handle.remove()
    assert out.stats.finish_reason[0] == "error" and "row 0: the target model" in out.stats.errors[0]
    assert len(out.tokens[0]) == 10 and out.stats.finish_reason[1] == "length"
    clean = alone(pair, prompts[2], 30, seeds[2], method="autoregressive")
    if zeroed:
        assert out.tokens[2] == clean and out.stats.finish_reason[2] == "length"
    else:  # the stale NaN entries behind the mask poison the next occupant of the slot
        assert out.stats.finish_reason[2] == "error"


# --- bad input ---------------------------------------------------------------------------------


def test_admit_refuses_bad_rows_by_argument_and_row_and_queues_nothing(pair):
    batcher = ContinuousBatcher(*pair, batch_size=2, max_length=20, method="spectr")
    cases = [
        (dict(prompts=[[1], [2]], max_new_tokens=[3, 0]), r"max_new_tokens\[1\] \(prompt 1\) must be an int >= 1"),
        (dict(prompts=[[1], [2]], max_new_tokens=[3, 2.0]), r"max_new_tokens\[1\] \(prompt 1\)"),
        (dict(prompts=[[1], [2]], max_new_tokens=[3]), r"max_new_tokens has 1 entries but there are 2 prompts"),
        (dict(prompts=[[1], [2]], seed=[1, None]), r"seed\[1\] \(prompt 1\) must be an int"),
        (dict(prompts=[[1], [2]], tags=["x"]), r"tags has 1 entries but there are 2 prompts"),
        (dict(prompts=[[1], [1] * 15], max_new_tokens=6), r"prompt 1: 15 prompt tokens \+ max_new_tokens 6 = 21 "
                                                          r"exceeds the batcher's max_length 20"),
        (dict(prompts=[[1], []]), r"prompt 1 is empty"),
    ]
    for arguments, message in cases:
        prompts = arguments.pop("prompts")
        with pytest.raises(ValueError, match=message):
            batcher.admit(prompts, **({"max_new_tokens": 3} | arguments))
    assert batcher.waiting == 0 and batcher.idle and list(batcher.finished()) == []
    for batch_size in (0, -1, 2.0, None):
        with pytest.raises(ValueError, match=r"batch_size must be an int >= 1"):
            ContinuousBatcher(*pair, batch_size=batch_size)
    with pytest.raises(ValueError, match=r"max_length must be an int >= 2"):
        ContinuousBatcher(*pair, batch_size=2, max_length=1)
    assert ContinuousBatcher(*pair, batch_size=2, max_length=10_000).max_length == 128  # the models' positions


def test_the_batcher_leaves_models_in_their_training_mode_and_reports_its_run(pair):
    target, draft = pair
    batcher = ContinuousBatcher(target, draft, batch_size=2, max_length=40, method="spectr", num_drafts=2,
                                draft_length=2)
    target.train()
    try:
        batcher.admit(random_prompts(5, 4), max_new_tokens=[3, 9, 4, 7, 2], seed=5)
        rows = list(batcher.finished())
        assert target.training and not draft.training
    finally:
        target.eval()
    assert sorted(r.request for r in rows) == list(range(5)) and all(r.error is None for r in rows)
    stats = batcher.snapshot()
    assert stats.iterations >= 25 / (2 * 3) and stats.admissions >= 3 and stats.wall_seconds > 0
    assert stats.target_seconds > 0 and stats.draft_seconds > 0


def _run(batcher, prompts, budget, watch_until=None):
    """Rows by request; with `watch_until` {request: n}, each such row is ended once it has n tokens."""
    batcher.watch_tokens = watch_until is not None
    batcher.admit(prompts, max_new_tokens=budget, seed=list(range(len(prompts))))
    seen, out = {}, {}
    while not batcher.idle:
        finished = batcher.step()
        if watch_until is not None:
            for request, tokens in batcher.recent_tokens.items():
                seen[request] = seen.get(request, []) + tokens
            stop = [r for r, n in watch_until.items() if len(seen.get(r, [])) >= n and r not in out]
            finished += batcher.finish_rows(stop)
        out.update({row.request: row for row in finished})
    return out, seen


def test_finish_rows_ends_a_row_early_from_the_tokens_of_the_iteration_copy(pair):
    """Watching, each iteration's new tokens come back with its one host copy (no extra sync); a row ended
    with finish_rows has the first tokens of its full run, fewer target calls, reason "stop"; the other rows
    and the next admissions are as unwatched."""
    from spectr.diagnostics import HostSyncCounter

    prompts = random_prompts(3, seed=21)
    make = lambda: ContinuousBatcher(*pair, batch_size=2, max_length=64, **SETTINGS)  # noqa: E731
    with HostSyncCounter() as plain_syncs:
        full, _ = _run(make(), prompts, 16)
    with HostSyncCounter() as watched_syncs:
        watched, seen = _run(make(), prompts, 16, watch_until={})
    assert {r: row.tokens for r, row in watched.items()} == {r: row.tokens for r, row in full.items()}
    assert all(seen[r] == full[r].tokens for r in full)  # recent_tokens add up to every row's output
    assert watched_syncs.total == plain_syncs.total  # the tokens rode the existing copy
    stopped, _ = _run(make(), prompts, 16, watch_until={0: 5})
    assert stopped[0].finish_reason == "stop" and stopped[0].tokens[:5] == full[0].tokens[:5]
    assert len(stopped[0].tokens) < len(full[0].tokens) and stopped[0].target_calls < full[0].target_calls
    for r in (1, 2):  # the row that took slot 0 next, and the others, are as in the full run
        assert stopped[r].tokens == full[r].tokens and stopped[r].finish_reason == full[r].finish_reason
    assert make().finish_rows([7]) == []  # not running: ignored
