"""The actor's continuous batch across its shards (`pipeline.generate.feed`), driven without Ray: shards run
on threads as a threaded actor runs them. Structural counts only (batched target calls, allocations), no
timing."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from tiny_pair_support import WORDS, job_config

import spectr
from pipeline.config import ModelConfig
from pipeline.generate.config import SpectrConfig, from_dict
from pipeline.generate.output import output_schema
from pipeline.generate.plan import prepare
from pipeline.generate.shards import Shard, cut_shards
from pipeline.generate.worker import ShardGenerator, WorkerJob
from pipeline.models import load_tokenizer, tokenize

SETTINGS = dict(method="spectr", num_drafts=2, draft_length=3, temperature=1.0, top_k=0, top_p=1.0)


def prompts_of(count: int, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 10))) for _ in range(count)]


def generator_for(tiny_pair, batch_size: int, method: str = "spectr") -> ShardGenerator:
    model = ModelConfig(target=str(tiny_pair["target"]), draft=str(tiny_pair["draft"]))
    config = SpectrConfig(**{**SETTINGS, "method": method}, max_new_tokens=8, batch_size=batch_size, seed=0)
    return ShardGenerator(model, config, num_threads=1)


def shards_of(tiny_pair, prompts: list[str], shard_size: int, budgets: list[int] | None = None) -> list[Shard]:
    tokenizer = load_tokenizer(tiny_pair["target"], "model.target", False)
    ids = [f"r{i:03d}" for i in range(len(prompts))]
    return cut_shards(ids, prompts, tokenize(tokenizer, prompts, True), shard_size, 0, budgets)


def run_concurrently(generator: ShardGenerator, shards: list[Shard]) -> list:
    """Every shard on its own thread, as a threaded actor runs its queued shards."""
    results: list = [None] * len(shards)
    errors: list = []

    def run(k: int) -> None:
        try:
            results[k] = generator(shards[k])
        except BaseException as err:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(shards))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    return results


def alone(generator: ShardGenerator, shard: Shard, i: int, budget: int) -> list[int]:
    out = spectr.generate(
        generator.target, generator.draft, [shard.prompt_token_ids[i]], **SETTINGS, max_new_tokens=budget,
        eos_token_id=generator.eos_token_id, seed=[shard.seeds[i]],
    )  # fmt: skip
    return out.tokens[0]


def static_batched_target_calls(rows: list[dict], batch_size: int) -> int:
    """What static batches of `batch_size` of one shard cost: each runs until its longest row is done."""
    return sum(max(r["target_calls"] for r in rows[k : k + batch_size]) for k in range(0, len(rows), batch_size))


def test_mixed_budgets_across_shards_take_fewer_batched_calls_and_keep_every_row(tiny_pair):
    """Budgets alternating 2 and 30 (the per-row column) over 3 shards of 12 run at once on one actor with 8
    rows in flight: fewer batched target calls than static batches of 8 per shard; every row is the prompt
    run alone; every budget is respected."""
    prompts = prompts_of(36)
    budgets = [2 if i % 2 == 0 else 30 for i in range(36)]
    shards = shards_of(tiny_pair, prompts, 12, budgets)
    generator = generator_for(tiny_pair, batch_size=8)
    results = run_concurrently(generator, shards)
    continuous = sum(r.stats["iterations"] for r in results)
    static = sum(static_batched_target_calls(r.rows, 8) for r in results)
    assert continuous < 0.8 * static, (continuous, static)
    for shard, result in zip(shards, results):
        for i, row in enumerate(result.rows):
            budget = shard.max_new_tokens[i]
            assert row["error"] is None and row["completion_tokens"] <= budget
            assert row["finish_reason"] == "stop" or row["completion_tokens"] == budget
            assert row["completion_token_ids"] == alone(generator, shard, i, budget), (shard.index, i)
        assert result.stats["target_calls"] == sum(r["target_calls"] for r in result.rows)
    assert generator.feed.allocations == 1


def test_the_pool_is_allocated_once_across_shards(tiny_pair):
    """Shards one after another and several at once: one batcher, one cache pool of constant size."""
    generator = generator_for(tiny_pair, batch_size=4)
    shards = shards_of(tiny_pair, prompts_of(30, seed=1), 5, [3 + (i % 5) * 4 for i in range(30)])
    generator(shards[0])
    pool = generator.feed.batcher.pool_nbytes
    for shard in shards[1:3]:
        generator(shard)
    run_concurrently(generator, shards[3:])
    assert generator.feed.allocations == 1 and generator.feed.batcher.pool_nbytes == pool


def test_rows_do_not_depend_on_batch_size_or_on_the_other_shards(tiny_pair):
    prompts = prompts_of(16, seed=2)
    shards = shards_of(tiny_pair, prompts, 8, [1 + (i * 7) % 20 for i in range(16)])
    tokens = []
    for batch_size, together in ((2, False), (8, True)):
        generator = generator_for(tiny_pair, batch_size)
        results = run_concurrently(generator, shards) if together else [generator(s) for s in shards]
        tokens.append([r["completion_token_ids"] for result in results for r in result.rows])
    assert tokens[0] == tokens[1]


def test_a_shard_is_written_while_the_next_is_still_in_flight(tiny_pair, tmp_path):
    """Shard 0 (budgets of 2) and shard 1 (budgets of 30) share the batch: shard 1's rows are admitted before
    shard 0 ends, shard 0's part file is on disk when its call returns, and shard 1 is still generating."""
    rows = [{"id": i, "prompt": p, "budget": 2 if i < 3 else 30} for i, p in enumerate(prompts_of(6, seed=3))]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = job_config(tiny_pair, data, tmp_path / "out", shard_size=3, **{"data.max_new_tokens_column": "budget"})
    plan = prepare(from_dict(raw))
    out = tmp_path / "out"
    out.mkdir()
    job = WorkerJob(plan.config.data, plan.source, str(out), 6, output_schema(plan.id_kind))
    generator = generator_for(tiny_pair, batch_size=8)
    generator.job = job
    events: list[tuple[str, int]] = []
    admit = generator.feed._admit

    def logged_admit(take):
        events.extend(("admitted", run.index) for run, _ in take)
        return admit(take)

    generator.feed._admit = logged_admit

    def run(index: int) -> None:
        result = generator.generate_shard(plan.shard(index))  # its part: named for the run and attempt
        events.append(("written" if (out / result.file).exists() else "missing", index))

    threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert events.index(("written", 0)) < events.index(("written", 1))
    assert events.index(("admitted", 1)) < events.index(("written", 0)), events


def _raise_on_prefill(model, start: list[int], times: int):
    """A pre-forward hook that raises, at most `times` times, when a row of the input starts with `start`
    (a prompt's prefill: the iterations' inputs start with the pending token, not the prompt's BOS)."""
    calls = {"n": 0}
    start_ids = torch.tensor(start)

    def hook(module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        hit = input_ids.shape[1] >= len(start) and (input_ids[:, : len(start)] == start_ids).all(dim=1).any()
        if hit and calls["n"] < times:
            calls["n"] += 1
            raise RuntimeError("injected failure")

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def test_a_failing_step_reruns_its_rows_alone_so_only_the_failing_row_errs(tiny_pair):
    """A step raises while a row with a poisoned token is in the batch: the rows of the batch are re-run one
    by one, the poisoned row (which fails alone too) gets the error, the others their usual tokens; the
    next rows go into a fresh batcher."""
    prompts = prompts_of(10, seed=4)
    prompts[3] = "open file line"  # "open" appears in no other prompt
    assert all("open" not in p for k, p in enumerate(prompts) if k != 3)
    shards = shards_of(tiny_pair, prompts, 10, [6] * 10)
    expected = [r["completion_token_ids"] for r in generator_for(tiny_pair, 4)(shards[0]).rows]
    generator = generator_for(tiny_pair, batch_size=4)
    handle = _raise_on_prefill(generator.target, shards[0].prompt_token_ids[3][:2], times=2)
    try:
        rows = generator(shards[0]).rows
    finally:
        handle.remove()
    assert rows[3]["finish_reason"] == "error" and "RuntimeError: injected failure" in rows[3]["error"]
    good = [k for k in range(10) if k != 3]
    assert [rows[k]["completion_token_ids"] for k in good] == [expected[k] for k in good]
    assert all(rows[k]["error"] is None for k in good)
    assert generator.feed.allocations == 2  # the failed batcher was replaced once


@pytest.mark.parametrize("method", ["spectr", "autoregressive"])
def test_non_finite_logits_write_the_engines_message_in_the_error_column(tiny_pair, method):
    """A target whose logits are NaN: every row stops with finish_reason "error" and the engine's message
    (which model, non-finite logits) in `error`, not null."""
    generator = generator_for(tiny_pair, batch_size=4, method=method)
    shard = shards_of(tiny_pair, prompts_of(5, seed=5), 5)[0]

    def nan_logits(module, args, output):
        return output * float("nan")

    handle = generator.target.lm_head.register_forward_hook(nan_logits)
    try:
        result = generator(shard)
    finally:
        handle.remove()
    for row in result.rows:
        assert row["finish_reason"] == "error", row
        assert "target model" in row["error"] and "non-finite logits" in row["error"]
    assert result.failed == 5 and result.stats["prompts_failed"] == 5


def test_auto_runs_one_pool_whose_configuration_changes_per_iteration(tiny_pair):
    """method=auto: shards at once through ONE pool (no calibration, no drain, no rebuild); every token the
    batch made is charged to exactly one configuration; each part's plan is the mix while its rows were in
    the batch; the actor's chooser state is handed back for the plan cache; nothing is wasted."""
    generator = generator_for(tiny_pair, batch_size=4, method="auto")
    feed = generator.feed
    feed.max_budget = 12  # as generate_shard sets it from the scan: no pool growth here
    shards = shards_of(tiny_pair, prompts_of(12, seed=7), 4, [3 + (5 * i) % 10 for i in range(12)])
    results = run_concurrently(generator, shards)
    assert feed.allocations == 1 and type(feed.batcher).__name__ == "AutoBatcher"
    assert all(row["error"] is None for r in results for row in r.rows)
    generated = sum(r.stats["generated_tokens"] for r in results)
    charged: dict[str, int] = {}
    for r in results:
        for label, tokens in r.stats.get("tokens_by_config", {}).items():
            charged[label] = charged.get(label, 0) + tokens
        assert r.stats["wasted_seconds"] == 0.0 and r.stats["plan"] in {c.label for c in feed.batcher.chooser.candidates}
        assert r.plan["method"] == "auto" and sum(r.plan["shares"].values()) == pytest.approx(1.0)
        assert r.plan["description"].startswith("auto: ")
    assert sum(charged.values()) == generated  # every token under exactly one configuration
    assert charged == feed.batcher.chooser.tokens_by_config()
    assert len(charged) > 1  # the chooser tried more than one configuration on these rows
    state = results[-1].planner_state
    assert state["key"].endswith("|cpu|float32") and state["state"] == feed.batcher.chooser.state()
    json.dumps(state)  # it travels to the driver and into the cache as JSON


def test_auto_starts_from_a_cached_state_of_its_own_device(tiny_pair):
    """The warm start: the feed picks the cached state whose key is its pair, device and dtype, and the chooser
    starts from it (it measured autoregressive and speculative L=1 already: no exploration of those)."""
    learner = generator_for(tiny_pair, batch_size=2, method="auto")
    learner.feed.pair_key = "pair"
    shards = shards_of(tiny_pair, prompts_of(6, seed=3), 6, [8] * 6)
    learned = learner(shards[0]).planner_state
    warm = generator_for(tiny_pair, batch_size=2, method="auto")
    warm.feed.pair_key = "pair"
    warm.feed.warm_states = {learned["key"]: learned["state"], "pair|NVIDIA H200|bfloat16": {"version": -1}}
    warm(shards[0])
    cold = generator_for(tiny_pair, batch_size=2, method="auto")
    cold(shards[0])
    first_warm = warm.feed.batcher.chooser.timeline[0].config
    first_cold = cold.feed.batcher.chooser.timeline[0].config
    assert first_cold == "autoregressive"  # a cold chooser measures its baseline first
    known = set(learned["state"]["buckets"].get("2", {}))
    assert known and (first_warm != "autoregressive" or len(known) == 1)


def test_a_row_longer_than_the_pool_grows_it_after_a_drain(tiny_pair):
    """The pool is sized for the first shard (budgets of 2); a later shard's budgets of 40 need more
    positions: the batch drains, a bigger pool is built once, and the rows are still those run alone."""
    generator = generator_for(tiny_pair, batch_size=4)
    shards = shards_of(tiny_pair, prompts_of(8, seed=8), 4, [2] * 4 + [40] * 4)
    generator(shards[0])
    small = generator.feed.batcher.max_length
    result = generator(shards[1])
    assert generator.feed.allocations == 2 and generator.feed.batcher.max_length > small
    for i, row in enumerate(result.rows):
        assert row["completion_token_ids"] == alone(generator, shards[1], i, 40)


def test_a_failure_charges_the_driving_shard_and_stops_its_neighbours_uncharged(tiny_pair):
    """Building the batch fails (a sticky device error): the shard whose thread drove fails with the error;
    the other shard in the feed stops with `FeedAborted` (the driver re-queues it without an attempt)."""
    from pipeline.generate.feed import FeedAborted

    shards = shards_of(tiny_pair, prompts_of(8, seed=5), 4)
    generator = generator_for(tiny_pair, batch_size=4)

    feed = generator.feed

    def broken(config):
        for _ in range(3000):  # until the other shard is in the feed too (at most 30 s)
            with feed._cond:
                if len(feed._open) + len(feed._incoming) >= 2:
                    break
            threading.Event().wait(0.01)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    feed._build = broken
    errors: list[BaseException] = []

    def run(shard):
        try:
            generator(shard)
        except BaseException as err:  # noqa: BLE001 - collected for the assertions
            errors.append(err)

    threads = [threading.Thread(target=run, args=(shard,)) for shard in shards]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(type(err).__name__ for err in errors) == ["FeedAborted", "RuntimeError"]
    assert "CUDA error" in str(next(err for err in errors if not isinstance(err, FeedAborted)))


def test_a_stop_string_ends_its_row_early_not_only_cuts_it(tiny_pair):
    """A stop string spanning two tokens, found in the tokens each iteration already copied back, ends the
    row then: the same cut completion as a run to the budget, in fewer target calls, while the other rows
    run as before. Control: without the feed's decode (no early end) the row runs to its budget."""
    from pipeline.stops import cut_at_stop

    model = ModelConfig(target=str(tiny_pair["target"]), draft=str(tiny_pair["draft"]))

    def generator(stop):
        config = SpectrConfig(**SETTINGS, max_new_tokens=40, batch_size=2, seed=0, stop=stop)
        return ShardGenerator(model, config, num_threads=1)

    shard = shards_of(tiny_pair, prompts_of(3, seed=5), 3)[0]
    full = generator(None)(shard).rows
    plain = generator(None)
    tokens = full[0]["completion_token_ids"]
    stop = plain._decode(tokens[4:6])  # spans two tokens, well before the budget
    expected = cut_at_stop(plain._decode, tokens, [stop])
    assert stop.strip() and expected is not None and expected.num_tokens < 30
    early = generator([stop])
    rows = early(shard).rows
    late = generator([stop])
    late.feed.decode = None  # the control: cut afterwards only
    control = late(shard).rows
    for got in (rows[0], control[0]):
        assert got["finish_reason"] == "stop" and got["completion"] == expected.text
        assert got["completion_token_ids"] == tokens[: expected.num_tokens]
    assert rows[0]["target_calls"] < control[0]["target_calls"] == full[0]["target_calls"]
    for other in (1, 2):  # rows without the stop in their text: as in the run without stop strings
        if stop not in full[other]["completion"]:
            assert rows[other]["completion_token_ids"] == full[other]["completion_token_ids"]


def test_a_stop_string_ends_its_row_early_under_auto(tiny_pair):
    """method=auto: the stop path ends the row through the AutoBatcher's own batcher (`finish_rows`), and the
    row comes back finished by the stop, cut before it. Greedy, so that the tokens do not depend on the
    configurations the chooser picks. Control: the same run without the feed's decode never calls
    finish_rows, and its row runs to its budget (more tokens generated before the cut)."""
    from pipeline.stops import cut_at_stop

    model = ModelConfig(target=str(tiny_pair["target"]), draft=str(tiny_pair["draft"]))

    def generator(stop):
        config = SpectrConfig(**{**SETTINGS, "method": "auto", "temperature": 0.0}, max_num_drafts=2,
                              max_draft_length=3, max_new_tokens=20, batch_size=2, seed=0, stop=stop)
        return ShardGenerator(model, config, num_threads=1)

    shard = shards_of(tiny_pair, prompts_of(2, seed=5), 2)[0]
    plain = generator(None)
    full = plain(shard).rows
    tokens = full[0]["completion_token_ids"]
    stop = plain._decode(tokens[3:5])
    expected = cut_at_stop(plain._decode, tokens, [stop])
    assert stop.strip() and expected is not None and expected.num_tokens < 12

    def run(decode: bool):
        gen = generator([stop])
        if not decode:
            gen.feed.decode = None
        ended: list = []
        original = gen.feed._build

        def build(config):  # spy on the inner batcher's finish_rows, whichever batcher the feed builds
            original(config)
            engine = gen.feed.batcher.batcher  # the AutoBatcher's ContinuousBatcher
            finish = engine.finish_rows

            def finish_rows(requests):
                finished = finish(requests)
                ended.extend(finished)
                return finished

            engine.finish_rows = finish_rows

        gen.feed._build = build
        return gen(shard).rows, ended

    rows, ended = run(decode=True)
    control, none = run(decode=False)
    assert [r.finish_reason for r in ended] == ["stop"] and not none
    assert len(ended[0].tokens) < full[0]["completion_tokens"]  # it ended before its budget
    for got in (rows[0], control[0]):
        assert got["finish_reason"] == "stop" and got["completion"] == expected.text
        assert got["completion_token_ids"] == tokens[: expected.num_tokens]


def _sick_forward(model):
    """The model's forward raises like a GPU with a sticky error, whatever it runs."""
    import functools

    @functools.wraps(model.forward)  # the same signature, which the engine checks
    def sick(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    model.forward = sick


def test_a_device_that_fails_every_row_and_a_probe_is_the_actors_fault_not_the_rows(tiny_pair):
    """Every forward raises (a sticky device error): the batch fails, each row fails alone too, and so does the
    one-token probe, so the shard fails with `ActorFault` (the driver re-queues it uncharged and restarts the
    actor) instead of returning error rows for a healthy shard."""
    from pipeline.generate.feed import ActorFault

    shards = shards_of(tiny_pair, prompts_of(6, seed=6), 6)
    generator = generator_for(tiny_pair, batch_size=4)
    _sick_forward(generator.target)
    with pytest.raises(ActorFault, match="one-token probe: RuntimeError: CUDA error"):
        generator(shards[0])
