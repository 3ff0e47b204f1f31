"""Model identity on the actors (issue #52, item 2), without Ray: the actor's pair is checked against the job's
plan, tensor for tensor. The fault is injected from outside, on disk: a fine-tune of one tensor written into
a copy of the target (same names, shapes, dtypes and file size, as a fine-tune written into the same path
mid-run, or a different copy on another node, would look). Before the fix nothing on the actor compared the
pair it loaded with the plan's, so such an actor wrote rows of another model."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from pipeline.config import ModelConfig
from pipeline.generate.config import SpectrConfig
from pipeline.generate.worker import ModelMismatch, ShardGenerator
from pipeline.hashing import tensor_fingerprint


def fine_tuned(source, folder):
    """A copy of `source` with one tensor changed a little (the file keeps its size and header)."""
    from safetensors.torch import load_file, save_file

    target = shutil.copytree(source, folder)
    weights = load_file(target / "model.safetensors")
    name = sorted(weights)[len(weights) // 2]
    weights[name] = weights[name] + 1e-3
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    assert (target / "model.safetensors").stat().st_size == (source / "model.safetensors").stat().st_size
    return target



def test_an_actor_whose_pair_is_not_the_plans_generates_nothing(tiny_pair, tmp_path):
    tuned = fine_tuned(tiny_pair["target"], tmp_path / "tuned")
    planned = {"target": tensor_fingerprint(tiny_pair["target"]), "draft": tensor_fingerprint(tiny_pair["draft"])}
    assert tensor_fingerprint(tuned)["model.safetensors"] != planned["target"]["model.safetensors"]
    assert tensor_fingerprint(tuned)["config.json"] == planned["target"]["config.json"]

    settings = SpectrConfig(method="spectr", num_drafts=2, draft_length=2, max_new_tokens=4, batch_size=2)
    same = ShardGenerator(ModelConfig(target=str(tiny_pair["target"]), draft=str(tiny_pair["draft"])), settings,
                          num_threads=1)
    same._check_models(SimpleNamespace(model_fingerprints=planned))  # the control: the plan's pair passes
    other = ShardGenerator(ModelConfig(target=str(tuned), draft=str(tiny_pair["draft"])), settings, num_threads=1)
    with pytest.raises(ModelMismatch, match="model.target: the model this actor loaded .* \\(files that differ: "
                                            "model.safetensors"):
        other._check_models(SimpleNamespace(model_fingerprints=planned))
