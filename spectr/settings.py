"""The checked arguments of one `spectr.generate` call: `Settings.from_arguments` and its checks.

Every check raises a ValueError naming the argument, and for per-prompt problems the prompt
(row) index, so that a caller can find the bad input at once. Model-dependent checks (token
ids inside the vocabulary, prompt + max_new_tokens inside the model's positions and sliding
window) are `check_prompts_fit`, called once per model.

This module does not run models and holds no device state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from spectr.warps import SamplingWarp, validate_sampling

AUTOREGRESSIVE = "autoregressive"


@dataclass(frozen=True)
class Settings:
    """What one generation needs besides the models. num_drafts / draft_length are 0 for autoregressive."""

    method: str
    num_drafts: int
    draft_length: int
    max_new_tokens: tuple[int, ...]  # per prompt
    warp: SamplingWarp
    eos_ids: tuple[int, ...]
    seeds: tuple[int, ...]  # per prompt

    @property
    def speculative(self) -> bool:
        return self.method != AUTOREGRESSIVE

    @classmethod
    def for_run(cls, *, methods: Sequence[str], method, num_drafts, draft_length, temperature, top_k, top_p,
                eos_token_id) -> Settings:
        """The run-level settings only (no prompts yet: `max_new_tokens` and `seeds` are empty)."""
        if method not in methods:
            raise ValueError(f"unknown method {method!r}; expected one of {list(methods)}")
        for name, value in (("num_drafts", num_drafts), ("draft_length", draft_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        validate_sampling(temperature, top_k, top_p)
        warp = SamplingWarp(float(temperature), int(top_k), float(top_p))
        if method in ("speculative", "block") or (warp.greedy and method != AUTOREGRESSIVE):
            # speculative sampling and block verification are K = 1 rules; under greedy decoding the
            # K drafts would all be the draft's argmax path, so one draft gives the same output for less
            num_drafts = 1
        speculative = method != AUTOREGRESSIVE
        return cls(method=method, num_drafts=num_drafts if speculative else 0,
                   draft_length=draft_length if speculative else 0, max_new_tokens=(), warp=warp,
                   eos_ids=tuple(check_eos(eos_token_id)), seeds=())

    @classmethod
    def from_arguments(cls, prompts: list[list[int]], *, methods: Sequence[str], method, num_drafts, draft_length,
                       max_new_tokens, temperature, top_k, top_p, eos_token_id, seed) -> Settings:
        run = cls.for_run(methods=methods, method=method, num_drafts=num_drafts, draft_length=draft_length,
                          temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id)
        return replace(run, max_new_tokens=tuple(check_max_new_tokens(max_new_tokens, len(prompts))),
                       seeds=tuple(check_seeds(seed, len(prompts))))


def check_prompts(prompts) -> list[list[int]]:
    """A list of non-empty lists of Python ints (tensors are accepted and converted)."""
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    checked = []
    for row, prompt in enumerate(prompts):
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise ValueError(f"prompt {row} must be a list of token ids, got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise ValueError(f"prompt {row} is empty; every prompt needs at least one token")
        for position, token in enumerate(prompt):
            if isinstance(token, bool) or not isinstance(token, int):
                raise ValueError(f"prompt {row} has a non-integer token {token!r} at position {position}")
        checked.append([int(t) for t in prompt])
    return checked


def check_prompts_fit(prompts: list[list[int]], model, max_new_tokens: Sequence[int]) -> None:
    """Token ids inside `model`'s vocabulary; prompt + max_new_tokens inside its positions and window."""
    for row, (prompt, new_tokens) in enumerate(zip(prompts, max_new_tokens)):
        bad = [t for t in prompt if not 0 <= t < model.vocab_size]
        if bad:
            raise ValueError(
                f"prompt {row} has token id {bad[0]} outside the {model.role} vocabulary [0, {model.vocab_size})"
            )
        total = len(prompt) + new_tokens
        if model.max_positions is not None and total > model.max_positions:
            raise ValueError(
                f"prompt {row}: {len(prompt)} prompt tokens + max_new_tokens {new_tokens} = {total} exceeds "
                f"the {model.role} model's {model.max_positions} positions ({model.model_type})"
            )
        if model.sliding_window is not None and total > model.sliding_window:
            raise ValueError(
                f"prompt {row}: {total} tokens exceed the {model.role} model's sliding window "
                f"{model.sliding_window} ({model.model_type}); the engine's tree mask supports sequences "
                f"within the window only"
            )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_max_new_tokens(max_new_tokens, num_prompts: int) -> list[int]:
    """An int >= 1 for every prompt, or one int >= 1 per prompt (ValueError naming the bad row)."""
    if isinstance(max_new_tokens, torch.Tensor):
        max_new_tokens = max_new_tokens.tolist()
    if _is_int(max_new_tokens):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1 or one int >= 1 per prompt, got {max_new_tokens!r}")
        return [max_new_tokens] * num_prompts
    if isinstance(max_new_tokens, (str, bytes)) or not isinstance(max_new_tokens, Sequence):
        raise ValueError(f"max_new_tokens must be an int >= 1 or one int >= 1 per prompt, got {max_new_tokens!r}")
    if len(max_new_tokens) != num_prompts:
        raise ValueError(f"max_new_tokens has {len(max_new_tokens)} entries but there are {num_prompts} prompts")
    for row, budget in enumerate(max_new_tokens):
        if not _is_int(budget) or budget < 1:
            raise ValueError(f"max_new_tokens[{row}] (prompt {row}) must be an int >= 1, got {budget!r}")
    return [int(m) for m in max_new_tokens]


def check_eos(eos_token_id) -> list[int]:
    """None, an int or a list of ints -> the list of EOS ids (empty: no EOS)."""
    if eos_token_id is None:
        return []
    ids = [eos_token_id] if _is_int(eos_token_id) else eos_token_id
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)) or not all(_is_int(i) for i in ids):
        raise ValueError(f"eos_token_id must be None, an int or a list of ints, got {eos_token_id!r}")
    return [int(i) for i in ids]


def check_seeds(seed, num_prompts: int) -> list[int]:
    """An int (row i uses seed + i) or one int per prompt (ValueError naming the bad row)."""
    if _is_int(seed):
        return [seed + row for row in range(num_prompts)]
    if isinstance(seed, torch.Tensor):
        seed = seed.tolist()
    if isinstance(seed, (str, bytes)) or not isinstance(seed, Sequence):
        raise ValueError(f"seed must be an int or one int per prompt, got {seed!r}")
    if len(seed) != num_prompts:
        raise ValueError(f"seed has {len(seed)} entries but there are {num_prompts} prompts")
    for row, value in enumerate(seed):
        if not _is_int(value):
            raise ValueError(f"seed[{row}] (prompt {row}) must be an int, got {value!r}")
    return [int(s) for s in seed]
