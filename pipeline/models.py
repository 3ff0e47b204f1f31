"""The draft/target pair on disk: checks, tokenizers, tokenization and loading.

Up-front checks (run by the driver before any actor starts), each raising `JobInputError`:
a model directory that is missing or is not a Hugging Face model, pickle-only weights without
`model.allow_pickle=true`, vocabularies of different sizes, draft and target tokenizers that differ
(vocabulary, merges, normalisation, special tokens), and chat mode without a chat template.

`model_identity` says what a model directory holds without reading its weights (each file's size, and a
hash of the whole file when small, else of its header and sampled blocks): the output directory's config
hash covers it, so a model replaced at the same path is noticed on resume.

`load_model` is what each actor calls once. With `model.device_map=auto` and more than one GPU in the
actor, `target_plan` gives the target's placement plan (`pipeline.placement`) and `load_model(plan=...)`
loads the weights on the host, then places the modules with `spectr.split.dispatch` (not accelerate's
`from_pretrained(device_map=...)`: see `spectr.split`); the draft is loaded whole on the first GPU.
This module does not generate (that is `spectr.generate`) and knows nothing of Ray.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pipeline.config import DataConfig, ModelConfig
from pipeline.errors import JobInputError

_SAFE_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
_PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.bin.index.json")
WHOLE_FILE_BYTES = 16 << 20  # files up to this size are hashed whole (configs, tokenizers, small weights)
SAMPLE_BYTES = 64 << 10
SAMPLES = 8  # blocks hashed across a large file, besides its header


def check_model_dir(path: str, key: str, allow_pickle: bool) -> Path:
    """A local Hugging Face model directory with safetensors weights (or pickle weights when allowed)."""
    model_dir = Path(path).expanduser()
    if not model_dir.exists():
        raise JobInputError(f"{key}: no such model directory: {model_dir}")
    if not model_dir.is_dir():
        raise JobInputError(f"{key}: {model_dir} is a file; expected a Hugging Face model directory")
    if not (model_dir / "config.json").is_file():
        raise JobInputError(
            f"{key}: {model_dir} has no config.json; expected a directory written by save_pretrained"
        )
    safe = [p.name for pattern in _SAFE_PATTERNS for p in model_dir.glob(pattern)]
    pickled = [p.name for pattern in _PICKLE_PATTERNS for p in model_dir.glob(pattern)]
    if not safe and not pickled:
        raise JobInputError(f"{key}: {model_dir} holds no weights (*.safetensors)")
    if not safe and not allow_pickle:
        raise JobInputError(
            f"{key}: {model_dir} holds only pickle-format weights ({', '.join(sorted(pickled))}), which can run "
            "code when loaded; convert them to safetensors, or set model.allow_pickle=true if you trust them"
        )
    return model_dir


def vocab_size_of(model_dir: Path, trust_remote_code: bool) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text_config.vocab_size)


def positions_of(model_dir: Path, trust_remote_code: bool) -> int | None:
    """The longest sequence the model takes (its positions, and its sliding window when it has one), from
    its config; None when it declares none (as `spectr.hf` reads them)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    limits = [getattr(text_config, "max_position_embeddings", None)]
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is None or "sliding_attention" in layer_types:
        limits.append(getattr(text_config, "sliding_window", None))
    found = [int(limit) for limit in limits if limit is not None]
    return min(found) if found else None


def max_new_tokens_limit(model: ModelConfig) -> int | None:
    """The most new tokens a row can have with this pair: the positions both models take, less one for
    the prompt's token (None when neither declares a limit)."""
    found = [
        positions_of(check_model_dir(path, key, model.allow_pickle), model.trust_remote_code)
        for key, path in (("model.target", model.target), ("model.draft", model.draft))
    ]
    found = [limit for limit in found if limit is not None]
    return min(found) - 1 if found else None


def load_tokenizer(model_dir: Path, key: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers raises OSError/ValueError/... for a missing or broken tokenizer
        raise JobInputError(f"{key}: cannot load a tokenizer from {model_dir}: {err}") from None


def tokenizer_differences(target_tok: Any, draft_tok: Any) -> list[str]:
    """What differs between two tokenizers, in words; empty when they tokenize identically."""
    differences = []
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if target_vocab != draft_vocab:
        only_target = sorted(set(target_vocab) - set(draft_vocab))
        only_draft = sorted(set(draft_vocab) - set(target_vocab))
        moved = sorted(t for t in set(target_vocab) & set(draft_vocab) if target_vocab[t] != draft_vocab[t])
        parts = [f"vocabulary sizes {len(target_vocab)} (target) vs {len(draft_vocab)} (draft)"]
        if only_target:
            parts.append(f"{len(only_target)} token(s) only in the target, e.g. {only_target[:3]}")
        if only_draft:
            parts.append(f"{len(only_draft)} token(s) only in the draft, e.g. {only_draft[:3]}")
        if moved:
            parts.append(f"{len(moved)} token(s) with different ids, e.g. {moved[:3]}")
        differences.append("vocabulary differs: " + "; ".join(parts))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(target_tok, name, None), getattr(draft_tok, name, None)
        if a != b:
            differences.append(f"{name} differs: {a} (target) vs {b} (draft)")
    target_backend = _backend_json(target_tok)
    draft_backend = _backend_json(draft_tok)
    if target_backend is not None and draft_backend is not None:
        for section in ("model", "normalizer", "pre_tokenizer", "post_processor", "decoder", "added_tokens"):
            if target_backend.get(section) != draft_backend.get(section):
                what = "merges or model" if section == "model" else section
                differences.append(f"{what} differs")
    elif (target_backend is None) != (draft_backend is None):
        differences.append("one tokenizer is a fast (tokenizers) tokenizer and the other is not")
    return differences


def _backend_json(tokenizer: Any) -> dict[str, Any] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    return json.loads(backend.to_str())


def check_same_tokenizer(target_tok: Any, draft_tok: Any, target_dir: Path, draft_dir: Path) -> None:
    differences = tokenizer_differences(target_tok, draft_tok)
    if differences:
        raise JobInputError(
            f"model.draft: the draft tokenizer ({draft_dir}) differs from the target tokenizer ({target_dir}): "
            + "; ".join(differences)
            + ". Speculative decoding needs the same tokenizer for both models"
        )


def model_identity(model_dir: Path) -> dict[str, Any]:
    """{file name: {size, sha256 or sampled_sha256}} for the files of a model directory (not its subfolders)."""
    return {
        path.name: _fingerprint(path)
        for path in sorted(model_dir.iterdir())
        if path.is_file() and not path.name.startswith(".")
    }


def _fingerprint(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= WHOLE_FILE_BYTES:
            digest.update(f.read())
            return {"size": size, "sha256": digest.hexdigest()}
        header = 1 << 20
        if path.suffix == ".safetensors":  # an 8-byte length, then the JSON header (names, dtypes, shapes)
            header = max(header, 8 + int.from_bytes(f.read(8), "little"))
            f.seek(0)
        digest.update(f.read(header))
        for k in range(1, SAMPLES + 1):  # the weights themselves: a retrained model has the same header
            f.seek(max(header, size * k // (SAMPLES + 1) - SAMPLE_BYTES // 2))
            digest.update(f.read(SAMPLE_BYTES))
        f.seek(max(0, size - SAMPLE_BYTES))
        digest.update(f.read())
    return {"size": size, "sampled_sha256": digest.hexdigest()}


def check_chat_template(tokenizer: Any, data: DataConfig) -> None:
    if data.chat and data.chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise JobInputError(
            "data.chat: chat mode needs a chat template, and the target tokenizer has none "
            "(set chat_template in its tokenizer_config.json, or turn data.chat off)"
        )


def render_prompts(tokenizer: Any, data: DataConfig, prompts: list[str] | None, messages: Any) -> list[str]:
    """Prompt texts; in chat mode, the messages rendered with the tokenizer's chat template."""
    if not data.chat:
        return list(prompts or [])
    check_chat_template(tokenizer, data)
    from pipeline.row_columns import chat_template_text

    options = dict(data.chat_template_kwargs or {})  # e.g. enable_thinking=False for Qwen3-style templates
    if data.chat_template is not None:
        options["chat_template"] = chat_template_text(data.chat_template)
    return [
        tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, **options)
        for conversation in messages
    ]


def tokenize(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    if not texts:
        return []
    encoded = tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
    return [list(map(int, ids)) for ids in encoded]


def eos_token_id_of(model: Any, tokenizer: Any) -> int | None:
    """The EOS id generation stops at: the model's generation config, else the tokenizer's."""
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    if eos is None:
        eos = tokenizer.eos_token_id
    return None if eos is None else int(eos)


def check_pair(model: ModelConfig) -> tuple[Path, Path, Any]:
    """Both directories, one vocabulary size, identical tokenizers: (target dir, draft dir, target tokenizer).
    A feature draft (`spectr.feature_draft`: EAGLE / EAGLE-3 layouts) reads the target's tokens by construction:
    its vocabulary and hidden size must be the target's, and it needs no tokenizer of its own."""
    target_dir = check_model_dir(model.target, "model.target", model.allow_pickle)
    draft_dir = check_model_dir(model.draft, "model.draft", model.allow_pickle)
    if feature_draft_kind(draft_dir) is not None:
        return target_dir, draft_dir, check_feature_draft(target_dir, draft_dir, model)
    target_vocab = vocab_size_of(target_dir, model.trust_remote_code)
    draft_vocab = vocab_size_of(draft_dir, model.trust_remote_code)
    if target_vocab != draft_vocab:
        raise JobInputError(
            f"model.draft: vocabulary sizes differ: target {target_dir} has {target_vocab}, draft {draft_dir} has {draft_vocab}"
        )
    target_tok = load_tokenizer(target_dir, "model.target", model.trust_remote_code)
    draft_tok = load_tokenizer(draft_dir, "model.draft", model.trust_remote_code)
    check_same_tokenizer(target_tok, draft_tok, target_dir, draft_dir)
    return target_dir, draft_dir, target_tok


def feature_draft_kind(model_dir: Path) -> str | None:
    """"eagle" / "eagle3" for a feature draft directory, None for an ordinary causal LM."""
    from spectr.feature_draft import feature_draft_kind as kind_of

    return kind_of(model_dir)


def check_feature_draft(target_dir: Path, draft_dir: Path, model: ModelConfig) -> Any:
    """A feature draft against its target, from the configs: hidden size, vocabulary, layers read; returns the
    target's tokenizer."""
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(str(target_dir), trust_remote_code=model.trust_remote_code)
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    draft = json.loads((draft_dir / "config.json").read_text())
    kind = feature_draft_kind(draft_dir)
    problems = []
    if "hidden_size" in draft and int(draft["hidden_size"]) != int(text.hidden_size):
        problems.append(f"hidden size {draft['hidden_size']} vs the target's {text.hidden_size}")
    if "vocab_size" in draft and int(draft["vocab_size"]) != int(text.vocab_size):
        problems.append(f"vocabulary {draft['vocab_size']} vs the target's {text.vocab_size}")
    layers = (draft.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []
    outside = [i for i in layers if not 0 <= int(i) <= int(text.num_hidden_layers)]
    if outside:
        problems.append(f"reads target layers {outside}, outside [0, {text.num_hidden_layers}]")
    if problems:
        raise JobInputError(f"model.draft: {draft_dir} is a feature draft ({kind}) made for another target: "
                            f"{'; '.join(problems)}")
    return load_tokenizer(target_dir, "model.target", model.trust_remote_code)


def eos_token_ids_of(model: Any, tokenizer: Any) -> list[int]:
    """Every EOS id generation stops at: all of the model's generation config, else the tokenizer's."""
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    ids = list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
    if not ids and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return list(dict.fromkeys(int(i) for i in ids))


def resolve_dtype(name: str, device: str, bf16_supported: bool | None = None) -> Any:
    """The torch dtype of `model.dtype`: `auto` is bfloat16 on CUDA (when supported), float32 elsewhere."""
    import torch

    if name != "auto":
        return getattr(torch, name)
    if str(device).startswith("cuda"):
        supported = torch.cuda.is_bf16_supported() if bf16_supported is None else bf16_supported
        return torch.bfloat16 if supported else torch.float16
    return torch.float32


def target_plan(model_dir: str, model: ModelConfig, gpus: int) -> dict[str, int] | None:
    """The target's placement plan over the actor's `gpus` GPUs (0..gpus-1, as Ray numbers them for the actor)
    when `model.device_map=auto` and gpus > 1; None otherwise (the target goes whole on the first device).
    Made from the config alone (layers; tied embeddings put the head on the first GPU)."""
    if model.device_map != "auto" or gpus < 2:
        return None
    from transformers import AutoConfig

    from pipeline.placement import placement_plan

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=model.trust_remote_code)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = bool(getattr(text_config, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))
    return placement_plan(int(text_config.num_hidden_layers), list(range(gpus)), tied_head=tied)


def load_model(model_dir: str, model: ModelConfig, device: str, plan: dict[str, int] | None = None,
               devices: dict[int, str] | None = None) -> Any:
    """One causal LM, in eval mode, on `device`, or split per `plan` (`target_plan`: {module name: GPU}; the
    GPUs are cuda:<n>, or `devices[n]`: tests place the groups on the CPU). Safetensors only unless
    `model.allow_pickle`. A plan naming modules the model lacks (another architecture's names) is a ValueError
    unless every weight is still placed (entries for absent modules, e.g. a rotary table, are dropped)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per weight file per actor is noise in the job's output
    dtype = resolve_dtype(model.dtype, device)
    if feature_draft_kind(Path(model_dir)) is not None:  # bound to its target by the engine (`bind`)
        from spectr.feature_draft import load_feature_draft

        return load_feature_draft(model_dir, None, dtype=dtype, device=device)
    loaded = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=dtype,
        use_safetensors=None if model.allow_pickle else True,
        trust_remote_code=model.trust_remote_code,
    )
    if plan is None:
        loaded.to(device)
    else:
        from spectr.split import dispatch

        present = dict(loaded.named_modules())
        dispatch(loaded, {name: gpu for name, gpu in plan.items() if name in present}, devices)
    loaded.eval()
    loaded.requires_grad_(False)
    return loaded
