"""Float32 linear layers over a few rows on the CPU: one pass over the weight, whatever the row count.

Why: speculation pays only where a forward over a few tokens costs about one token's forward. On the CPUs
measured, MKL's `F.linear` over 2 or 3 rows reads the weight once per row, so a batch-1 verify of 2-3 tokens
cost 1.6-2x an autoregressive step. The kernel here (`SOURCE`) streams each weight row once and dots it with
all M <= `MAX_ROWS` input rows held in L1. From `MAX_ROWS` + 1 to `PACKED_MAX_ROWS` rows (a batch of 8 rows,
their verifies) oneDNN's product over a packed copy of the weight reads it about once (as the compiled core's
`ONEDNN_MAX_ROWS` does), for the weights once more in memory (up to `PACKED_MAX_BYTES` per process).
Measurements: docs/performance.md#speed-on-a-real-model-smollm2-135m-instruct-a-feature-draft.

Scope: only inside the engine's own forwards (`active()`: `HFCausalLM.forward`, the feature draft's), on
linears that `install` patched (float32 weights on the CPU), over 1..`PACKED_MAX_ROWS` rows, without autograd
and outside torch.compile; everything else is `F.linear`, bit for bit. So a model used outside the engine (HF
`generate` as a baseline, training) is untouched. Each output is one dot product in a fixed order, whatever
the number of rows: a row's result is the same alone or among others (tested).

The kernel is C++ built once per machine by `torch.utils.cpp_extension.load_inline` (`-O3 -march=native`;
about 25 s on 2 cores; needs ninja and a C++ compiler, as torch's inductor does) and kept under `build_dir()`;
`make setup` builds it (`report()`). Concurrent processes do not share a lock a killed one
could leave held: one builds in a scratch directory and renames the library into place, the others wait for it
up to `BUILD_TIMEOUT_S`. If the build fails, or `SPECTR_CPU_LINEAR=0`, one warning and `F.linear` everywhere.
Results stay exact: speculation's guarantee is relative to the target's probabilities as computed, and the
target's forward computes them with this kernel in autoregressive and speculative iterations alike.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import types
import warnings
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

MAX_ROWS = 6  # rows (tokens x batch rows) the kernel takes; past it MKL's blocked GEMM is as fast (measured)
ENV = "SPECTR_CPU_LINEAR"  # "0": never use the kernel
NAME = "spectr_cpu_linear"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd")
# ...and from MAX_ROWS + 1 to PACKED_MAX_ROWS rows, oneDNN's product over a packed copy of the weight (made on first use)
PACKED_MAX_ROWS = 32
PACKED_MAX_BYTES = 4 << 30  # packed copies kept per process at most; past it, F.linear (a large model on a CPU)
BUILD_TIMEOUT_S = 300.0  # how long a process waits for another one's build before it gives up (F.linear)
STALE_MARKER_S = 900.0  # a build marker this old was left by a builder that died: the next process takes over

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>

// y[m, n] = sum_k x[m, k] * w[n, k] for M rows of x: each row of w is read once, for all M rows.
template <int M>
static void rows_kernel(const float* __restrict x, const float* __restrict w, float* __restrict y,
                        int64_t N, int64_t K) {
  at::parallel_for(0, N, 256, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* __restrict wr = w + n * K;
      float acc[M][16];
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < 16; ++j) acc[m][j] = 0.f;
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) {
        for (int m = 0; m < M; ++m) {
          const float* __restrict xr = x + m * K + k;
#pragma omp simd
          for (int j = 0; j < 16; ++j) acc[m][j] += xr[j] * wr[k + j];
        }
      }
      for (int m = 0; m < M; ++m) {
        float s = 0.f;
        for (int j = 0; j < 16; ++j) s += acc[m][j];
        for (int64_t t = k; t < K; ++t) s += x[m * K + t] * wr[t];
        y[m * N + n] = s;
      }
    }
  });
}

torch::Tensor small_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "small_linear: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "small_linear: contiguous operands only");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (M) {
    case 1: rows_kernel<1>(xp, wp, yp, N, K); break;
    case 2: rows_kernel<2>(xp, wp, yp, N, K); break;
    case 3: rows_kernel<3>(xp, wp, yp, N, K); break;
    case 4: rows_kernel<4>(xp, wp, yp, N, K); break;
    case 5: rows_kernel<5>(xp, wp, yp, N, K); break;
    case 6: rows_kernel<6>(xp, wp, yp, N, K); break;
    default: TORCH_CHECK(false, "small_linear: 1 to 6 rows, got ", M);
  }
  return y;
}
"""

_local = threading.local()  # .depth: how many `active()` blocks this thread is in
_lock = threading.Lock()
_kernel: list = []  # [the built function, or None when it could not be built]
# layer -> (weight version, data pointer, oneDNN's packed copy, its bytes), dropped with the layer
_packed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def enabled() -> bool:
    """Whether the kernel may be used at all in this process (`SPECTR_CPU_LINEAR` is not "0")."""
    return os.environ.get(ENV, "1") != "0"


def kernel():
    """The built `small_linear(x [M, K], w [N, K]) -> [M, N]`, or None (disabled, or the build failed:
    one warning naming why). Loaded on first use, once per process; built once per machine (`build_dir`)."""
    if _kernel:
        return _kernel[0]
    with _lock:
        if not _kernel:
            _kernel.append(_build() if enabled() else None)
    return _kernel[0]


def build_dir() -> Path:
    """Where the built kernel is kept: torch's extensions directory (`TORCH_EXTENSIONS_DIR`, else
    ~/.cache/torch_extensions), under a key of the source, the flags, torch, Python and this CPU's features
    (`-march=native` code must not run on another CPU sharing the directory)."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    key = hashlib.sha256("\n".join([SOURCE, " ".join(FLAGS), torch.__version__, sys.version, platform.machine(),
                                     _cpu_features()]).encode()).hexdigest()[:16]
    return Path(base) / "spectr_cpu_linear" / key


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _build():
    """Load the kernel built earlier, else build it (one process builds; the others wait for it up to
    `BUILD_TIMEOUT_S`, then use `F.linear`): no lock that a killed process could leave held."""
    try:
        where = build_dir()
        where.mkdir(parents=True, exist_ok=True)
        built = where / f"{NAME}.so"
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        while not built.exists():
            if _claim(where / "building"):
                try:
                    return _compile(where, built)
                finally:
                    (where / "building").unlink(missing_ok=True)
            if time.monotonic() > deadline:
                raise TimeoutError(f"another process has been building {built} for over {BUILD_TIMEOUT_S:.0f} s")
            time.sleep(0.5)
        spec = importlib.util.spec_from_file_location(NAME, built)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.small_linear
    except Exception as error:  # noqa: BLE001 - no compiler, no ninja, a failed build: MKL's F.linear instead
        warnings.warn(f"spectr: the CPU small-row linear kernel could not be built, using F.linear "
                      f"({type(error).__name__}: {str(error)[:300]}); set {ENV}=0 to skip the build",
                      RuntimeWarning, stacklevel=3)
        return None


def _claim(marker: Path) -> bool:
    """Whether this process takes the build (a marker older than `STALE_MARKER_S`: its builder died)."""
    try:
        if time.time() - marker.stat().st_mtime > STALE_MARKER_S:
            marker.unlink(missing_ok=True)
    except FileNotFoundError:
        pass
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _compile(where: Path, built: Path):
    from torch.utils.cpp_extension import load_inline

    here = os.path.dirname(sys.executable)  # the environment's own ninja (a dependency) where PATH has none
    if shutil.which("ninja") is None and shutil.which("ninja", path=here):
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
    scratch = Path(tempfile.mkdtemp(dir=where, prefix="build-"))
    try:
        module = load_inline(NAME, cpp_sources=SOURCE, functions=["small_linear"], extra_cflags=list(FLAGS),
                             build_directory=str(scratch), verbose=False)
        os.replace(scratch / f"{NAME}.so", built)  # atomic: a reader sees no file or the whole one
        return module.small_linear
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def active():
    """Linears that `install` patched use the kernel (where it applies) inside this block, on this thread."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def install(model: torch.nn.Module) -> int:
    """Patch every float32 CPU `nn.Linear` of `model` (once) so that, inside `active()`, 1..`MAX_ROWS` rows
    go through the kernel and up to `PACKED_MAX_ROWS` through oneDNN's packed copy. Returns how many linears
    are patched. Nothing on other devices or dtypes."""
    if not enabled():
        return 0
    count = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module.weight.device.type != "cpu":
            continue
        if module.weight.dtype != torch.float32:
            continue
        if "forward" not in module.__dict__:
            module.forward = types.MethodType(_forward, module)
        count += 1
    return count


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():  # first: a traced forward never reads the thread-local flag
        return F.linear(x, self.weight, self.bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (not getattr(_local, "depth", 0) or not 1 <= rows <= PACKED_MAX_ROWS or x.dtype != torch.float32
            or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
        return F.linear(x, self.weight, self.bias)
    if rows > MAX_ROWS:
        out = _packed_linear(self, x.reshape(rows, x.shape[-1]))
        if out is None:
            return F.linear(x, self.weight, self.bias)
    else:
        run = kernel()
        if run is None:
            return F.linear(x, self.weight, self.bias)
        out = run(x.reshape(rows, x.shape[-1]).contiguous(), self.weight.contiguous())
    if self.bias is not None:
        out += self.bias
    return out.view(*x.shape[:-1], out.shape[-1])


def onednn_packs(weight: torch.Tensor) -> bool:
    """Whether oneDNN can multiply by a packed copy of `weight` (float32 on a CPU with oneDNN); the compiled
    core's kmajor layout asks the same (`spectr.native`)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def _packed_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] times the layer's weight through oneDNN's packed copy of it (made on first use, remade when
    the weight changes in place), or None without oneDNN."""
    weight = layer.weight
    if not onednn_packs(weight):
        return None
    version = None if weight.is_inference() else weight._version  # an inference tensor keeps no version
    held = _packed.get(layer)
    if held is None or held[0] != version or held[1] != weight.data_ptr():
        with _lock:  # the live copies' bytes (a model's copies go with it); once per layer, not per call
            others = sum(size for key, (*_, size) in list(_packed.items()) if key is not layer)
            if others + weight.nbytes > PACKED_MAX_BYTES:
                return None
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            held = _packed[layer] = (version, weight.data_ptr(), packed, weight.nbytes)
    return torch.ops.mkldnn._linear_pointwise(x, held[2], None, "none", [], "")


def report() -> None:
    """Build the kernel now and say where (`make setup` runs it, so that no job or test builds it)."""
    print(f"spectr.cpu_linear: {'built' if kernel() is not None else 'NOT built (F.linear is used)'} in {build_dir()}")
