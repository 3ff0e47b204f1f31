"""Diagnostics for the engine: counting the operations that would wait for an accelerator.

`HostSyncCounter` is a `TorchFunctionMode` that counts, while it is active, every torch call
that makes the host read a device value: `.item()`, `.tolist()`, `.cpu()`/`.numpy()`/`.to("cpu")`,
`bool()`/`int()`/`float()` of a tensor, `nonzero`/one-argument `where`, boolean-mask indexing,
`masked_select`, `unique`, `equal`/`allclose`. On CPU these are cheap, but on CUDA each one stalls
the stream until the device catches up, so the count is what matters for accelerators and can be
measured on any machine. On CUDA, `torch.cuda.set_sync_debug_mode` is the device's own count
(`scripts/gpu_speed.py` reports both).

`inside_module` attributes reads to a model instead: while that module's forward runs, reads
are counted in `model_by_kind`, not `by_kind`, so the engine's own reads can be told from the
model's. (On a CPU run a model's `.to(x.device)` is counted as "cpu" since it cannot be told
from a host copy; on CUDA it is a host-to-device copy or a no-op.)

Not here: timing (see `spectr.stats.PhaseTimer`), anything that changes what the engine computes.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

_READS = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index",
    torch.Tensor.nonzero: "nonzero",
    torch.nonzero: "nonzero",
    torch.argwhere: "nonzero",
    torch.Tensor.masked_select: "masked_select",
    torch.masked_select: "masked_select",
    torch.unique: "unique",
    torch.Tensor.unique: "unique",
    torch.equal: "equal",
    torch.allclose: "allclose",
    torch.Tensor.allclose: "allclose",
}


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _to_host(args, kwargs) -> bool:
    targets = list(args[1:]) + [kwargs.get("device")]
    for t in targets:
        if isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu":
            return True
    return False


class HostSyncCounter(TorchFunctionMode):
    """Counts host reads of tensor values while active; `by_kind` says which operations.

    Usage:
        with HostSyncCounter() as syncs:
            spectr.generate(...)
        syncs.total, syncs.by_kind
    """

    def __init__(self):
        super().__init__()
        self.by_kind: Counter[str] = Counter()
        self.model_by_kind: Counter[str] = Counter()
        self._depth = 0
        self._in_model = 0
        self._hooks: list = []

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def inside_module(self, module: torch.nn.Module) -> HostSyncCounter:
        """Count reads made during `module`'s forward in `model_by_kind` (hooks removed on exit)."""

        def enter(*_):
            self._in_model += 1

        def leave(*_):
            self._in_model -= 1

        self._hooks += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
        return self

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Count only the outermost call: `.tolist()` may call `.item()` internally.
        if self._depth == 0:
            kind = _READS.get(func)
            if kind is None and func is torch.where and len(args) + len(kwargs) == 1:
                kind = "nonzero"
            elif kind is None and func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
                if len(args) > 1 and _bool_index(args[1]):
                    kind = "bool_index"
            elif kind is None and func is torch.Tensor.to and _to_host(args, kwargs):
                kind = "cpu"
            if kind is not None:
                (self.model_by_kind if self._in_model else self.by_kind)[kind] += 1
        self._depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self._depth -= 1
