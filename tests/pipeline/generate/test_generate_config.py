"""The typed config: the real Hydra configs compose and validate; every bad value is named."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from pipeline.config import PROJECT_ROOT
from pipeline.errors import JobInputError
from pipeline.generate.config import from_dict, from_omegaconf, generation_settings
from pipeline.hashing import stable_hash

CONF = str(Path(__file__).resolve().parents[3] / "conf")


def compose_generate(overrides: list[str]):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="generate", overrides=overrides)


def base(**overrides) -> dict:
    raw = {
        "model": {"target": "t", "draft": "d"},
        "data": {"path": "p.jsonl"},
        "spectr": {},
        "ray": {},
        "mlflow": {},
    }
    for dotted, value in overrides.items():
        section, key = dotted.split(".") if "." in dotted else (None, dotted)
        (raw[section] if section else raw)[key] = value
    return raw


def test_default_config_composes_to_the_embedded_pair_and_contract_defaults():
    config = from_omegaconf(compose_generate([]))
    assert config.model.target == str(PROJECT_ROOT / "assets/models/target")
    assert config.model.draft == str(PROJECT_ROOT / "assets/models/draft")
    assert config.data.path == str(PROJECT_ROOT / "assets/prompts.jsonl")
    assert (config.spectr.method, config.spectr.num_drafts, config.spectr.draft_length) == ("auto", 4, 4)
    assert config.spectr.max_num_drafts is None and config.spectr.max_draft_length is None
    assert config.model.dtype == "auto"
    assert config.data.prompt_column == "prompt" and config.data.id_column == "id"
    assert config.ray.address is None and config.mlflow.enabled and config.mlflow.tracking_uri is None
    assert config.max_failed_fraction == 0.0 and config.model.allow_pickle is False
    assert config.model.trust_remote_code is False


def test_overrides_and_groups():
    config = from_omegaconf(
        compose_generate(["ray=cluster", "mlflow=disabled", "spectr.num_drafts=2", "data.limit=null"])
    )
    assert config.ray.address == "auto" and not config.mlflow.enabled
    assert config.spectr.num_drafts == 2 and config.data.limit is None


def test_data_path_defaults():
    config = from_omegaconf(compose_generate([]))
    assert config.retry_failed is True and config.lease_timeout_s == 60
    assert (config.ray.shards_per_actor, config.ray.max_task_retries, config.ray.shard_timeout_s) == (2, 0, None)
    assert config.ray.heartbeat_s < config.ray.heartbeat_timeout_s
    assert from_omegaconf(compose_generate(["output_dir=s3://bucket/runs/a"])).output_dir == "s3://bucket/runs/a"


def test_speculative_means_one_draft():
    config = from_dict(base(**{"spectr.method": "speculative", "spectr.num_drafts": 4}))
    assert config.spectr.num_drafts == 1


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("spectr.num_drafts", 0, "spectr.num_drafts (K) must be >= 1"),
        ("spectr.draft_length", 0, "spectr.draft_length (L) must be >= 1"),
        ("spectr.temperature", -0.5, "spectr.temperature must be a finite number >= 0"),
        ("spectr.temperature", float("nan"), "spectr.temperature"),
        ("spectr.top_k", -2, "spectr.top_k must be >= 0, or -1"),
        ("spectr.top_p", 0.0, "spectr.top_p must be in (0, 1]"),
        ("spectr.top_p", 1.5, "spectr.top_p must be in (0, 1]"),
        ("spectr.method", "beam", "spectr.method must be one of"),
        ("spectr.max_new_tokens", 0, "spectr.max_new_tokens"),
        ("spectr.batch_size", 0, "spectr.batch_size"),
        ("spectr.max_num_drafts", 0, "spectr.max_num_drafts must be >= 1 or null"),
        ("spectr.max_draft_length", -2, "spectr.max_draft_length must be >= 1 or null"),
        ("spectr.num_drafts", "four", "spectr.num_drafts must be int"),
        ("spectr.num_drafts", True, "spectr.num_drafts must be int"),
        ("data.format", "xml", "data.format must be one of"),
        ("data.limit", 0, "data.limit must be >= 1"),
        ("data.max_new_tokens_column", "", "data.max_new_tokens_column must be null or a column other than"),
        ("data.max_new_tokens_column", "prompt", "data.max_new_tokens_column must be null or a column other than"),
        ("data.max_new_tokens_column", 5, "data.max_new_tokens_column must be str or null"),
        ("model.dtype", "int8", "model.dtype must be one of"),
        ("ray.cpus_per_actor", 0, "ray.cpus_per_actor"),
        ("shard_size", 0, "shard_size must be >= 1"),
        ("max_failed_fraction", 2.0, "max_failed_fraction must be in [0, 1]"),
        ("mlflow.enabled", "yes", "mlflow.enabled must be bool"),
        ("retry_failed", "no", "retry_failed must be bool"),
        ("lease_timeout_s", 0, "lease_timeout_s must be > 0 seconds"),
        ("ray.shards_per_actor", 0, "ray.shards_per_actor must be >= 1"),
        ("ray.heartbeat_timeout_s", 1.0, "ray.heartbeat_timeout_s must be >= ray.heartbeat_s (5)"),
        ("ray.shard_timeout_s", -1.0, "ray.shard_timeout_s must be > 0 seconds or null"),
    ],
)
def test_out_of_range_values_are_named(key, value, words):
    with pytest.raises(JobInputError, match=None) as caught:
        from_dict(base(**{key: value}))
    assert words in str(caught.value)


def test_unknown_and_missing_keys():
    with pytest.raises(JobInputError, match=r"unknown key\(s\) spectr.num_draft"):
        from_dict(base(**{"spectr.num_draft": 3}))
    raw = base()
    del raw["model"]["draft"]
    with pytest.raises(JobInputError, match="model.draft is required"):
        from_dict(raw)
    with pytest.raises(JobInputError, match="missing section 'ray'"):
        from_dict({k: v for k, v in base().items() if k != "ray"})


def test_hash_covers_what_changes_rows_and_not_where_they_run():
    a = from_dict(base())
    same = from_dict(base(**{"ray.num_actors": 7, "spectr.batch_size": 3, "mlflow.enabled": False}))
    other = from_dict(base(**{"spectr.seed": 1}))
    assert stable_hash(generation_settings(a)) == stable_hash(generation_settings(same))
    assert stable_hash(generation_settings(a)) != stable_hash(generation_settings(other))
    budgets = from_dict(base(**{"data.max_new_tokens_column": "budget"}))
    assert stable_hash(generation_settings(a)) != stable_hash(generation_settings(budgets))
    assert "max_new_tokens_column" not in generation_settings(a)["data"]  # unset: the hash it had before


def test_actor_resources_one_per_gpu_else_per_cpus():
    from pipeline.generate.cluster import actor_resources
    from pipeline.generate.config import RayConfig

    # GPUs present: one actor per GPU, whatever the CPU count
    assert actor_resources(RayConfig(), {"CPU": 64.0, "GPU": 4.0}, shards_to_do=100) == (4, 1.0, 1.0)
    # CPUs only: cluster CPUs // cpus_per_actor, no GPU asked
    assert actor_resources(RayConfig(cpus_per_actor=2), {"CPU": 9.0}, shards_to_do=100) == (4, 2.0, 0.0)
    # never more actors than shards to do
    assert actor_resources(RayConfig(), {"CPU": 8.0}, shards_to_do=3) == (3, 1.0, 0.0)
    assert actor_resources(RayConfig(num_actors=2, gpus_per_actor=0), {"CPU": 2.0, "GPU": 1.0}, 10) == (
        2,
        1.0,
        0.0,
    )
    with pytest.raises(
        JobInputError, match=r"3 actor\(s\) x \(1 CPU, 0 GPU\) do not fit the cluster \(2 CPUs"
    ):
        actor_resources(RayConfig(num_actors=3), {"CPU": 2.0}, shards_to_do=10)
    with pytest.raises(JobInputError, match="do not fit"):
        actor_resources(RayConfig(gpus_per_actor=1), {"CPU": 2.0}, shards_to_do=10)


def test_block_verification_means_one_draft():
    config = from_dict(base(**{"spectr.method": "block", "spectr.num_drafts": 4}))
    assert config.spectr.method == "block" and config.spectr.num_drafts == 1
