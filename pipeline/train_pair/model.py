"""The pair's Llama-style models: built from a `ModelSpec`, counted, and saved with their tokenizer.

Not here: training (`training`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from pipeline.train_pair.spec import ModelSpec


def build_model(spec: ModelSpec, tokenizer, seed: int):
    """A freshly initialised LlamaForCausalLM; initialisation is seeded without touching global RNG state."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        intermediate_size=spec.intermediate_size,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_theta=spec.rope_theta,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def save_pair(output_dir: Path, target, draft, tokenizer, save_dtype: str, manifest: dict) -> None:
    """Write ``target/`` and ``draft/`` (model + tokenizer each) and ``manifest.json`` atomically enough:
    into a temporary sibling directory first, then swapped into place."""
    dtype = getattr(torch, save_dtype)
    output_dir = Path(output_dir)
    staging = output_dir.with_name(output_dir.name + ".tmp")
    if staging.exists():
        _remove_tree(staging)
    for name, model in (("target", target), ("draft", draft)):
        model_dir = staging / name
        model_dir.mkdir(parents=True)
        # Save a copy in the shipping dtype; the fp32 master weights being trained stay untouched.
        copy.deepcopy(model).to(dtype).save_pretrained(model_dir, safe_serialization=True)
        tokenizer.save_pretrained(model_dir)
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if output_dir.exists():
        _remove_tree(output_dir)
    staging.rename(output_dir)


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path)
