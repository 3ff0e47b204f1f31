"""The public `spectr.generate`: a fixed method runs on the engine, `method="auto"` on the planner.

This module sits above both: the engine (`spectr.generate`, `spectr.batching`, ...) never imports
the planner, and `spectr.planner` imports the engine. It only dispatches; the arguments, checks
and behaviour are those of `spectr.generate.generate` (fixed methods) and
`spectr.planner.auto.generate_auto` (`auto`).
"""

from __future__ import annotations

from collections.abc import Sequence

from spectr.generate import GenerationOutput
from spectr.generate import generate as generate_fixed
from spectr.planner.auto import AUTO, generate_auto


def generate(
    target,
    draft,
    prompts: Sequence[Sequence[int]],
    *,
    method: str = "spectr",
    num_drafts: int = 4,
    draft_length: int = 4,
    max_new_tokens: int | Sequence[int] = 64,
    temperature: float | Sequence[float] = 1.0,
    top_k: int | Sequence[int] = 0,
    top_p: float | Sequence[float] = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    seed: int | Sequence[int] = 0,
    batch_size: int | None = None,
    logprobs: bool | str = False,
    compile: bool | str = False,
    min_p: float | Sequence[float] = 0.0,
    logit_bias: dict | Sequence[dict | None] | None = None,
    top_logprobs: int = 0,
    presence_penalty: float | Sequence[float] = 0.0,
    frequency_penalty: float | Sequence[float] = 0.0,
    repetition_penalty: float | Sequence[float] = 1.0,
    min_tokens: int | Sequence[int] = 0,
    structured_outputs=None,
    tokenizer=None,
    allowed_token_ids=None,
    bad_words=None,
) -> GenerationOutput:
    """Generate up to `max_new_tokens` tokens per prompt from `target`, exactly its (warped) distribution.

    target, draft: Hugging Face causal LMs sharing a vocabulary, or a feature draft (`spectr.feature_draft`);
    `draft` may be None for "autoregressive". prompts: token-id lists. method: "autoregressive", "speculative"
    (K = 1), "spectr", "specinfer", "block" (K = 1), "traversal" (K = 1 is block), or "auto" (`spectr.planner`:
    each iteration an exact configuration with K <= num_drafts, L <= draft_length, chosen online by measured
    tokens/s; `stats.plan` says what ran). max_new_tokens, temperature, top_k, top_p, seed: one value or one per
    prompt (an int seed: row i uses seed + i); eos_token_id: None, an int or a list. top_k=0 / top_p=1.0: off;
    temperature=0: greedy. With a fixed method a row's output depends only on its prompt, seed, the models and
    the settings. batch_size: rows in flight (None: all; else continuous batching, same output). logprobs: each
    token's log-probability under the warped law it was drawn from ("raw": the target's log-softmax).
    compile: False, True or "auto" (`spectr.native`). min_p / logit_bias / top_logprobs / the penalties /
    min_tokens: vLLM's (`spectr.warps`, `spectr.penalties`: counted on each draft-tree node's own path), fixed
    methods only; so are the row fields `structured_outputs` (with the pair's `tokenizer`), `allowed_token_ids`
    and `bad_words` (`spectr.generate.generate`). Bad input raises ValueError naming the argument and the row.
    """
    extras = {"min_p": min_p, "logit_bias": logit_bias, "top_logprobs": top_logprobs,
              "presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty,
              "repetition_penalty": repetition_penalty, "min_tokens": min_tokens,
              "structured_outputs": structured_outputs, "tokenizer": tokenizer,
              "allowed_token_ids": allowed_token_ids, "bad_words": bad_words}
    run, arguments = (generate_auto, _auto_extras(extras)) if method == AUTO else (generate_fixed,
                                                                                   {"method": method, **extras})
    return run(target, draft, prompts, num_drafts=num_drafts, draft_length=draft_length,
               max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
               eos_token_id=eos_token_id, seed=seed, batch_size=batch_size, logprobs=logprobs, compile=compile,
               **arguments)


_NEUTRAL = {"min_p": 0.0, "logit_bias": None, "top_logprobs": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "repetition_penalty": 1.0, "min_tokens": 0, "structured_outputs": None, "tokenizer": None,
            "allowed_token_ids": None, "bad_words": None}


def _auto_extras(extras: dict) -> dict:
    """method="auto" takes none of the per-row extras here (they are the fixed methods' keywords): {} when all
    are neutral, else ValueError naming them."""
    set_ = [name for name, value in extras.items() if value != _NEUTRAL[name] and not (name == "logit_bias"
                                                                                      and not value)]
    if set_:
        raise ValueError(f"{', '.join(set_)}: taken by the fixed methods here; with method='auto', admit rows with "
                         "their own SamplingWarp (spectr.planner.AutoBatcher.admit(warps=...))")
    return {}
