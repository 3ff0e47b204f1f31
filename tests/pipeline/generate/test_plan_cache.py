"""The planner's warm start (`pipeline.generate.plan_cache`) and the configuration mix (`pipeline.generate.mix`),
without Ray or models: keys, where entries live, which wins, and that a broken cache never fails a job."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from pipeline import fs
from pipeline.generate import plan_cache
from pipeline.generate.config import SpectrConfig, from_dict, generation_settings
from pipeline.generate.mix import ConfigMix, metric_name


def fake_plan(tmp_path, **spectr) -> SimpleNamespace:
    config = SimpleNamespace(spectr=SpectrConfig(**spectr), model=SimpleNamespace(dtype="auto"))
    output = fs.resolve(str(tmp_path / "out"), "output_dir")
    fs.make_dirs(output)
    return SimpleNamespace(config=config, settings={"models": {"target": "t1", "draft": "d1"}}, output=output)


@pytest.fixture
def user_cache(tmp_path, monkeypatch):
    folder = tmp_path / "user-cache"
    monkeypatch.setenv("SPECTR_CACHE_DIR", str(folder))
    return folder


def test_pair_key_covers_models_bounds_batch_and_warps(tmp_path):
    plan = fake_plan(tmp_path)
    key = plan_cache.pair_key(plan)
    assert key == plan_cache.pair_key(fake_plan(tmp_path))
    for change in ({"batch_size": 1}, {"temperature": 0.7}, {"top_p": 0.9}, {"max_num_drafts": 2},
                   {"compile": True}, {"compile": False}):
        assert plan_cache.pair_key(fake_plan(tmp_path, **change)) != key, change
    other = fake_plan(tmp_path)
    other.settings = {"models": {"target": "t2", "draft": "d1"}}
    assert plan_cache.pair_key(other) != key
    assert plan_cache.entry_key(key, "cpu", "float32") != plan_cache.entry_key(key, "NVIDIA H200", "float32")


def test_states_round_trip_through_both_places(tmp_path, user_cache):
    plan = fake_plan(tmp_path)
    pair = plan_cache.pair_key(plan)
    assert plan_cache.load_states(plan, pair) == {}
    key = plan_cache.entry_key(pair, "cpu", "float32")
    plan_cache.save_states(plan, pair, {key: {"learned": [1, 2]}})
    assert plan_cache.load_states(plan, pair) == {key: {"learned": [1, 2]}}
    assert json.loads((tmp_path / "out" / "_plan_cache.json").read_text())[key]["state"] == {"learned": [1, 2]}
    # a later job with another output dir starts from the user cache
    fresh = fake_plan(tmp_path / "elsewhere")
    assert plan_cache.load_states(fresh, pair) == {key: {"learned": [1, 2]}}
    # another pair sees nothing of it
    assert plan_cache.load_states(fresh, "another-pair") == {}


def test_the_output_dirs_entry_wins_and_plan_cache_false_is_off(tmp_path, user_cache):
    plan = fake_plan(tmp_path)
    pair = plan_cache.pair_key(plan)
    key = plan_cache.entry_key(pair, "cpu", "float32")
    plan_cache.save_states(plan, pair, {key: {"v": "user"}})
    (tmp_path / "out" / "_plan_cache.json").write_text(json.dumps({key: {"pair": pair, "state": {"v": "output"}}}))
    assert plan_cache.load_states(plan, pair)[key] == {"v": "output"}
    off = fake_plan(tmp_path, plan_cache=False)
    assert plan_cache.load_states(off, pair) == {}
    plan_cache.save_states(off, pair, {key: {"v": "new"}})
    assert plan_cache.load_states(plan, pair)[key] == {"v": "output"}  # nothing written when off


def test_a_broken_cache_is_a_warning_never_a_failure(tmp_path, user_cache, caplog):
    plan = fake_plan(tmp_path)
    pair = plan_cache.pair_key(plan)
    user_cache.mkdir(parents=True)
    (user_cache / "plan_cache.json").write_text("{not json")
    (tmp_path / "out" / "_plan_cache.json").write_text("[1, 2]")
    with caplog.at_level(logging.WARNING):
        assert plan_cache.load_states(plan, pair) == {}
    assert "ignored" in caplog.text
    user_cache.chmod(0o500)  # the user cache cannot be written: warned, the job goes on
    try:
        plan_cache.save_states(plan, pair, {"k": {"v": 1}})
    finally:
        user_cache.chmod(0o700)
    assert json.loads((tmp_path / "out" / "_plan_cache.json").read_text())["k"]["state"] == {"v": 1}


def test_plan_cache_does_not_change_the_config_hash():
    raw = {"model": {"target": "t", "draft": "d"}, "data": {"path": "p.jsonl"}, "spectr": {}, "ray": {}, "mlflow": {}}
    on = generation_settings(from_dict(raw))
    off = generation_settings(from_dict({**raw, "spectr": {"plan_cache": False}}))
    assert on == off and "plan_cache" not in on["spectr"]  # a warm start changes the speed, never the rows


def test_config_mix_describes_what_ran():
    mix = ConfigMix()
    mix.add("speculative L=3", 81, 1.0)
    mix.add("block L=3", 12, 0.2)
    mix.add("autoregressive", 7, 0.3)
    assert mix.describe() == "auto: speculative L=3 for 81% of tokens, block L=3 12%, autoregressive 7%"
    again = ConfigMix.of(mix.to_dict()).merge(ConfigMix({"autoregressive": 100}, {"autoregressive": 1.0}))
    assert again.tokens["autoregressive"] == 107 and again.total_tokens == 200
    assert list(again.shares()) == ["autoregressive", "speculative L=3", "block L=3"]
    assert ConfigMix().describe() == "auto: no tokens yet"
    assert metric_name("spectr K=4 L=3") == "planner_share_spectr_K4_L3"
