"""Tiny random Hugging Face causal LMs for the engine tests (no downloads), plus exact helpers.

Models are built under a forked, seeded global RNG (HF initialisers use the global RNG), so
building one never disturbs other tests. `init_std` controls how peaked the next-token
distributions are: the default 0.02 gives near-uniform outputs; ~0.5 gives peaked,
context-dependent ones (useful to make acceptance vary between rows).
"""

from __future__ import annotations

import itertools

import torch
import transformers

ARCHITECTURES = ("llama", "qwen2", "mistral", "gpt_neox")


def tiny_model(
    arch: str = "llama",
    *,
    vocab_size: int = 64,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_positions: int = 256,
    init_std: float = 0.02,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        max_position_embeddings=max_positions,
        initializer_range=init_std,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        config = transformers.LlamaConfig(num_key_value_heads=num_kv_heads, **common)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(num_key_value_heads=num_kv_heads, **common)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "mistral":
        config = transformers.MistralConfig(num_key_value_heads=num_kv_heads, sliding_window=None, **common)
        cls = transformers.MistralForCausalLM
    elif arch == "gpt_neox":
        config = transformers.GPTNeoXConfig(rotary_pct=0.5, **common)
        cls = transformers.GPTNeoXForCausalLM
    else:
        raise ValueError(f"unknown test architecture {arch!r}")
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model.to(dtype).eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face's own greedy decoding of one prompt (the reference for temperature=0)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def full_last_logits(model, sequences: list[list[int]]) -> torch.Tensor:
    """Logits after each full sequence from a fresh, cache-free forward per sequence: [N, V]."""
    rows = [model(input_ids=torch.tensor([s]), use_cache=False).logits[0, -1] for s in sequences]
    return torch.stack(rows)


@torch.inference_mode()
def exact_joint_distribution(model, prompt: list[int], length: int, warp) -> torch.Tensor:
    """P(first `length` generated tokens) under the warped model, by enumeration: [V] * length, float64.

    Every prefix of each depth goes through one batched full forward (no cache).
    """
    vocab = model.config.vocab_size
    joint = torch.ones((), dtype=torch.float64)
    for depth in range(length):
        prefixes = list(itertools.product(range(vocab), repeat=depth))
        ids = torch.tensor([prompt + list(p) for p in prefixes])  # [V^depth, P + depth]
        logits = model(input_ids=ids, use_cache=False).logits[:, -1]  # [V^depth, V]
        step = warp.probs(logits).to(torch.float64).reshape([vocab] * depth + [vocab])
        joint = joint.unsqueeze(-1) * step
    return joint


def noisy_copy(model, noise_std: float, seed: int):
    """A draft that partly agrees with `model`: its weights plus seeded Gaussian noise."""
    import copy

    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float32)
            parameter.add_((noise * noise_std).to(parameter.dtype))
    return draft
