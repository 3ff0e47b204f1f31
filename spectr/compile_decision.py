"""The compile decision of `spectr.batching.ContinuousBatcher`: whether its Llama / Qwen2 models run compiled,
decided once before the first iteration, and what compiling cost and fell back.

`CompileDecision` is one of the batcher's parts (a mixin) over the batcher's `compile` argument, its wrapped
models, queue and caches. The rule for `compile="auto"` is `spectr.native.auto_compile`; what compiles and
how: `spectr.native`. Not here: admission, iterations, retirement.
"""

from __future__ import annotations

from spectr.native import NativeCausalLM, auto_compile, compile_seconds_so_far


class CompileDecision:
    """`_decide_compile` (once, at the first step), `compile_seconds`, `_count_fallbacks`."""

    def _decide_compile(self) -> None:
        """Compile the native models now (compile=True), never (False), or when the queued work pays for it
        ("auto": `spectr.native.auto_compile`); decided once, before the first iteration."""
        models = [m for m in (self.target, self.draft) if isinstance(m, NativeCausalLM)]
        if self.compile == "auto":
            queued = sum(r.budget for r in self._waiting) + sum(r.budget for r in self._in_slot if r is not None)
            compiled = bool(models) and auto_compile(self.device, queued, self.batch_size)
        else:
            compiled = bool(models) and self.compile
        self._compile_base = compile_seconds_so_far()
        for model in models:
            model.set_compiled(compiled)  # may refuse (ValueError): then nothing is decided, nothing half set
        draft_cache = getattr(self.rows.drafter, "cache", None)
        for model, cache in ((self.target, self.target_cache), (self.draft, draft_cache)):
            if compiled and isinstance(model, NativeCausalLM) and cache is not None:
                model.take_pool(cache.rows)  # the model's static pool, before any view of the cache is taken
        self.compiled = self.loop.compiled = self.stats.compiled = compiled

    def _count_fallbacks(self) -> None:
        """GenerationStats.compile_fallbacks: compiled model calls and selections answered eagerly (host ints)."""
        models = [m for m in (self.target, self.draft) if isinstance(m, NativeCausalLM)]
        self.stats.compile_fallbacks = sum(m.compile_fallbacks for m in models) + self.loop.selection_fallbacks
        self.stats.graph_shapes = sum(len(m.state.graph_shapes) for m in models)

    def compile_seconds(self) -> float:
        """Compiled mode: what this process compiled since this batcher's first step (dynamo's timer; 0 eager)."""
        return max(0.0, compile_seconds_so_far() - self._compile_base) if self.compiled else 0.0
