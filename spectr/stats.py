"""Statistics of one `spectr.generate` call, returned as data (never printed), and the phase timer.

Definitions:
- generated_tokens[i]: tokens emitted for prompt i (EOS included; truncation at EOS or
  max_new_tokens already applied).
- target_calls[i]: target forwards that produced tokens for prompt i (the prompt prefill is
  not counted: it produces no token). Autoregressive decoding therefore has block efficiency 1.
- block_efficiency: sum(generated_tokens) / sum(target_calls), the mean tokens per target call
  (vLLM's "mean acceptance length"); `row_block_efficiency` is the same per prompt.
- accepted_per_position[j]: over all rows and iterations, how often draft position j was
  accepted by the selection (before EOS/length truncation); `tested_positions` counts the draft
  positions the selection examined (accepted ones plus the first rejected one), so
  acceptance_rate = accepted_tokens / tested_positions.
- tokens_per_call_histogram[n]: how many (row, target call) pairs emitted n tokens, after
  truncation; length L+2 so it can be indexed by n = 1..L+1 directly (entry 0 counts the
  calls of rows that stopped with an error there).
- finish_reason[i]: "eos", "length" or "error"; errors[i]: None, or a message naming the row
  and the model whose logits were not finite (the row keeps the tokens generated before).
- iterations: batched target calls (one per engine iteration, prefill excluded);
  verify_tokens: sum over iterations of the target's input width per row (the widest tree of
  the batch, padding included; 1 per call for autoregressive); tree_nodes: sum over (row,
  target call) of the row's own tree nodes (root included), so tree_nodes / total_target_calls
  is the mean tree size (1 + K*L when no drafts share a prefix, L + 1 when all coincide);
  admissions: how often waiting prompts were prefilled into free slots (one prefill each);
  prefilled_rows / shared_prefill_rows: admitted rows whose prompt was run through the models,
  and rows that copied the cache rows of an identical prompt admitted with them instead;
  narrow_iterations: iterations run on fewer slots than the pool has (the slots above the
  highest occupied one are skipped); packed_rows: rows moved into empty lower slots (one copy
  of the row's used cache slots each), so that the iterations cover the live rows only;
  draft_catch_ups: speculative iterations that first fed the draft cache, in one forward, the
  tokens committed by autoregressive iterations before them (per-iteration configurations);
  compiled: the models' forwards ran compiled (`compile=True`, or "auto" decided so; `spectr.native`);
  compile_fallbacks: compiled calls that raised or failed the self-check against the eager forward, and
  compiled selections that raised: each answered eagerly (same tokens), that path eager from then on.
- seconds: wall time split into draft forwards, target forwards, selection (warps, sampling,
  draft selection) and everything else. On CUDA the phases are timed with CUDA events, so the
  loop needs no extra host syncs; on CPU with perf_counter.

Not here: the loop itself (`spectr.generate`), per-token traces.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

PHASES = ("draft", "target", "selection")


@dataclass
class GenerationStats:
    """Per-row lists (index = prompt index) and aggregates of one generate call."""

    method: str
    num_drafts: int
    draft_length: int
    generated_tokens: list[int] = field(default_factory=list)
    target_calls: list[int] = field(default_factory=list)
    finish_reason: list[str] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    tested_positions: int = 0
    tokens_per_call_histogram: list[int] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    iterations: int = 0
    verify_tokens: int = 0
    tree_nodes: int = 0
    admissions: int = 0
    prefilled_rows: int = 0
    shared_prefill_rows: int = 0
    narrow_iterations: int = 0
    packed_rows: int = 0
    draft_catch_ups: int = 0
    plan: str = ""  # method="auto": what the planner chose and predicted
    compiled: bool = False  # the forwards ran compiled (spectr.native)
    compile_seconds: float = 0.0  # compiled: seconds spent compiling (dynamo + inductor), inside the phases' seconds
    compile_fallbacks: int = 0  # compiled: model calls / selections that failed or disagreed with eager (then eager)
    graph_shapes: int = 0  # compiled: concrete shapes the compiled cores of the pair ran with (graphs recorded on CUDA)
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    selection_seconds: float = 0.0
    other_seconds: float = 0.0
    wall_seconds: float = 0.0

    @property
    def total_generated_tokens(self) -> int:
        return int(sum(self.generated_tokens))

    @property
    def total_target_calls(self) -> int:
        return int(sum(self.target_calls))

    @property
    def block_efficiency(self) -> float:
        calls = self.total_target_calls
        return self.total_generated_tokens / calls if calls else 0.0

    @property
    def row_block_efficiency(self) -> list[float]:
        return [g / c if c else 0.0 for g, c in zip(self.generated_tokens, self.target_calls)]

    @property
    def accepted_tokens(self) -> int:
        return int(sum(self.accepted_per_position))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.tested_positions if self.tested_positions else 0.0

    @property
    def mean_verify_width(self) -> float:
        """Target input tokens per row per verify call (padding included)."""
        return self.verify_tokens / self.iterations if self.iterations else 0.0

    @property
    def mean_tree_nodes(self) -> float:
        """Tree nodes per row per target call (0 for autoregressive)."""
        calls = self.total_target_calls
        return self.tree_nodes / calls if calls else 0.0

    @property
    def forward_seconds(self) -> float:
        return self.draft_seconds + self.target_seconds

    def to_dict(self) -> dict:
        """Plain dict of all fields and derived aggregates (JSON-serialisable)."""
        out = asdict(self)
        out.update(
            block_efficiency=self.block_efficiency,
            row_block_efficiency=self.row_block_efficiency,
            accepted_tokens=self.accepted_tokens,
            acceptance_rate=self.acceptance_rate,
            total_generated_tokens=self.total_generated_tokens,
            total_target_calls=self.total_target_calls,
            mean_verify_width=self.mean_verify_width,
            mean_tree_nodes=self.mean_tree_nodes,
        )
        return out

    def add_row(self, row) -> None:
        """Append one finished row (`spectr.batching.FinishedRow`) and add its counters to the totals."""
        self.generated_tokens.append(len(row.tokens))
        self.target_calls.append(row.target_calls)
        self.finish_reason.append(row.finish_reason)
        self.errors.append(row.error)
        for name in ("accepted_per_position", "tokens_per_call_histogram"):
            mine, theirs = getattr(self, name), getattr(row, name)
            setattr(self, name, [a + b for a, b in zip(mine, theirs)] if mine else list(theirs))
        self.tested_positions += row.tested_positions
        self.tree_nodes += row.tree_nodes

    def extend(self, other: GenerationStats) -> None:
        """Append another call's rows (same method and settings) and add its totals (batch_size chunks)."""
        for name in ("generated_tokens", "target_calls", "finish_reason", "errors"):
            getattr(self, name).extend(getattr(other, name))
        for name in ("accepted_per_position", "tokens_per_call_histogram"):
            setattr(self, name, [a + b for a, b in zip(getattr(self, name), getattr(other, name))])
        for name in ("tested_positions", "iterations", "verify_tokens", "tree_nodes", "admissions", "narrow_iterations",
                     "packed_rows", "prefilled_rows", "shared_prefill_rows", "draft_seconds", "target_seconds", "selection_seconds", "other_seconds",
                     "wall_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


class PhaseTimer:
    """Accumulates seconds per phase; CUDA events on GPU (resolved once at the end), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._events: list[tuple[str, object, object]] = []
        self._phase: str | None = None
        self._start = None
        self._wall_start = time.perf_counter()

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, phase: str) -> None:
        self._phase, self._start = phase, self._now()

    def stop(self) -> None:
        end = self._now()
        if self.cuda:
            self._events.append((self._phase, self._start, end))
        else:
            self.seconds[self._phase] += end - self._start
        self._phase = None

    def phase(self, name: str) -> _Phase:
        return _Phase(self, name)

    def collect(self) -> None:
        """Fold the recorded CUDA events into the totals; call right after a host sync (they have all
        completed then), so that a long run keeps no growing list of events. No-op on CPU."""
        for phase, start, end in self._events:
            self.seconds[phase] += start.elapsed_time(end) / 1000.0
        self._events.clear()

    def finish(self, stats: GenerationStats) -> None:
        """Write the phase totals and wall time into `stats` (one device sync on CUDA)."""
        if self.cuda:
            torch.cuda.synchronize()
        self.write(stats)

    def write(self, stats: GenerationStats) -> None:
        """Write the totals so far into `stats`; on CUDA only events already completed may be
        pending (call right after a host sync, or use `finish`)."""
        self.collect()
        wall = time.perf_counter() - self._wall_start
        stats.draft_seconds = self.seconds["draft"]
        stats.target_seconds = self.seconds["target"]
        stats.selection_seconds = self.seconds["selection"]
        stats.wall_seconds = wall
        stats.other_seconds = max(0.0, wall - sum(self.seconds.values()))


class _Phase:
    def __init__(self, timer: PhaseTimer, name: str):
        self.timer, self.name = timer, name

    def __enter__(self):
        self.timer.start(self.name)
        return self

    def __exit__(self, *exc):
        self.timer.stop()
        return False
