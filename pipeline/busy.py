"""Progress of the long operations in a worker process that are not engine iterations, for the stall watchdog.

    busy.watch_compiles()      # once per process (the worker's start): torch.compile reports here
    busy.advance()             # a long read moved on (a block of a compressed stream skipped or read)
    busy.report()              # in the actor's ping: {"busy_ticks": n, "compiling_s": seconds or None}

The driver restarts a busy actor whose progress stays put for `ray.stall_timeout_s`
(`pipeline.generate.scheduler`). Two kinds of real work would look like a hang to it:

- a compile: the first call of a compiled model (`spectr.compile`, `spectr.native`), a new shape class, or
  CUDA graph recording, runs for seconds to minutes inside one call. torch reports every compile's start and
  end to the callbacks of `torch._dynamo.callback_handler` (dynamo's frames, CUDA graph recording); ours keep
  when the current compile started, and count each compile that ended as progress. The ping says
  `compiling_s`, and the driver does not count a compile's time as a stall (up to its own, longer limit);
- skipping ahead in a compressed stream to a shard's first byte (`pipeline.prompts.ReadCache.text_range`):
  each block read advances `busy_ticks`, which the ping adds to the actor's progress.

Process-wide: one actor is one process. `torch._dynamo.reset()` drops every registered callback, so
`report()` registers ours again when they are gone (a compile already running then is not seen as one).
"""

from __future__ import annotations

import threading
import time
from typing import Any

_lock = threading.Lock()
_ticks = 0  # long-read blocks and finished compiles so far
_compile_since: float | None = None  # monotonic start of the compile running now
_callbacks: tuple[Any, Any] | None = None


def advance(steps: int = 1) -> None:
    """A long operation moved on (the watchdog's progress)."""
    global _ticks
    with _lock:
        _ticks += steps


def _compile_started(_args: Any = None) -> None:
    global _compile_since
    with _lock:
        _compile_since = time.monotonic()


def _compile_ended(_args: Any = None) -> None:
    global _compile_since, _ticks
    with _lock:
        _compile_since = None
        _ticks += 1


def watch_compiles() -> None:
    """Register the compile callbacks with torch (again, if `torch._dynamo.reset()` dropped them)."""
    global _callbacks
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # a torch without compile callbacks: compiles are not reported
        return
    if _compile_started in callback_handler.start_callbacks:
        return
    callback_handler.register_start_callback(_compile_started)
    callback_handler.register_end_callback(_compile_ended)
    _callbacks = (_compile_started, _compile_ended)


def compiling_s() -> float | None:
    """How long the compile running now has run (None: none is)."""
    with _lock:
        return None if _compile_since is None else time.monotonic() - _compile_since


def report() -> dict[str, Any]:
    """What the actor's ping adds: `busy_ticks` (progress) and `compiling_s` (a compile running now)."""
    if _callbacks is not None:
        watch_compiles()
    with _lock:
        return {"busy_ticks": _ticks,
                "compiling_s": None if _compile_since is None else time.monotonic() - _compile_since}
