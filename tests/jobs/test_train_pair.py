"""The train_pair job: the smoke config end to end on the real stdlib, and bad input.

The real Hydra config is composed here (conf/train_pair.yaml with train=smoke), as the command line would.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from jobs.train_pair import run
from pipeline.train_pair.corpus import is_heldout

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def compose_config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train_pair", overrides=["train=smoke", "show_progress=false", *overrides])


def test_smoke_config_trains_saves_and_reloads_a_pair(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = compose_config(f"output_dir={tmp_path / 'out'}")
    result = run(cfg)

    pair = tmp_path / "out" / "pair"
    assert result.output_dir == str(pair)
    assert result.steps == cfg.train.max_steps and result.stopped_by == "max_steps"
    assert result.tokens_seen == cfg.train.max_steps * cfg.train.batch_size * cfg.train.seq_len
    assert math.isfinite(result.final_target_loss) and math.isfinite(result.final_draft_loss)

    manifest = json.loads((pair / "manifest.json").read_text())
    assert manifest["steps"] == result.steps and manifest["partial"] is False
    assert manifest["heldout_modules"], "held-out modules are recorded for evaluation"
    assert all(is_heldout(m, cfg.train.corpus.heldout_every) for m in manifest["heldout_modules"])

    tokenizer = AutoTokenizer.from_pretrained(pair / "target", local_files_only=True)
    target = AutoModelForCausalLM.from_pretrained(pair / "target", local_files_only=True)
    draft = AutoModelForCausalLM.from_pretrained(pair / "draft", local_files_only=True)
    assert target.config.vocab_size == draft.config.vocab_size == len(tokenizer) == manifest["vocab_size"]
    assert target.config.num_hidden_layers == cfg.train.target.num_hidden_layers
    assert draft.config.hidden_size == cfg.train.draft.hidden_size
    text = "def f(x):\n\treturn x  # ü\r\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text

    rows = [json.loads(line) for line in (tmp_path / "out" / "prompts.jsonl").read_text().splitlines()]
    assert rows and all(set(row) == {"id", "prompt"} for row in rows)
    assert len({row["id"] for row in rows}) == len(rows)
    assert {row["id"].split(":")[0] for row in rows} <= set(manifest["heldout_modules"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.target.num_attention_heads=3", "does not divide hidden_size"),
        ("train.draft.num_key_value_heads=3", "does not divide num_attention_heads"),
        ("train.target.hidden_size=0", "positive integer"),
        ("train.seq_len=4096", "exceeds train.target.max_position_embeddings"),
        ("train.distill_weight=1.5", "distill_weight"),
    ],
)
def test_inconsistent_config_fails_before_training(tmp_path, override, message):
    cfg = compose_config(f"output_dir={tmp_path / 'out'}", override)
    with pytest.raises(ValueError, match=message):
        run(cfg)
    assert not (tmp_path / "out").exists(), "nothing is written before the config is checked"


def test_missing_corpus_dir_fails_before_training(tmp_path):
    cfg = compose_config(f"output_dir={tmp_path / 'out'}", f"train.corpus.stdlib_dir={tmp_path / 'nowhere'}")
    with pytest.raises(ValueError, match="does not exist"):
        run(cfg)
    assert not (tmp_path / "out").exists()


def test_empty_corpus_dir_fails_before_training(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "pkg").mkdir(parents=True)
    (corpus / "README.txt").write_text("not python")
    (corpus / "pkg" / "empty.py").write_text("")
    cfg = compose_config(f"output_dir={tmp_path / 'out'}", f"train.corpus.stdlib_dir={corpus}")
    with pytest.raises(ValueError, match="no non-empty .py files"):
        run(cfg)
    assert not (tmp_path / "out").exists()


def test_unknown_train_key_is_rejected(tmp_path):
    cfg = compose_config(f"output_dir={tmp_path / 'out'}", "+train.max_minute=3")
    with pytest.raises(ValueError, match="unknown keys"):
        run(cfg)
