"""First contact (issue 39): a user's data.path is never cut by the embedded demo's limit, and a limit that cuts
the input says so on the job's first line.

The config tests compose the real YAML (no Ray); the job test runs the README's "bring your own data" command's
config (real composed config, the tiny pair, a local Ray) on a 100-row file and reads every row back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from jobs.generate import generate
from pipeline.config import DEMO_LIMIT, EMBEDDED_PROMPTS, DataConfig
from pipeline.generate.reader import read_output
from pipeline.readers import input_rows, limit_note
from pipeline.source import list_source

REPO = Path(__file__).resolve().parents[2]


def composed(*overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return OmegaConf.to_container(compose(config_name="generate", overrides=list(overrides)), resolve=True)


@pytest.fixture(scope="module")
def hundred_rows(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "mine.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i:03d}", "prompt": f"Tell me about {i}."}) + "\n"
                            for i in range(100)))
    return path


def test_the_demo_limit_applies_to_the_embedded_prompts_only(hundred_rows):
    assert composed()["data"]["limit"] == DEMO_LIMIT == 64  # make run: a few minutes on a CPU
    assert composed(f"data.path={EMBEDDED_PROMPTS}")["data"]["limit"] == 64
    assert composed(f"data.path={hundred_rows}")["data"]["limit"] is None  # every row of the user's data
    assert composed(f"data.path={hundred_rows}", "data.limit=10")["data"]["limit"] == 10
    assert composed("data.path=s3://bucket/prompts.jsonl")["data"]["limit"] is None
    assert composed("data.limit=null")["data"]["limit"] is None


def test_a_limit_that_cuts_the_input_is_named_with_the_input_size(hundred_rows):
    config = DataConfig(path=str(hundred_rows), limit=30)
    listing = list_source(config)
    assert input_rows(listing) == 100
    assert limit_note(config, listing, 30) == "first 30 of 100 rows (data.limit)"
    assert limit_note(DataConfig(path=str(hundred_rows), limit=100), listing, 100) == ""  # nothing left out
    assert limit_note(DataConfig(path=str(hundred_rows)), listing, 100) == ""
    assert input_rows(listing, max_bytes=10) is None  # a large text input is not read twice


def test_bring_your_own_data_writes_every_row(tiny_pair, hundred_rows, tmp_path, ray_local, caplog):
    """The README's command on a 100-row file (models and output given, everything else the defaults but for a
    short budget): 100 rows, each id once, and a first line that names no limit."""
    overrides = [
        f"data.path={hundred_rows}", f"model.target={tiny_pair['target']}", f"model.draft={tiny_pair['draft']}",
        f"output_dir={tmp_path / 'out'}", "spectr.max_new_tokens=4", "spectr.method=speculative",
        "mlflow.enabled=false", "progress=false", "ray.num_actors=1",
    ]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="generate", overrides=overrides)
    caplog.set_level("INFO", logger="pipeline")
    report = generate(cfg)
    assert report.exit_code == 0
    ids = read_output(tmp_path / "out").column("id").to_pylist()
    assert sorted(ids) == [f"r{i:03d}" for i in range(100)]
    first = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("checked config"))
    assert "checked config, models and 100 prompts" in first and "data.limit" not in first
