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

    target, draft: Hugging Face causal LMs sharing a vocabulary (`draft` may be None for
    "autoregressive"). prompts: list of token-id lists. method: "autoregressive",
    "speculative" (one draft: num_drafts is taken as 1), "spectr", "specinfer", "block" (block
    verification of one draft, num_drafts taken as 1), "traversal" (traversal verification of the K
    drafts as one tree; K = 1 is block verification), or "auto" (`spectr.planner`: each
    iteration runs an exact configuration with K <= num_drafts and L <= draft_length, chosen
    online by the measured tokens/s of the batch; `stats.plan` says what ran).
    max_new_tokens: an int or one int per prompt. eos_token_id: None, an int or a list of ints.
    top_k=0 / top_p=1.0 mean no truncation; temperature=0 is greedy (and drafts one path:
    K identical argmax drafts would add nothing). seed: an int (row i uses seed + i) or one
    int per prompt; with a fixed method a row's output depends only on its prompt, its seed, the
    models and the settings (with "auto" its law does too, its exact tokens also depend on the
    schedule of configurations). batch_size: rows in flight; None = all prompts at once, else
    prompts are admitted in order and a finished row's slot takes the next waiting prompt
    (continuous batching; the output is the same). temperature / top_k / top_p: one value or one
    per prompt (each row exact for its own warp); logprobs: also return each generated token's
    log-probability under the warped target law it was drawn from (`output.logprobs`; "raw": the target's
    log-softmax instead, vLLM's default). compile:
    False, True or "auto" (`spectr.native`: Llama / Qwen2 models under torch.compile; "auto" where
    the work pays for the compile time). min_p / logit_bias: vLLM's (`spectr.warps`); top_logprobs=N: each token's N
    most likely tokens too (`output.top_logprobs`); presence_penalty / frequency_penalty / repetition_penalty /
    min_tokens: vLLM's, counted on each draft-tree node's own path (`spectr.penalties`); these with the fixed
    methods only; so are structured_outputs (with the pair's `tokenizer`: `spectr.structured`), allowed_token_ids and
    bad_words (vLLM's; `spectr.generate.generate`). Bad input raises ValueError naming the argument and, per prompt,
    the row.
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
