"""The default config, composed with no model/data overrides, runs on the embedded pair and prompts.

Skips (with the reason) only while assets/ does not hold the trained pair yet.
"""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

import spectr
from jobs.generate import generate
from pipeline.config import PROJECT_ROOT
from pipeline.generate.reader import read_output, read_plan
from pipeline.generate.summary import format_report

ASSETS = PROJECT_ROOT / "assets"
REQUIRED = [
    ASSETS / "models/target/config.json",
    ASSETS / "models/draft/config.json",
    ASSETS / "prompts.jsonl",
]
missing = [str(p.relative_to(PROJECT_ROOT)) for p in REQUIRED if not p.exists()]


@pytest.mark.skipif(
    bool(missing), reason=f"embedded assets not there yet: {', '.join(missing)} (jobs.train_pair)"
)
def test_default_config_on_the_embedded_pair(tmp_path, ray_local):
    overrides = [
        "data.limit=8", "spectr.max_new_tokens=16", "ray.num_actors=1", f"output_dir={tmp_path / 'out'}",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", "progress=false",
    ]  # fmt: skip
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="generate", overrides=overrides)
    assert cfg.model.target.endswith("assets/models/target") and cfg.data.path.endswith(
        "assets/prompts.jsonl"
    )
    report = generate(cfg)
    table = read_output(tmp_path / "out")
    ids = [json.loads(line)["id"] for line in (ASSETS / "prompts.jsonl").read_text().splitlines()[:8]]
    assert table.column("id").to_pylist() == ids
    assert report.exit_code == 0 and report.summary.prompts_completed == 8
    assert all(reason in ("stop", "length") for reason in table.column("finish_reason").to_pylist())
    assert sum(len(c) for c in table.column("completion").to_pylist()) > 0
    # the default method is auto: what ran (by share of tokens) is in the summary, and every part file's
    # metadata has the mix of configurations that produced it
    assert report.summary.plan.startswith("auto: ") and "% of tokens" in report.summary.plan
    assert sum(report.summary.tokens_by_config.values()) == report.summary.generated_tokens
    assert report.summary.planner_wasted_s == 0.0  # every iteration's tokens are kept
    parts = sorted((tmp_path / "out").glob("part-*.parquet"))
    plans = [read_plan(part) for part in parts]
    assert parts and all(plan is not None for plan in plans)
    for plan in plans:
        assert plan["method"] == "auto" and sum(plan["shares"].values()) == pytest.approx(1.0)
        for label in plan["tokens_by_config"]:
            config = spectr.StepConfig.parse(label)
            assert config.method in spectr.known_methods() and config.num_drafts <= 8 and config.draft_length <= 8
    assert "auto: " in format_report(report)
    if report.summary.tokens_by_config.get("autoregressive", 0) < report.summary.generated_tokens:
        assert report.summary.block_efficiency > 1.0  # the draft earns its keep on the trained pair
