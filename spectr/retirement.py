"""Packing and retirement of `spectr.batching.ContinuousBatcher`: the live rows moved down into freed slots,
the iteration's one host copy, and finished rows read back and their slots reset.

`Retirement` is one of the batcher's parts (a mixin): it works on the state the batcher's constructor sets
(the pool: `rows`, `records`, `occupied`, `target_cache`; `_in_slot`, `_free`, `_top`, `rows_running`,
`_totals`; `loop`, `stats`). A finished row comes back as a `FinishedRow` with its own statistics. Not
here: admission, the iteration itself, the compile decision.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

import torch

from spectr.records import DRAFT_NONFINITE, STOP, TARGET_NONFINITE, SlotResult
from spectr.rows import PromptLogprobs


@dataclass
class FinishedRow:
    """One finished prompt: its tokens and its own statistics (see `spectr.stats` for the terms).

    request: admission order over the batcher's life (0, 1, ...); tag: what the caller gave with
    the prompt (`admit(..., tags=...)`), or None.
    """

    request: int
    tag: Any
    tokens: list[int]
    finish_reason: str  # "eos" | "length" | "error" | "stop" (ended by `ContinuousBatcher.finish_rows`)
    target_calls: int
    error: str | None
    accepted_per_position: list[int] = field(default_factory=list)
    tested_positions: int = 0
    tree_nodes: int = 0
    tokens_per_call_histogram: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None  # with logprobs: per token, log q of its warped target law ("raw": log-softmax)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # with top_logprobs=N: per token, N (id, log-prob)
    prompt_logprobs: PromptLogprobs | None = None  # admitted with prompt_logprobs=N: vLLM's, from the prefill

    @property
    def generated_tokens(self) -> int:
        return len(self.tokens)


class Retirement:
    """Packing the live rows (`_pack`), the iteration's host copy (`_sync`), and retiring finished rows
    (`finish_rows`, `_retire`); see the module docstring."""

    def _pack(self) -> None:
        """Move the highest live rows into the empty slots below the live count (host bookkeeping, no sync)."""
        live = self.rows_running
        holes = [slot for slot in range(live) if self._in_slot[slot] is None]
        sources = [slot for slot in range(self._top - 1, live - 1, -1) if self._in_slot[slot] is not None]
        source = torch.tensor(sources, dtype=torch.int64, device=self.device)  # [M]
        dest = torch.tensor(holes, dtype=torch.int64, device=self.device)  # [M]
        loop = self.loop
        caches = [(self.target_cache.rows, loop.target_longest)]
        if self.rows.drafter is not None:
            caches.append((self.rows.drafter.cache.rows, loop.draft_extent[0]))
        for cache, used in caches:  # every row's used slots are below the host bound of its lengths
            cache.move_rows(source, dest, min(cache.capacity, used))
        self.rows.move(source, dest)
        self.records.move(source, dest)
        if self.row_warps is not None:
            self.row_warps.move(source, dest, (sources, holes))
        self.occupied.index_fill_(0, dest, True)
        self.occupied.index_fill_(0, source, False)
        for slot, hole in zip(sources, holes):
            self._in_slot[hole], self._in_slot[slot] = self._in_slot[slot], None
        self._free = list(range(live, self.batch_size))  # already a heap
        self._top = live
        self.stats.packed_rows += len(holes)

    def _sync(self) -> tuple[int, int, int]:
        """The iteration's host copy: running rows, the longest cache rows (they size the next forwards)
        and the records' totals; returns the tokens, accepted and tested positions of the iteration."""
        extent = torch.stack([self.rows.running.sum(), self.target_cache.rows.lengths.max()])  # [2]
        parts = [extent, self.records.totals(self.occupied)]  # [2], [3]
        if self.rows.drafter is not None:
            parts.append(self.rows.drafter.host_extent())  # [2]
        if self.watch_tokens:  # the rows' newest tokens ride the same copy: [top * (1 + E)]
            parts.append(self.records.recent(self._top).reshape(-1))
        host = torch.cat(parts).tolist()  # the host sync of every iteration (the only one with a single draft)
        if self.watch_tokens:
            self._note_recent(host[len(host) - self._top * (1 + self.records.emit_width):])
        self.rows_running, self.loop.target_longest = host[0], host[1]
        if self.rows.drafter is not None:
            self.loop.draft_extent = (host[5], host[6])
        done = [now - before for now, before in zip(host[2:5], self._totals)]
        self._totals = host[2:5]
        return done[0], done[1], done[2]

    def _note_recent(self, values: list[int]) -> None:
        """recent_tokens from `Records.recent`'s host copy (watching only: a host loop over the slots)."""
        width = 1 + self.records.emit_width
        self.recent_tokens = {}
        for slot in range(self._top):
            request = self._in_slot[slot]
            if request is None:
                continue
            length, tail = values[slot * width], values[slot * width + 1 : (slot + 1) * width]
            new = length - self._seen.get(request.request, 0)
            if new > 0:
                self.recent_tokens[request.request] = tail[len(tail) - new :]
                self._seen[request.request] = length

    def finish_rows(self, requests) -> list[FinishedRow]:
        """End the given rows now (request ids; the caller found a stop string in their tokens): they come
        back finished, reason "stop", and their slots take the next prompts. Rows not running are ignored.
        One host copy of those rows, none when no row is given."""
        wanted = set(requests)
        slots = [slot for slot, r in enumerate(self._in_slot) if r is not None and r.request in wanted]
        if not slots:
            return []
        with self._engaged():
            index = torch.tensor(slots, dtype=torch.int64, device=self.device)  # [S]
            self.rows.running.index_fill_(0, index, False)
            self.records.reason.index_fill_(0, index, STOP)
            rows = self._retire_slots(index)
        self.rows_running -= len(slots)
        return rows

    def _retire(self, count: int) -> list[FinishedRow]:
        """Read back the `count` rows that finished in this iteration and reset their slots."""
        finished = self.occupied & ~self.rows.running  # [B]
        index = torch.argsort((~finished).to(torch.int8), stable=True)[:count]  # [F] finished slots, in order
        return self._retire_slots(index)

    def _retire_slots(self, index: torch.Tensor) -> list[FinishedRow]:
        """Read back the finished rows of slots `index` ([F] int64) and reset those slots."""
        results = self.records.read(index)  # host copy: the finished rows
        broken = [r.slot for r in results if r.error_flags]
        self.occupied.index_fill_(0, index, False)
        caches = [self.target_cache.rows] + ([] if self.rows.drafter is None else [self.rows.drafter.cache.rows])
        for cache in caches:
            cache.reset_rows(index)
            if broken:  # a row with non-finite logits may have left non-finite cache entries
                cache.reset_rows(torch.tensor(broken, dtype=torch.int64, device=self.device), zero=True)
        rows = [self._finished_row(result) for result in results]
        for result in results:  # their counters leave the occupied slots' totals
            self._totals[0] -= len(result.tokens)
            self._totals[1] -= sum(result.accepted_per_position)
            self._totals[2] -= result.tested_positions
        for result in results:
            self._seen.pop(self._in_slot[result.slot].request, None)
            self._in_slot[result.slot] = None
            heapq.heappush(self._free, result.slot)
        while self._top and self._in_slot[self._top - 1] is None:
            self._top -= 1
        return rows

    def _finished_row(self, result: SlotResult) -> FinishedRow:
        request = self._in_slot[result.slot]
        error = None
        if result.error_flags:
            models = [m.description for bit, m in ((TARGET_NONFINITE, self.target), (DRAFT_NONFINITE, self.draft))
                      if result.error_flags & bit]
            error = (f"row {request.request}: the {' and the '.join(models)} produced non-finite logits (NaN or "
                     f"inf) after {len(result.tokens)} generated tokens; the row stopped there")
        finish_reason = result.finish_reason
        grammar_error = None if self.row_warps is None else self.row_warps.grammar_error(result.slot)
        if error is None and grammar_error is not None:  # spectr.structured: a dead end of the row's grammar
            error, finish_reason = f"row {request.request}: {grammar_error}", "error"
        return FinishedRow(request=request.request, tag=request.tag, tokens=result.tokens,
                           finish_reason=finish_reason, target_calls=result.target_calls, error=error,
                           accepted_per_position=result.accepted_per_position,
                           tested_positions=result.tested_positions, tree_nodes=result.tree_nodes,
                           tokens_per_call_histogram=result.tokens_per_call_histogram, logprobs=result.logprobs,
                           top_logprobs=result.top_logprobs,
                           prompt_logprobs=None if request.prompt_state is None else
                           PromptLogprobs.read(request.prompt, request.prompt_state))
