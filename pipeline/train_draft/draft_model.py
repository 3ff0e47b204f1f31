"""The target's checks and the draft built for it: a small Llama with the target's vocabulary.

`load_target` loads the target and its tokenizer and refuses (JobInputError) an architecture the engine does
not run or a tokenizer that does not survive `save_pretrained`. `draft_shape` derives the draft's size from the
target's (a quarter of the layers, about 3/8 of the width, in whole heads of the target's head size);
`build_draft` makes it, its embedding initialised from the target's best rank-h approximation
(`torch.svd_lowrank`: cheap for large vocabularies) or at random. Not here: training or evaluation.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import JobInputError
from pipeline.train_draft.config import DraftShape, TargetSpec


@dataclass(frozen=True)
class ResolvedShape:
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool


def load_target(spec: TargetSpec, device: str) -> tuple[Any, Any]:
    """(target model in eval mode on `device`, its tokenizer); refuses what the draft cannot be built for."""
    from pipeline.models import check_model_dir, load_tokenizer, resolve_dtype
    from spectr.native import native_supported

    target_dir = check_model_dir(spec.target, "model.target", allow_pickle=False)
    tokenizer = load_tokenizer(target_dir, "model.target", spec.trust_remote_code)
    check_tokenizer_saves(tokenizer, target_dir)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(
        str(target_dir), dtype=resolve_dtype(spec.dtype, device), use_safetensors=True,
        trust_remote_code=spec.trust_remote_code,
    )
    reason = native_supported(target)
    if reason is not None:
        raise JobInputError(f"model.target: {target_dir}: the engine does not run this architecture ({reason})")
    target.to(device).eval().requires_grad_(False)
    if len(tokenizer) > target.config.vocab_size:
        raise JobInputError(f"model.target: its tokenizer has {len(tokenizer)} tokens, more than the model's "
                            f"vocabulary of {target.config.vocab_size}")
    return target, tokenizer


def check_tokenizer_saves(tokenizer: Any, target_dir: Path) -> None:
    """The draft ships the target's tokenizer: it must save and load back identical (pipeline.models' check)."""
    from transformers import AutoTokenizer

    from pipeline.models import tokenizer_differences

    with tempfile.TemporaryDirectory() as folder:
        try:
            tokenizer.save_pretrained(folder)
            reloaded = AutoTokenizer.from_pretrained(folder)
        except Exception as err:  # transformers raises many types for a tokenizer it cannot write or read
            raise JobInputError(f"model.target: the tokenizer of {target_dir} cannot be saved with the draft: "
                                f"{type(err).__name__}: {err}") from None
    differences = tokenizer_differences(tokenizer, reloaded)
    if differences:
        raise JobInputError(f"model.target: the tokenizer of {target_dir} does not load back identical once "
                            f"saved ({'; '.join(differences)}), so a draft cannot ship it")


def draft_shape(target_config: Any, shape: DraftShape) -> ResolvedShape:
    """The draft's size: given fields as they are, the rest derived from the target's config."""
    target_heads = int(target_config.num_attention_heads)
    head_dim = int(getattr(target_config, "head_dim", None) or target_config.hidden_size // target_heads)
    layers = shape.num_hidden_layers or max(1, int(target_config.num_hidden_layers) // 4)
    heads = shape.num_attention_heads
    if shape.hidden_size is None:
        heads = heads or max(2, round(int(target_config.hidden_size) * 3 / 8 / head_dim))
        hidden = heads * head_dim
    else:
        hidden = shape.hidden_size
        heads = heads or max(1, hidden // head_dim)
    if hidden % heads:
        raise JobInputError(f"draft.num_attention_heads: {heads} does not divide draft.hidden_size {hidden}")
    kv_heads = shape.num_key_value_heads
    if kv_heads is None:
        ratio = int(getattr(target_config, "num_key_value_heads", None) or target_heads) / target_heads
        kv_heads = max(d for d in range(1, heads + 1) if heads % d == 0 and d <= max(1, round(heads * ratio)))
    if heads % kv_heads:
        raise JobInputError(f"draft.num_key_value_heads: {kv_heads} does not divide the draft's {heads} heads")
    intermediate = shape.intermediate_size or max(hidden, 64 * round(hidden * 8 / 3 / 64))
    return ResolvedShape(layers, hidden, intermediate, heads, kv_heads, shape.tie_word_embeddings)


def build_draft(target: Any, tokenizer: Any, shape: ResolvedShape, init_embedding: str, seed: int) -> Any:
    """A fresh LlamaForCausalLM with the target's vocabulary, special ids and positions (float32, CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tc = target.config
    rope = getattr(tc, "rope_parameters", None) or {}
    config = LlamaConfig(
        vocab_size=int(tc.vocab_size),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", 2048) or 2048),
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0)) or 10000.0),
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=tc.bos_token_id if tc.bos_token_id is not None else tokenizer.bos_token_id,
        eos_token_id=tc.eos_token_id if tc.eos_token_id is not None else tokenizer.eos_token_id,
        pad_token_id=tc.pad_token_id if getattr(tc, "pad_token_id", None) is not None else tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draft = LlamaForCausalLM(config)
        if init_embedding == "target":
            _init_embedding_from(draft, target)
    if getattr(target, "generation_config", None) is not None:
        draft.generation_config.eos_token_id = target.generation_config.eos_token_id
    return draft


@torch.no_grad()
def _init_embedding_from(draft: Any, target: Any) -> None:
    """The draft's embedding := the target's projected on its top h right singular directions (rank h = the
    draft's width), rescaled to the draft's initial row norm; an untied head gets the same rows."""
    source = target.get_input_embeddings().weight.detach().float().cpu()  # [V, H_target]
    width = draft.config.hidden_size
    if width >= source.shape[1]:
        rows = torch.zeros(source.shape[0], width)
        rows[:, : source.shape[1]] = source
    else:
        u, s, _ = torch.svd_lowrank(source, q=width, niter=2)  # [V, h], [h]
        rows = u * s  # [V, h]: the coordinates of each row in the top h directions
    embedding = draft.get_input_embeddings().weight  # [V, h]
    scale = embedding.norm(dim=-1).mean() / rows.norm(dim=-1).mean().clamp(min=1e-8)
    embedding.copy_(rows * scale)
    if not draft.config.tie_word_embeddings:
        draft.get_output_embeddings().weight.copy_(rows * scale)


def count_parameters(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())
