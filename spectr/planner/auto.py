"""`method="auto"` for one `spectr.generate` call: the rows run on an `AutoBatcher`.

    spectr.generate(target, draft, prompts, method="auto", num_drafts=4, draft_length=4, ...)

is `generate_auto`: the same checks, admission order and outputs as a fixed method
(`spectr.generate.Generation`), with each iteration's configuration (K <= num_drafts, L <=
draft_length) chosen online by `spectr.planner.chooser.OnlineChooser` from the batch's measured
tokens/s. No calibration phase: every iteration's tokens are kept. `stats.plan` says what ran
(`auto: speculative L=3 for 81% of tokens, ...`).

Not here: the public dispatch (`spectr.api`), the chooser (`spectr.planner.chooser`).
"""

from __future__ import annotations

from collections.abc import Sequence

from spectr.generate import Generation, GenerationOutput, _run
from spectr.planner.batcher import AUTO, AutoBatcher

__all__ = ["AUTO", "generate_auto"]


def generate_auto(target, draft, prompts: Sequence[Sequence[int]], *, num_drafts: int = 4, draft_length: int = 4,
                  max_new_tokens: int | Sequence[int] = 64, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0, eos_token_id=None, seed: int | Sequence[int] = 0,
                  batch_size: int | None = None, warm_state: dict | None = None,
                  logprobs: bool | str = False, compile: bool | str = False) -> GenerationOutput:
    """`spectr.generate(method="auto")`; warm_state: a `chooser.state()` of an earlier run to start from."""
    def make_batcher(target, draft, *, method, num_drafts, draft_length, **arguments):
        return AutoBatcher(target, draft, max_num_drafts=num_drafts, max_draft_length=draft_length,
                           warm_state=warm_state, **arguments)

    generation = Generation(target, draft, prompts, method="spectr", num_drafts=num_drafts,
                            draft_length=draft_length, max_new_tokens=max_new_tokens, temperature=temperature,
                            top_k=top_k, top_p=top_p, eos_token_id=eos_token_id, seed=seed, batch_size=batch_size,
                            make_batcher=make_batcher, logprobs=logprobs, compile=compile)
    output = _run(generation)
    output.stats.plan = generation.batcher.chooser.describe()
    output.chooser = generation.batcher.chooser
    return output
