"""Per-slot results kept on the device while rows run: outputs, finish reasons, per-row statistics.

`Records` has one entry per slot of the batch (a row of the cache pool), reused by prompt
after prompt: `reset` starts a newly admitted row, `record` takes one iteration's emitted
tokens for the rows that took part and, with tensor ops only, cuts them at the first EOS and
at the row's token budget, appends them to the slot's output buffer, and marks rows that
finished (EOS, length, or non-finite logits); `read` copies finished slots to the host (one
copy for all of them) so that the slots can take the next prompts.

Sizes follow the batcher's bounds (E = Lmax + 1, L = Lmax): an iteration of any L <= Lmax writes
into the same records, so the configuration may change from one iteration to the next.

Layout: `tokens [B, max_new + E]` (E = tokens an iteration can emit), indexed by slot. A row
writes all E emitted tokens at `length + e`; only the first `kept` count, the rest is
overwritten by the next iteration or lies past the final length. Every statistic is kept
per slot (target calls, accepted draft tokens per position, tested positions, tree nodes,
tokens-per-call histogram), so a finished row carries its own numbers and any set of rows
(a shard, a job) sums them exactly, whatever rows shared its batch.

With `logprobs=True`, `logprobs [B, max_new + E]` float32 holds, beside each output token, the
log-probability of that token under the warped target law it was sampled from; it is written
like the tokens and read back with them at retirement (its float32 bits ride the one int64
copy), so it adds no device read.

This module does not run models or select tokens.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

RUNNING, EOS, LENGTH, ERROR, STOP = 0, 1, 2, 3, 4
REASONS = {EOS: "eos", LENGTH: "length", ERROR: "error", STOP: "stop"}  # STOP: ended by the caller (finish_rows)
TARGET_NONFINITE, DRAFT_NONFINITE = 1, 2  # bits of the per-row error flags


@dataclass
class SlotResult:
    """What `Records.read` returns for one finished slot (host values)."""

    slot: int
    tokens: list[int]
    finish_reason: str
    error_flags: int
    target_calls: int
    accepted_per_position: list[int]
    tested_positions: int
    tree_nodes: int
    tokens_per_call_histogram: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, the N most likely (id, log-probability)


class Records:
    """Outputs and counters of `num_slots` slots, written by the rows that occupy them."""

    def __init__(self, num_slots: int, max_new_tokens: int, emit_width: int, draft_length: int,
                 eos_ids: Sequence[int], device, logprobs: bool = False, top_logprobs: int = 0):
        """max_new_tokens: the largest budget any row may have (sizes the output buffer); logprobs: keep
        each output token's log-probability under its warped target law."""
        self.device = device
        self.emit_width = emit_width  # E
        slots, positions = num_slots, max(draft_length, 0)

        def zeros(*shape):
            return torch.zeros(*shape, dtype=torch.int64, device=device)

        self.tokens = zeros(slots, max_new_tokens + emit_width)  # [B, max_new + E]
        self.logprobs = (torch.zeros(slots, max_new_tokens + emit_width, dtype=torch.float32, device=device)
                         if logprobs else None)  # [B, max_new + E]
        self.top = top_logprobs  # N: each output token's N most likely tokens and their log-probabilities
        self.top_ids = zeros(slots, max_new_tokens + emit_width, top_logprobs) if top_logprobs else None  # [B, M, N]
        self.top_values = (torch.zeros(slots, max_new_tokens + emit_width, top_logprobs, dtype=torch.float32,
                                       device=device) if top_logprobs else None)  # [B, M, N]
        self.lengths = zeros(slots)  # [B]
        self.budget = zeros(slots)  # [B] 0 for an empty slot
        self.reason = torch.full((slots,), LENGTH, dtype=torch.int64, device=device)  # [B]
        self.error_flags = zeros(slots)  # [B]
        self.target_calls = zeros(slots)  # [B]
        self.histogram = zeros(slots, max(draft_length, 1) + 2)  # [B, L + 2]
        self.accepted_per_position = zeros(slots, positions)  # [B, L]
        self.tested_positions = zeros(slots)  # [B]
        self.tree_nodes = zeros(slots)  # [B]
        self.eos_ids = torch.tensor(list(eos_ids), dtype=torch.int64, device=device)  # [n_eos]
        self._eos_list = [int(t) for t in eos_ids]  # host copy (set_stops reads no device value)
        # each row's stop tokens (the run's EOS unless the row was admitted with its own set), -1 padded
        self.stop_ids = self._stop_table(slots, [list(eos_ids)] * slots)  # [B, S]
        self.custom_stops = False  # host: some row was admitted with its own stop tokens

    def _stop_table(self, rows: int, stops: list[list[int]]) -> torch.Tensor:
        """[rows, S] each row's stop ids, -1 padded: made on the host (admission only), one copy to the device."""
        width = max([1, *map(len, stops)])
        padded = [list(ids) + [-1] * (width - len(ids)) for ids in stops]
        return torch.tensor(padded, dtype=torch.int64, device=self.device)

    def set_stops(self, slots: torch.Tensor, stops: Sequence[Sequence[int] | None]) -> None:
        """Rows in `slots` ([N] int64) end at the first of their own stop tokens (None: the run's EOS ids; an
        empty list: none, so such a row runs its whole budget). Widens the table when a row brings more ids."""
        stops = [list(self._eos_list) if ids is None else [int(t) for t in ids] for ids in stops]
        rows = self._stop_table(len(stops), stops)  # [N, S']
        width = max(rows.shape[1], self.stop_ids.shape[1])
        if width > self.stop_ids.shape[1]:
            self.stop_ids = torch.nn.functional.pad(self.stop_ids, (0, width - self.stop_ids.shape[1]), value=-1)
        rows = torch.nn.functional.pad(rows, (0, width - rows.shape[1]), value=-1)
        self.stop_ids.index_copy_(0, slots, rows)
        self.custom_stops = True

    def _counters(self) -> list[torch.Tensor]:
        return [self.lengths, self.error_flags, self.target_calls, self.histogram, self.accepted_per_position,
                self.tested_positions, self.tree_nodes]

    @property
    def nbytes(self) -> int:
        tensors = [self.tokens, self.budget, self.reason, self.eos_ids, self.stop_ids, *self._counters()]
        tensors += [t for t in (self.logprobs, self.top_ids, self.top_values) if t is not None]
        return sum(t.untyped_storage().nbytes() for t in tensors)

    def reset(self, slots: torch.Tensor, budgets: torch.Tensor) -> None:
        """Start new rows in `slots` ([N] int64) with token budgets `budgets` ([N] int64 >= 1)."""
        for counter in self._counters():
            counter.index_fill_(0, slots, 0)
        self.budget.index_copy_(0, slots, budgets)
        self.reason.index_fill_(0, slots, RUNNING)

    def move(self, source: torch.Tensor, dest: torch.Tensor) -> None:
        """Rows in slots `source` move to the empty slots `dest` ([M] int64 each)."""
        outputs = [self.tokens] + [t for t in (self.logprobs, self.top_ids, self.top_values) if t is not None]
        for tensor in (*outputs, self.budget, self.reason, self.stop_ids, *self._counters()):
            tensor.index_copy_(0, dest, tensor.index_select(0, source))

    def record(self, slots: torch.Tensor, running: torch.Tensor, emitted: torch.Tensor, counts: torch.Tensor,
               error_flags: torch.Tensor, logprobs: torch.Tensor | None = None,
               top: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One iteration of the rows in `slots`; returns [R] bool, the rows still running afterwards.

        slots [R] slot of each row; running [R] bool rows that took part; emitted [R, E] tokens (the
        first counts[r] are real); error_flags [R] int (0 = fine); logprobs [R, E] float32 of the
        emitted tokens (when the records keep them).
        """
        lengths = self.lengths[slots]  # [R]
        offsets = torch.arange(emitted.shape[1], device=emitted.device)  # [E]
        first_eos = torch.full_like(counts, emitted.shape[1] + 1)  # [R] 1-based, past the end if none
        if self.custom_stops:
            stops = self.stop_ids[slots]  # [R, S] each row's own stop tokens (-1: none)
            is_eos = (emitted[:, :, None] == stops[:, None, :]).any(-1) & (offsets < counts[:, None])  # [R, E]
            first_eos = torch.where(is_eos.any(1), is_eos.to(torch.int8).argmax(1) + 1, first_eos)
        elif self.eos_ids.numel():
            is_eos = (emitted[:, :, None] == self.eos_ids).any(-1) & (offsets < counts[:, None])  # [R, E]
            first_eos = torch.where(is_eos.any(1), is_eos.to(torch.int8).argmax(1) + 1, first_eos)
        healthy = running & (error_flags == 0)  # [R]
        budget = self.budget[slots]  # [R]
        kept = torch.where(healthy, torch.minimum(torch.minimum(counts, first_eos), budget - lengths), 0)  # [R]
        self.tokens[slots[:, None], lengths[:, None] + offsets] = emitted  # see the module docstring
        if self.logprobs is not None:
            self.logprobs[slots[:, None], lengths[:, None] + offsets] = logprobs
        if self.top_ids is not None:  # top: ids [R, E, N], log-probabilities [R, E, N]
            self.top_ids[slots[:, None], lengths[:, None] + offsets] = top[0]
            self.top_values[slots[:, None], lengths[:, None] + offsets] = top[1]
        new_lengths = lengths + kept
        self.lengths[slots] = new_lengths
        eos = healthy & (first_eos <= kept)
        length = healthy & ~eos & (new_lengths >= budget)
        error = running & (error_flags != 0)
        finished = eos | length | error  # [R]
        code = torch.where(eos, EOS, torch.where(length, LENGTH, ERROR))
        self.reason[slots] = torch.where(finished, code, self.reason[slots])
        self.error_flags[slots] |= torch.where(running, error_flags, 0)
        took_part = running.to(torch.int64)  # [R]
        self.target_calls[slots] += took_part
        self.histogram.index_put_((slots, kept), took_part, accumulate=True)
        return running & ~finished

    def record_acceptance(self, slots: torch.Tensor, running: torch.Tensor, num_accepted: torch.Tensor,
                          num_nodes: torch.Tensor, draft_length: int) -> None:
        """Acceptance counters of one speculative iteration of L = `draft_length` (at most the records'
        bound) draft tokens, of the rows in `slots` ([R] each)."""
        positions = torch.arange(self.accepted_per_position.shape[1], device=num_accepted.device)  # [Lmax]
        accepted = (num_accepted[:, None] > positions) & running[:, None]  # [R, Lmax]
        self.accepted_per_position[slots] += accepted.to(torch.int64)
        self.tested_positions[slots] += torch.where(running, (num_accepted + 1).clamp(max=draft_length), 0)
        self.tree_nodes[slots] += torch.where(running, num_nodes, 0)

    def totals(self, occupied: torch.Tensor) -> torch.Tensor:
        """[3] int64 on the device: committed tokens, accepted and tested draft positions, summed over
        the `occupied` ([B] bool) slots; differences between iterations say what one iteration did."""
        weight = occupied.to(torch.int64)  # [B]
        per_slot = torch.stack([self.lengths, self.accepted_per_position.sum(1), self.tested_positions])  # [3, B]
        return (per_slot * weight).sum(1)

    def recent(self, top: int) -> torch.Tensor:
        """[top, 1 + E] int64 on the device: each slot's output length, then its last E output tokens (what
        one iteration may have added; positions before 0 repeat token 0). For callers that watch the tokens
        as they come (stop strings): it rides the iteration's one host copy."""
        lengths = self.lengths[:top]  # [top]
        offsets = torch.arange(self.emit_width, device=lengths.device)  # [E]
        positions = (lengths[:, None] - self.emit_width + offsets).clamp(min=0)  # [top, E]
        return torch.cat([lengths[:, None], self.tokens[:top].gather(1, positions)], 1)

    def read(self, slots: torch.Tensor) -> list[SlotResult]:
        """Copy the rows of `slots` ([F] int64) to the host: one copy for all of them."""
        count = slots.shape[0]
        if count == 0:
            return []
        per_slot = [slots, self.lengths, self.reason, self.error_flags, self.target_calls, self.tested_positions,
                    self.tree_nodes]
        columns = torch.stack([t if t is slots else t[slots] for t in per_slot], 1)  # [F, 7]
        parts = [columns, self.accepted_per_position[slots], self.histogram[slots], self.tokens[slots]]
        if self.logprobs is not None:  # float32 bits as int64, so that one copy carries everything
            parts.append(self.logprobs[slots].view(torch.int32).to(torch.int64))
        if self.top_ids is not None:  # [F, M * N] ids, then [F, M * N] float32 bits
            parts.append(self.top_ids[slots].flatten(1))
            parts.append(self.top_values[slots].view(torch.int32).to(torch.int64).flatten(1))
        host = torch.cat(parts, 1).tolist()  # host copy: the finished rows, once each
        width = self.tokens.shape[1]
        positions, bins = self.accepted_per_position.shape[1], self.histogram.shape[1]
        results = []
        for row in host:
            slot, length, reason, flags, calls, tested, nodes = row[:7]
            histogram_end = 7 + positions + bins
            logprobs = None
            tail = histogram_end + width
            if self.logprobs is not None:
                bits = row[tail : tail + length]
                logprobs = array("f", array("i", bits).tobytes()).tolist()  # the float32 bits back, on the host
                tail += width
            top = None
            if self.top_ids is not None:
                n = self.top
                ids = row[tail : tail + length * n]
                values = array("f", array("i", row[tail + width * n : tail + width * n + length * n]).tobytes())
                top = [list(zip(ids[i * n : (i + 1) * n], values[i * n : (i + 1) * n])) for i in range(length)]
            results.append(SlotResult(
                slot=slot, tokens=row[histogram_end : histogram_end + length], finish_reason=REASONS[reason],
                error_flags=flags, target_calls=calls, accepted_per_position=row[7 : 7 + positions],
                tested_positions=tested, tree_nodes=nodes, tokens_per_call_histogram=row[7 + positions : histogram_end],
                logprobs=logprobs, top_logprobs=top,
            ))
        return results
