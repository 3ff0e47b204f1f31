"""Per-prompt results kept on the device while the loop runs: outputs, finish reasons, statistics.

`Records.record` takes one iteration's emitted tokens for every row of the batch and, with
tensor ops only, cuts them at the first EOS and at the row's token budget, appends them to
the prompt's output buffer, and marks rows that finished (EOS, length, or non-finite
logits). Nothing is read on the host until `read`, once, at the end of the generation, so
the loop's only host copies are the few ints it needs to size the next forward.

Layout: `tokens [P, max_new + E]` (E = tokens an iteration can emit), indexed by prompt, so
dropping finished rows from the batch never moves an output. A row writes all E emitted
tokens at `length + e`; only the first `kept` count, the rest is overwritten by the next
iteration or lies past the final length.

This module does not run models or select tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spectr.stats import GenerationStats

RUNNING, EOS, LENGTH, ERROR = 0, 1, 2, 3
REASONS = {EOS: "eos", LENGTH: "length", ERROR: "error"}
TARGET_NONFINITE, DRAFT_NONFINITE = 1, 2  # bits of the per-row error flags


class Records:
    """Outputs and counters of `num_prompts` prompts, written by rows through their prompt index."""

    def __init__(self, num_prompts: int, max_new_tokens: Sequence[int], emit_width: int, draft_length: int,
                 eos_ids: Sequence[int], device):
        self.device = device
        self.emit_width = emit_width  # E
        width = max(max_new_tokens, default=0) + emit_width
        self.tokens = torch.zeros(num_prompts, width, dtype=torch.int64, device=device)  # [P, max_new + E]
        self.lengths = torch.zeros(num_prompts, dtype=torch.int64, device=device)  # [P]
        self.budget = torch.tensor(list(max_new_tokens), dtype=torch.int64, device=device)  # [P]
        self.reason = torch.full((num_prompts,), LENGTH, dtype=torch.int64, device=device)  # [P]
        self.error_flags = torch.zeros(num_prompts, dtype=torch.int64, device=device)  # [P]
        self.target_calls = torch.zeros(num_prompts, dtype=torch.int64, device=device)  # [P]
        self.histogram = torch.zeros(max(draft_length, 1) + 2, dtype=torch.int64, device=device)  # [L + 2]
        self.accepted_per_position = torch.zeros(draft_length, dtype=torch.int64, device=device)  # [L]
        self.tested_positions = torch.zeros((), dtype=torch.int64, device=device)
        self.tree_nodes = torch.zeros((), dtype=torch.int64, device=device)
        self.eos_ids = torch.tensor(list(eos_ids), dtype=torch.int64, device=device)  # [n_eos]

    def start(self, running: torch.Tensor) -> None:
        """running [P] bool: those prompts' rows begin (reason "running" until they finish); the
        others (max_new_tokens 0) are finished by length with no token."""
        self.reason = torch.where(running, RUNNING, LENGTH)

    def record(self, prompts: torch.Tensor, running: torch.Tensor, emitted: torch.Tensor, counts: torch.Tensor,
               error_flags: torch.Tensor) -> torch.Tensor:
        """One iteration of every row; returns [B] bool, the rows still running afterwards.

        prompts [B] prompt index of each row; running [B] bool rows that took part; emitted [B, E]
        tokens (the first counts[b] are real); error_flags [B] int (0 = fine).
        """
        lengths = self.lengths[prompts]  # [B]
        offsets = torch.arange(emitted.shape[1], device=emitted.device)  # [E]
        first_eos = torch.full_like(counts, emitted.shape[1] + 1)  # [B] 1-based, past the end if none
        if self.eos_ids.numel():
            is_eos = (emitted[:, :, None] == self.eos_ids).any(-1) & (offsets < counts[:, None])  # [B, E]
            first_eos = torch.where(is_eos.any(1), is_eos.to(torch.int8).argmax(1) + 1, first_eos)
        healthy = running & (error_flags == 0)  # [B]
        room = self.budget[prompts] - lengths  # [B]
        kept = torch.where(healthy, torch.minimum(torch.minimum(counts, first_eos), room), 0)  # [B]
        self.tokens[prompts[:, None], lengths[:, None] + offsets] = emitted  # see the module docstring
        new_lengths = lengths + kept
        self.lengths[prompts] = new_lengths
        eos = healthy & (first_eos <= kept)
        length = healthy & ~eos & (new_lengths >= self.budget[prompts])
        error = running & (error_flags != 0)
        finished = eos | length | error  # [B]
        code = torch.where(eos, EOS, torch.where(length, LENGTH, ERROR))
        self.reason[prompts] = torch.where(finished, code, self.reason[prompts])
        self.error_flags[prompts] |= torch.where(running, error_flags, 0)
        self.target_calls[prompts] += running.to(torch.int64)
        self.histogram.scatter_add_(0, kept, running.to(torch.int64))
        return running & ~finished

    def record_acceptance(self, running: torch.Tensor, num_accepted: torch.Tensor, num_nodes: torch.Tensor) -> None:
        """Acceptance counters of one speculative iteration, over the rows that took part ([B] each)."""
        draft_length = self.accepted_per_position.shape[0]
        positions = torch.arange(draft_length, device=num_accepted.device)  # [L]
        self.accepted_per_position += ((num_accepted[:, None] > positions) & running[:, None]).sum(0)
        self.tested_positions += torch.where(running, (num_accepted + 1).clamp(max=draft_length), 0).sum()
        self.tree_nodes += torch.where(running, num_nodes, 0).sum()

    def read(self, stats: GenerationStats, describe_error) -> list[list[int]]:
        """Copy everything to the host (one copy) and fill `stats`; returns the tokens per prompt.

        describe_error(prompt index, error flags, generated tokens) -> the row's error message.
        """
        parts = [self.lengths, self.reason, self.error_flags, self.target_calls, self.histogram,
                 self.accepted_per_position, self.tested_positions[None], self.tree_nodes[None],
                 self.tokens.reshape(-1)]
        host = torch.cat(parts).tolist()  # the one host copy at the end of the generation
        num_prompts = self.lengths.shape[0]
        sizes = [num_prompts] * 4 + [self.histogram.numel(), self.accepted_per_position.numel(), 1, 1]
        fields, start = [], 0
        for size in sizes:
            fields.append(host[start : start + size])
            start += size
        lengths, reason, flags, calls, histogram, accepted, tested, nodes = fields
        width = self.tokens.shape[1]
        tokens = [host[start + i * width : start + i * width + n] for i, n in enumerate(lengths)]
        stats.generated_tokens, stats.target_calls = lengths, calls
        stats.finish_reason = [REASONS[r] for r in reason]
        stats.errors = [describe_error(i, f, n) if f else None for i, (f, n) in enumerate(zip(flags, lengths))]
        stats.tokens_per_call_histogram, stats.accepted_per_position = histogram, accepted
        stats.tested_positions, stats.tree_nodes = tested[0], nodes[0]
        return tokens
