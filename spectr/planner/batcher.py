"""`AutoBatcher`: a `spectr.ContinuousBatcher` whose every iteration runs the online chooser's configuration.

    batcher = AutoBatcher(target, draft, batch_size=8, max_num_drafts=4, max_draft_length=4)
    batcher.admit(prompts, max_new_tokens=64, seed=0)
    for row in batcher.finished(): ...
    batcher.chooser.describe()   # "auto: speculative L=3 for 81% of tokens, ..."

Same surface as `ContinuousBatcher` (admit, step, finished, snapshot, idle, waiting, in_flight,
pool_nbytes, stats, batch_size, max_length, target, draft); before each iteration it asks the
chooser (`spectr.planner.chooser.OnlineChooser`) for a configuration within the bounds, after it
feeds the chooser the iteration's `StepReport`. The caches, records and drafter are allocated once
for the bounds, so any candidate runs on the same rows, cache pool and random streams.

Exactness: every iteration samples the target's conditional law exactly, whatever configuration
ran it, so the rows' output LAW is the target's; a row's exact tokens depend on the schedule of
configurations (which depends on timings), unlike a fixed method's.

Not here: the choice itself (`spectr.planner.chooser`), the engine (`spectr.batching`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from spectr.batching import ContinuousBatcher, FinishedRow
from spectr.planner.chooser import OnlineChooser, default_candidates
from spectr.planner.prior import PriorLatencies, prior_tokens_per_second
from spectr.stats import GenerationStats
from spectr.steps import AUTOREGRESSIVE, StepConfig, StepReport

AUTO = "auto"


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


class AutoBatcher:
    """Continuous batching with a configuration chosen online per iteration; see the module docstring.

    max_num_drafts / max_draft_length bound the candidates (K <= max_num_drafts, L <= max_draft_length);
    draft=None: autoregressive only. warm_state: a `chooser.state()` of an earlier run (same pair,
    device, dtype, batch size and warps) to start from. candidates: the configurations to choose among
    (default `default_candidates` within the bounds). compile: passed to the `ContinuousBatcher`; the
    compiled graphs are shared by every candidate (rows, widths and cache length are dynamic dims, see
    `spectr.native`), so exploring candidates compiles no graph per candidate.
    """

    def __init__(self, target, draft, *, batch_size: int, max_length: int | None = None, max_num_drafts: int = 4,
                 max_draft_length: int = 4, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 eos_token_id=None, pack_below: float | None = None, warm_state: dict | None = None,
                 candidates: Sequence[StepConfig] | None = None, logprobs: bool | str = False,
                 compile: bool | str = False, top_logprobs: int = 0):
        speculative = draft is not None
        # allocate for what a candidate may run, not for the bounds: the default candidates stop at K = L = 4
        widest = list(candidates) if candidates is not None else default_candidates(
            max_num_drafts, max_draft_length, speculative=speculative)
        bounds = {"max_num_drafts": min(max_num_drafts, max([c.num_drafts for c in widest] + [1])),
                  "max_draft_length": min(max_draft_length, max([c.draft_length for c in widest] + [1]))}
        bounds = bounds if speculative else {}
        self.batcher = ContinuousBatcher(target, draft, batch_size=batch_size, max_length=max_length,
                                         method=AUTOREGRESSIVE, temperature=temperature, top_k=top_k, top_p=top_p,
                                         eos_token_id=eos_token_id, pack_below=pack_below, logprobs=logprobs, top_logprobs=top_logprobs,
                                         compile=compile, **bounds)
        max_k, max_l = self.batcher.bounds
        if candidates is None:
            candidates = default_candidates(max_k, max_l, greedy=self.batcher.settings.warp.greedy,
                                            speculative=speculative)
        candidates = [self.batcher.check_config(c) for c in candidates]
        latencies = PriorLatencies(parameter_count(self.batcher.target.model),
                                   parameter_count(self.batcher.draft.model) if speculative else 0,
                                   self.batcher.target.vocab_size)
        self.chooser = OnlineChooser(
            list(dict.fromkeys(candidates)),
            lambda config, rows, acceptance: prior_tokens_per_second(latencies, config, rows, acceptance),
            warm_state=warm_state)
        stats = self.batcher.stats
        stats.method, stats.num_drafts, stats.draft_length = AUTO, max_k, max_l

    # -- the ContinuousBatcher surface ------------------------------------------------------------
    @property
    def stats(self) -> GenerationStats:
        return self.batcher.stats

    @property
    def batch_size(self) -> int:
        return self.batcher.batch_size

    @property
    def max_length(self) -> int:
        return self.batcher.max_length

    @property
    def target(self):
        return self.batcher.target

    @property
    def draft(self):
        return self.batcher.draft

    @property
    def waiting(self) -> int:
        return self.batcher.waiting

    @property
    def in_flight(self) -> int:
        return self.batcher.in_flight

    @property
    def idle(self) -> bool:
        return self.batcher.idle

    @property
    def pool_nbytes(self) -> int:
        return self.batcher.pool_nbytes

    @property
    def loop(self):
        return self.batcher.loop

    @property
    def rows(self):
        return self.batcher.rows

    @property
    def records(self):
        return self.batcher.records

    @property
    def last_step(self) -> StepReport | None:
        return self.batcher.last_step

    @property
    def config(self) -> StepConfig:
        """The configuration of the last iteration (the chooser's current one)."""
        return self.chooser.current

    def admit(self, prompts, *, max_new_tokens: int | Sequence[int] = 64, seed: int | Sequence[int] = 0,
              tags: Sequence[Any] | None = None, warps=None, stop_token_ids=None) -> list[int]:
        return self.batcher.admit(prompts, max_new_tokens=max_new_tokens, seed=seed, tags=tags, warps=warps,
                                  stop_token_ids=stop_token_ids)

    def fill(self) -> None:
        """Move waiting prompts into free slots (`ContinuousBatcher.fill`)."""
        self.batcher.fill()

    def step(self) -> list[FinishedRow]:
        """Fill free slots, run one iteration of the chooser's configuration, report it to the chooser."""
        batcher = self.batcher
        free = batcher.batch_size - batcher.in_flight
        rows = batcher.rows_running + min(free, batcher.waiting)  # live rows once the free slots are filled
        if rows == 0:
            return batcher.step()
        catch_ups = batcher.stats.draft_catch_ups
        compiled = batcher.compile_seconds()
        finished = batcher.step(self.chooser.choose(rows))
        if batcher.last_step is not None:
            # an iteration that first fed the draft the tokens of earlier autoregressive iterations pays for
            # the switch, not for its configuration, and one that compiled pays for the compiler: their
            # tokens count, their seconds are not a sample
            measure = batcher.stats.draft_catch_ups == catch_ups and batcher.compile_seconds() == compiled
            self.chooser.observe(batcher.last_step, measure=measure)
        return finished

    def finished(self) -> Iterator[FinishedRow]:
        while not self.idle:
            yield from self.step()

    def snapshot(self) -> GenerationStats:
        stats = self.batcher.snapshot()
        stats.plan = self.chooser.describe()
        return stats

    def compile_seconds(self) -> float:
        return self.batcher.compile_seconds()
