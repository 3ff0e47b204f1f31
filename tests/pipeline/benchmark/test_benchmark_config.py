"""Benchmark configuration: the real conf/benchmark.yaml composes and validates; the grid expands as documented."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from pipeline.benchmark.config import (
    BenchCase,
    GridConfig,
    bench_config_from_dict,
    bench_config_from_omegaconf,
    expand_grid,
)
from pipeline.errors import JobInputError

CONF = str(Path(__file__).resolve().parents[3] / "conf")


def composed(*overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="benchmark", overrides=list(overrides))


def test_default_config_composes_with_the_main_jobs_groups():
    config = bench_config_from_omegaconf(composed())
    assert config.model.target.endswith("assets/models/target")
    assert config.data.path.endswith("assets/prompts.jsonl")
    assert config.mlflow.experiment == "spectr-benchmark"
    g = config.bench
    assert g.num_drafts == (1, 2, 4, 8) and g.draft_lengths == (2, 4, 8) and g.batch_sizes == (1, 16)
    assert g.repeats >= 3 and g.temperature == 1.0 and g.top_k == 0
    smoke = bench_config_from_omegaconf(composed("bench=smoke")).bench
    assert smoke.repeats == 1 and smoke.optimality.max_drafts == 3  # smoke overrides only what it changes
    assert smoke.assisted_tokens == g.assisted_tokens


def test_default_grid():
    cases = expand_grid(GridConfig())
    at_one = [c for c in cases if c.batch_size == 1]
    at_sixteen = [c for c in cases if c.batch_size == 16]
    # per batch size: hf_generate, autoregressive, 3 x (speculative, block), 3 x 3 x (spectr, specinfer);
    # + assisted at B=1
    assert len(at_one) == 2 + 1 + 6 + 18 and len(at_sixteen) == 1 + 1 + 6 + 18
    assert {c.draft_length for c in cases if c.method == "block"} == {2, 4, 8}
    assert BenchCase("hf_assisted", 1, 1, 4) in at_one
    assert not any(c.method == "hf_assisted" for c in at_sixteen)
    assert not any(c.method in ("spectr", "specinfer") and c.num_drafts == 1 for c in cases)
    assert {(c.num_drafts, c.draft_length) for c in cases if c.method == "spectr"} == {
        (k, length) for k in (2, 4, 8) for length in (2, 4, 8)
    }


def test_speculative_comes_from_k_equals_one_when_not_listed():
    cases = expand_grid(GridConfig(methods=("spectr",), num_drafts=(1, 4), draft_lengths=(4,), batch_sizes=(1,)))
    assert cases == [BenchCase("speculative", 1, 1, 4), BenchCase("spectr", 1, 4, 4)]


def raw(**bench) -> dict:
    return {"model": {"target": "/t", "draft": "/d"}, "data": {"path": "/p.jsonl"}, "bench": bench}


@pytest.mark.parametrize(
    "bench, message",
    [
        ({"methods": ["spectr", "beam"]}, r"bench.methods\[1\] = 'beam'"),
        ({"num_drafts": [2, 0]}, r"bench.num_drafts\[1\] must be an int >= 1"),
        ({"repeats": 0}, "bench.repeats must be >= 1"),
        ({"top_p": 1.5}, r"bench.top_p must be in \(0, 1\]"),
        ({"temperature": 0.0}, "spectr or specinfer run with K >= 2"),
        ({"temperature": 0.0, "methods": ["hf_assisted", "speculative"]}, "hf_assisted"),
        ({"optimality": {"max_drafts": 0}}, "bench.optimality.max_drafts must be >= 1"),
        ({"cost_model": {"latency_batch_sizes": []}}, "bench.cost_model.latency_batch_sizes"),
        ({"grid": 3}, "unknown key.*bench.grid"),
        ({"num_drafts": [2, "x"]}, r"bench.num_drafts\[1\] must be int"),
        ({"batch_sizes": 4}, "bench.batch_sizes must be a non-empty list of ints"),
        ({"ignore_eos": "yes"}, "bench.ignore_eos must be bool"),
        ({"optimality": {"maxdrafts": 3}}, "unknown key.*bench.optimality.maxdrafts"),
        ({"cost_model": {"calibration_repeats": 0}}, "bench.cost_model.calibration_repeats must be >= 1"),
        ({"cost_model": 5}, "'bench.cost_model' must be a mapping"),
    ],
)
def test_bad_bench_values_name_the_key(bench, message):
    with pytest.raises(JobInputError, match=message):
        bench_config_from_dict(raw(**bench))


def test_lists_are_sorted_and_deduplicated():
    g = bench_config_from_dict(raw(num_drafts=[4, 2, 4], methods=["spectr", "spectr", "autoregressive"])).bench
    assert g.num_drafts == (2, 4) and g.methods == ("spectr", "autoregressive")


def test_shared_sections_use_the_main_jobs_rules():
    bad = raw()
    bad["model"]["dtype"] = "float8"
    with pytest.raises(JobInputError, match="model.dtype"):
        bench_config_from_dict(bad)
    with pytest.raises(JobInputError, match="device"):
        bench_config_from_dict({**raw(), "device": "tpu"})
