"""First contact (issue 39): a user's data.path is never cut by the embedded demo's limit, and a limit that cuts
the input says so on the job's first line.

The config tests compose the real YAML (no Ray); the job test runs the README's "bring your own data" command's
config (real composed config, the tiny pair, a local Ray) on a 100-row file and reads every row back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from jobs.generate import generate
from pipeline.config import DEMO_LIMIT, EMBEDDED_PROMPTS, DataConfig
from pipeline.generate.reader import read_output
from pipeline.readers import input_rows, limit_note
from pipeline.source import list_source

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "spectr"))  # hf_tiny

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


# --- rows that read like vLLM's ---------------------------------------------------------------------------------

def test_a_sampling_params_column_in_vllms_names(tiny_pair, tmp_path, ray_local):
    """The issue's job: greedy with top_k -1 equals HF greedy and its completion_logprobs are the raw target
    log-softmax (|diff| < 2e-3); ignore_eos with min_p runs its whole budget (length); stop_token_ids ends the row
    with finish_reason stop and stop_reason the id; a stop string gives stop_reason the string (and with
    include_stop_str_in_output the completion keeps it); unknown keys and inexact ones fail their row alone."""
    import torch
    from hf_tiny import hf_greedy
    from tiny_pair_support import job_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.generate.config import from_dict
    from pipeline.generate.job import run_generate

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair["target"])
    target = AutoModelForCausalLM.from_pretrained(tiny_pair["target"], dtype=torch.float32).eval()
    prompt = "the cat sat on"
    prompt_ids = tokenizer(prompt)["input_ids"]
    greedy = hf_greedy(target, prompt_ids, 12)
    stop_id = greedy[5]
    stop_text = tokenizer.decode(greedy[:8], skip_special_tokens=True)[-3:]
    params = {
        "greedy": {"temperature": 0, "top_k": -1, "max_tokens": 12, "ignore_eos": True},
        "budget": {"ignore_eos": True, "min_p": 0.05, "max_tokens": 12},
        "stop_id": {"temperature": 0, "stop_token_ids": [stop_id], "max_tokens": 12, "ignore_eos": True},
        "stop_str": {"temperature": 0, "stop": [stop_text], "max_tokens": 12, "ignore_eos": True},
        "stop_str_kept": {"temperature": 0, "stop": [stop_text], "include_stop_str_in_output": True,
                          "max_tokens": 12, "ignore_eos": True},
        "unknown": {"temperature": 0, "typical_p": 0.5},
        "best_of": {"best_of": 3},
        "penalty": {"presence_penalty": 0.5},
        "neutral": {"presence_penalty": 0.0, "repetition_penalty": 1.0, "top_k": -1, "max_tokens": 3},
    }
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": name, "prompt": prompt, "params": value}) + "\n"
                            for name, value in params.items()))
    raw = job_config(tiny_pair, data, tmp_path / "out", **{
        "spectr.method": "speculative", "spectr.logprobs": 2, "data.sampling_params_column": "params",
        "ray.num_actors": 1, "max_failed_fraction": 0.5})
    report = run_generate(from_dict(raw))
    assert report.exit_code == 0
    rows = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert len(rows) == len(params)

    row = rows["greedy"]
    assert row["completion_token_ids"] == greedy and row["finish_reason"] == "length" and row["stop_reason"] is None
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt_ids + greedy]), use_cache=False).logits[0]
    expected = logits[len(prompt_ids) - 1 : -1].log_softmax(-1).gather(1, torch.tensor(greedy)[:, None])[:, 0]
    assert max(abs(a - b) for a, b in zip(row["completion_logprobs"], expected.tolist())) < 2e-3
    assert any(v < -1e-3 for v in row["completion_logprobs"])  # raw, not the greedy law's 0.0
    top = row["completion_top_logprobs"]  # spectr.logprobs=2: each token's 2 most likely, most likely first
    assert len(top) == 12 and all(len(entries) == 2 for entries in top)
    assert [entries[0]["token_id"] for entries in top] == greedy  # greedy: the raw law's top token
    assert max(abs(e[0]["logprob"] - v) for e, v in zip(top, row["completion_logprobs"])) < 1e-6

    assert rows["budget"]["finish_reason"] == "length" and rows["budget"]["completion_tokens"] == 12
    row = rows["stop_id"]
    assert row["finish_reason"] == "stop" and row["stop_reason"] == str(stop_id)
    assert row["completion_token_ids"] == greedy[: greedy.index(stop_id) + 1]
    row, kept = rows["stop_str"], rows["stop_str_kept"]
    assert row["finish_reason"] == kept["finish_reason"] == "stop"
    assert row["stop_reason"] == kept["stop_reason"] == stop_text
    assert stop_text not in row["completion"] and kept["completion"].endswith(stop_text)
    assert "unknown key(s) typical_p; known: n, temperature" in rows["unknown"]["error"]
    assert "best_of=3 is refused: best_of picks among samples" in rows["best_of"]["error"]
    assert rows["penalty"]["error"] is None  # penalties run (exact: counted on each draft-tree node's path)
    assert rows["neutral"]["error"] is None and rows["neutral"]["completion_tokens"] <= 3
