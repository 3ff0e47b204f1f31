"""Admission and prefill sharing of `spectr.batching.ContinuousBatcher`: queue prompts, move them into free
slots, and prefill each distinct prompt once.

`Admission` is one of the batcher's parts (a mixin): it works on the state the batcher's constructor sets
(`settings`, `max_length`, the pool: `rows`, `records`, `occupied`, `target_cache`; the queue `_waiting`, the
free-slot heap `_free`, `_in_slot`, `_top`; `loop`, `stats`) and runs the prompt forward through the
batcher's `_prefill_rows`. A row admitted with its own warp switches the pool to per-row warps. Admission
reads nothing back from the device. Not here: iterations, retirement, the compile decision.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spectr.feature_draft import FeatureDrafter
from spectr.rng import row_keys
from spectr.settings import check_max_new_tokens, check_prompts, check_prompts_fit, check_seeds
from spectr.warps import RowWarps, SamplingWarp


@dataclass
class _Request:
    request: int
    prompt: list[int]
    budget: int
    seed: int
    tag: Any
    warp: SamplingWarp | None = None  # None: the run's warp
    stops: tuple[int, ...] | None = None  # None: the run's EOS ids end the row; else these tokens (empty: none)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs=N (None: not asked)
    prompt_state: tuple | None = None  # its `prompt_logprob_tensors` (device), set at the prefill


class Admission:
    """Queueing prompts (`admit`) and moving them into free slots (`fill`); see the module docstring."""

    def admit(self, prompts, *, max_new_tokens: int | Sequence[int] = 64, seed: int | Sequence[int] = 0,
              tags: Sequence[Any] | None = None, warps: Sequence[SamplingWarp | None] | None = None,
              stop_token_ids: Sequence[Sequence[int] | None] | None = None,
              prompt_logprobs: Sequence[int | None] | None = None) -> list[int]:
        """Queue prompts (token-id lists), in order; returns their request ids.

        max_new_tokens: an int >= 1 or one per prompt; seed: an int (prompt i uses seed + i) or one
        per prompt; tags: None or one value per prompt, returned with the row; warps: None or one
        `SamplingWarp` (or None: the run's) per prompt, the law that row samples (rows of several
        warps share the batch, each exact for its own; penalties and min_tokens are counted on each draft-tree
        node's own path, `spectr.penalties`); stop_token_ids: None or one entry per prompt, None (the
        run's EOS ids end it) or the token ids that end that row instead (vLLM's stop_token_ids, with its EOS
        unless ignore_eos; an empty list: the row runs its whole budget); prompt_logprobs: None or one
        entry per prompt, None or vLLM's N >= 0 (`FinishedRow.prompt_logprobs`: each prompt token's
        log-probability and rank under the target, and the N most likely tokens at each position).
        """
        checked = check_prompts(prompts)
        budgets = check_max_new_tokens(max_new_tokens, len(checked))
        seeds = check_seeds(seed, len(checked))
        for name, values in (("tags", tags), ("warps", warps), ("stop_token_ids", stop_token_ids),
                             ("prompt_logprobs", prompt_logprobs)):
            if values is not None and len(values) != len(checked):
                raise ValueError(f"{name} has {len(values)} entries but there are {len(checked)} prompts")
        if warps is not None and not all(w is None or isinstance(w, SamplingWarp) for w in warps):
            raise ValueError("warps must be None or one SamplingWarp (or None) per prompt")
        if prompt_logprobs is not None and not all(n is None or (isinstance(n, int) and not isinstance(n, bool)
                                                                 and n >= 0) for n in prompt_logprobs):
            raise ValueError(f"prompt_logprobs must be None or one int >= 0 (or None) per prompt, got {prompt_logprobs!r}")
        for model in (self.target, self.draft):
            if model is not None:
                check_prompts_fit(checked, model, budgets)
        for row, (prompt, budget) in enumerate(zip(checked, budgets)):
            if len(prompt) + budget > self.max_length:
                raise ValueError(f"prompt {row}: {len(prompt)} prompt tokens + max_new_tokens {budget} = "
                                 f"{len(prompt) + budget} exceeds the batcher's max_length {self.max_length}")
        first = self._next_request
        self._next_request += len(checked)
        for row, (prompt, budget, row_seed) in enumerate(zip(checked, budgets, seeds)):
            stops = None if stop_token_ids is None or stop_token_ids[row] is None else tuple(stop_token_ids[row])
            self._waiting.append(_Request(first + row, prompt, budget, row_seed, None if tags is None else tags[row],
                                          None if warps is None else warps[row], stops,
                                          None if prompt_logprobs is None else prompt_logprobs[row]))
        return list(range(first, self._next_request))

    def fill(self) -> None:
        """Move waiting prompts into free slots: prefill of those rows only. No host sync."""
        count = min(len(self._free), len(self._waiting))
        if count == 0:
            return
        if self.in_flight == 0:
            self.loop.draft_lag = 0  # every row is new: their draft caches are prefilled, nothing to catch up
        with self._engaged():
            requests = [self._waiting.popleft() for _ in range(count)]
            slots = sorted(heapq.heappop(self._free) for _ in range(count))
            index = torch.tensor(slots, dtype=torch.int64, device=self.device)  # [N]
            prompts = [r.prompt for r in requests]
            self._prefill(slots, requests)
            self._set_warps(index, requests, slots)
            last_tokens = torch.tensor([p[-1] for p in prompts], dtype=torch.int64, device=self.device)  # [N]
            self.rows.admit(index, last_tokens, row_keys([r.seed for r in requests], self.device))
            self.occupied.index_fill_(0, index, True)
            budgets = torch.tensor([r.budget for r in requests], dtype=torch.int64, device=self.device)  # [N]
            self.records.reset(index, budgets)
            if self.records.custom_stops or any(r.stops is not None for r in requests):
                self.records.set_stops(index, [r.stops for r in requests])
        for slot, request in zip(slots, requests):
            self._in_slot[slot] = request
        self._top = max(self._top, slots[-1] + 1)
        self.rows_running += count
        longest = max(len(p) for p in prompts)
        loop = self.loop
        loop.target_longest = max(loop.target_longest, longest - 1)
        loop.draft_extent = (max(loop.draft_extent[0], longest), max(loop.draft_extent[1], 1))
        self.stats.admissions += 1

    def _prefill(self, slots: list[int], requests: list[_Request]) -> None:
        """Prefill the new rows, once per distinct prompt: a row whose prompt a live row or another new row
        already holds copies that row's prompt slots instead (both caches are left-aligned, so a row's
        first len(prompt) - 1 slots are its prompt whatever it generated since). One forward per model
        for the prompts no slot holds; the samples of a prompt share its prefill this way. Rows that ask
        for prompt_logprobs run in a forward of their own that keeps every position's logits (shared only
        with a row of this admission that asks the same), so that the other rows keep only their last."""
        holders = {tuple(r.prompt): slot for slot, r in enumerate(self._in_slot) if r is not None}  # live rows
        copies: list[tuple[int, int, int]] = []  # (source slot, dest slot, prompt length - 1)
        groups: dict[bool, list[tuple[int, _Request]]] = {False: [], True: []}  # keeps logits -> its rows
        asked: dict[tuple, _Request] = {}  # (prompt, N) -> the row of this admission that computes it
        for slot, request in zip(slots, requests):  # admission (host), not the per-iteration loop
            key, wants = tuple(request.prompt), request.prompt_logprobs is not None
            source = asked.get((key, request.prompt_logprobs)) if wants else None
            if self.share_prefill and key in holders and (not wants or source is not None):
                copies.append((holders[key], slot, len(request.prompt) - 1))
                if source is not None:
                    request.prompt_state = source  # filled in below, with the source's forward
            else:
                holders[key] = slot
                groups[wants].append((slot, request))
                if wants:
                    asked[(key, request.prompt_logprobs)] = request
        for keep, rows in groups.items():
            if rows:
                self._prefill_rows([slot for slot, _ in rows], [r for _, r in rows], keep)
        for request in requests:
            if isinstance(request.prompt_state, _Request):
                request.prompt_state = request.prompt_state.prompt_state
        if copies:
            self._copy_prompts(copies)
        self.stats.prefilled_rows += sum(map(len, groups.values()))
        self.stats.shared_prefill_rows += len(copies)

    def _copy_prompts(self, copies: list[tuple[int, int, int]]) -> None:
        """Rows whose prompt another slot holds: (source slot, dest slot, prompt length - 1) each."""
        source, dest, lengths = (torch.tensor(c, dtype=torch.int64, device=self.device)
                                 for c in zip(*copies))  # [C] each
        drafter = self.rows.drafter
        caches = [("target", self.target_cache)]
        if drafter is not None and not isinstance(drafter, FeatureDrafter):
            caches.append(("draft", drafter.cache))
        for phase, cache in caches:
            with self.loop.timer.phase(phase):
                cache.rows.copy_rows(source, dest, max(c[2] for c in copies))
                cache.rows.lengths.index_copy_(0, dest, lengths)
        if isinstance(drafter, FeatureDrafter):
            with self.loop.timer.phase("draft"):
                drafter.prefill_rows(dest[:0], [], None, copies)

    def _set_warps(self, index: torch.Tensor, requests: list[_Request], slots: list[int]) -> None:
        """Rows with their own warp: the pool switches to per-row warps (`RowWarps`) on the first one."""
        if self.row_warps is None:
            if all(r.warp is None for r in requests):
                return
            self.row_warps = RowWarps(self.batch_size, self.settings.warp, self.device, self.target.vocab_size)
            self.loop.warp = self.row_warps
            if self.rows.drafter is not None:
                self.rows.drafter.warp = self.row_warps
        warps = [self.settings.warp if r.warp is None else r.warp for r in requests]
        penalised = self.row_warps.path_dependent or any(w.path_dependent for w in warps)
        self.row_warps.set(index, warps, slots, prompts=[r.prompt for r in requests] if penalised else None,
                           stops=[self.settings.eos_ids if r.stops is None else r.stops for r in requests]
                           if penalised else None)  # repetition reads the prompt, min_tokens masks the stops
