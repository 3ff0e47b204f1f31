"""Float32 linear layers over a few rows on the CPU: one pass over the weight, whatever the row count.

Why: speculation pays only where a forward over a few tokens costs about one token's forward. On the CPUs
measured, MKL's `F.linear` over 2 or 3 rows reads the weight once per row, so a batch-1 verify of 2-3 tokens
cost 1.6-2x an autoregressive step. The kernel here (`SOURCE`) streams a packed copy of the weight once (blocks
of 4 output rows, so that each load of an input row serves 4 outputs) and multiplies it with all M <= `MAX_ROWS`
input rows held in L1, on torch's threads (OpenMP; built without it, it had run on one core). From `MAX_ROWS` + 1
to `PACKED_MAX_ROWS` rows (a batch of 8 rows, their verifies) oneDNN's product over its own packed copy of the
weight reads it about once (as the compiled core's `ONEDNN_MAX_ROWS` does). Both copies are made on first use,
the weights once or twice more in memory (up to `PACKED_MAX_BYTES` per process in all; past it, `F.linear`);
the kernel's copies of 2 MiB or more are advised as huge pages (fewer TLB misses while streaming them).
Measurements: docs/performance.md#speed-on-a-real-model-smollm2-135m-instruct-a-feature-draft.

Scope: only inside the engine's own forwards (`active()`: `HFCausalLM.forward`, the feature draft's), on
linears that `install` patched (float32 weights on the CPU), over 1..`PACKED_MAX_ROWS` rows, without autograd
and outside torch.compile; everything else is `F.linear`, bit for bit. So a model used outside the engine (HF
`generate` as a baseline, training) is untouched. Each output is one dot product in a fixed order, whatever
the number of rows: a row's result is the same alone or among others (tested).

The kernel is C++ built once per machine by `torch.utils.cpp_extension.load_inline` (`FLAGS`;
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
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp")  # OpenMP: at::parallel_for spreads the rows over torch's threads
LDFLAGS = ("-fopenmp",)  # libgomp: the one torch already loaded (same soname)
# ...and from MAX_ROWS + 1 to PACKED_MAX_ROWS rows, oneDNN's product over a packed copy of the weight (made on first use)
PACKED_MAX_ROWS = 32
PACKED_MAX_BYTES = 4 << 30  # packed copies kept per process at most; past it, F.linear (a large model on a CPU)
BUILD_TIMEOUT_S = 300.0  # how long a process waits for another one's build before it gives up (F.linear)
STALE_MARKER_S = 900.0  # a build marker this old was left by a builder that died: the next process takes over

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>

// 16 float lanes: one zmm with AVX-512 (its intrinsics), else GCC's vector extension (two ymm with AVX2,
// whatever -march gives; -ffp-contract=fast fuses its multiply-add). `reduce` sums the 16 lanes in one fixed
// order, whatever the row count.
#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 lanes;
static inline lanes load(const float* p) { return _mm512_loadu_ps(p); }
static inline lanes fma(lanes a, lanes b, lanes c) { return _mm512_fmadd_ps(a, b, c); }
static inline float reduce(lanes v) { return _mm512_reduce_add_ps(v); }
#else
typedef float lanes __attribute__((vector_size(64)));
static inline lanes load(const float* p) { lanes v; std::memcpy(&v, p, sizeof v); return v; }
static inline lanes fma(lanes a, lanes b, lanes c) { return a * b + c; }
static inline float reduce(lanes v) {
  float t[16];
  std::memcpy(t, &v, sizeof t);
  for (int width = 8; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) t[j] += t[j + width];
  return t[0];
}
#endif

// The packed layout: the weight [N, K] as blocks of R = 4 output rows, [ceil(N/4)][Kp/16][4][16] (zero-padded
// to Kp = 16 * ceil(K/16) and to whole blocks), so that each thread streams one contiguous range and each
// 16 lanes of x it loads serve 4 output rows.
constexpr int R = 4;
constexpr int64_t GRAIN = 16;  // blocks per task at least

// Memory for a copy of at least 2 MiB: 2 MiB-aligned and advised to the kernel as huge pages (transparent huge
// pages, where the system allows them), so that streaming it misses the TLB once per 2 MiB, not per 4 KiB;
// smaller copies, or where this fails, torch's own allocation.
static torch::Tensor streamed_empty(at::IntArrayRef shape, const torch::TensorOptions& options) {
  constexpr size_t huge = size_t(2) << 20;
  size_t bytes = sizeof(float);
  for (int64_t size : shape) bytes *= size_t(size);
  void* memory = nullptr;
  if (bytes < huge || posix_memalign(&memory, huge, bytes) != 0) return torch::empty(shape, options);
#ifdef MADV_HUGEPAGE
  madvise(memory, bytes, MADV_HUGEPAGE);  // advice: without transparent huge pages, ordinary ones
#endif
  return torch::from_blob(memory, shape, [](void* data) { std::free(data); }, options);
}

torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "pack: w [N, K] float32");
  const int64_t N = w.size(0), K = w.size(1), Kp = (K + 15) / 16 * 16, Np = (N + R - 1) / R * R;
  auto padded = torch::zeros({Np, Kp}, w.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  auto packed = streamed_empty({Np / R, Kp / 16, R, 16}, w.options());
  packed.copy_(padded.view({Np / R, R, Kp / 16, 16}).permute({0, 2, 1, 3}));
  return packed;
}

// y[m, n] = sum_k x[m, k] * w[n, k] for M rows of x (zero-padded to Kp): each block of w is read once, for all
// M rows; each output is 16 lane sums over k in order, then `reduce`: the same operations whatever M is.
template <int M>
static void packed_kernel(const float* __restrict x, const float* __restrict p, float* __restrict y, int64_t N,
                          int64_t Kp) {
  at::parallel_for(0, (N + R - 1) / R, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* __restrict block = p + b * Kp * R;
      lanes acc[M][R];
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < R; ++r) acc[m][r] = lanes{};
      for (int64_t k = 0; k < Kp; k += 16) {
        lanes w[R];
        for (int r = 0; r < R; ++r) w[r] = load(block + k * R + 16 * r);
        for (int m = 0; m < M; ++m) {
          const lanes xv = load(x + m * Kp + k);
          for (int r = 0; r < R; ++r) acc[m][r] = fma(xv, w[r], acc[m][r]);
        }
      }
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < R && b * R + r < N; ++r) y[m * N + b * R + r] = reduce(acc[m][r]);
    }
  });
}

// How many of torch's threads the kernel's split of N rows runs on (a test of the build: without OpenMP,
// at::parallel_for runs every block on the calling thread).
int64_t threads_used(torch::Tensor x, torch::Tensor p, int64_t N) {
  std::vector<char> seen(at::get_num_threads(), 0);
  at::parallel_for(0, (N + R - 1) / R, GRAIN, [&](int64_t, int64_t) { seen[at::get_thread_num()] = 1; });
  int64_t count = 0;
  for (char s : seen) count += s;
  return count;
}

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor p, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && p.dim() == 4 && p.size(2) == R,
              "packed_linear: x [M, K] float32 and a packed weight");
  const int64_t M = x.size(0), K = x.size(1), Kp = p.size(1) * 16;
  TORCH_CHECK(K <= Kp && Kp - K < 16, "packed_linear: x has ", K, " columns, the packed weight ", Kp);
  auto xp = (K == Kp ? x : torch::constant_pad_nd(x, {0, Kp - K}, 0)).contiguous();
  auto y = torch::empty({M, N}, x.options());
  const float* a = xp.data_ptr<float>();
  const float* w = p.data_ptr<float>();
  float* o = y.data_ptr<float>();
  switch (M) {
    case 1: packed_kernel<1>(a, w, o, N, Kp); break;
    case 2: packed_kernel<2>(a, w, o, N, Kp); break;
    case 3: packed_kernel<3>(a, w, o, N, Kp); break;
    case 4: packed_kernel<4>(a, w, o, N, Kp); break;
    case 5: packed_kernel<5>(a, w, o, N, Kp); break;
    case 6: packed_kernel<6>(a, w, o, N, Kp); break;
    default: TORCH_CHECK(false, "packed_linear: 1 to 6 rows, got ", M);
  }
  return y;
}
"""

_local = threading.local()  # .depth: how many `active()` blocks this thread is in
_lock = threading.Lock()
_kernel: list = []  # [the built function, or None when it could not be built]
# layer -> (weight version, data pointer, oneDNN's packed copy, its bytes), dropped with the layer
_packed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# layer -> the same for the kernel's packed copy (`pack`: blocks of 4 output rows)
_rows_packed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def enabled() -> bool:
    """Whether the kernel may be used at all in this process (`SPECTR_CPU_LINEAR` is not "0")."""
    return os.environ.get(ENV, "1") != "0"


def kernel():
    """The built module (`pack(w [N, K])` -> its packed copy; `packed_linear(x [M, K], packed, N)` -> [M, N]),
    or None (disabled, or the build failed:
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
    key = hashlib.sha256("\n".join([SOURCE, " ".join(FLAGS + LDFLAGS), torch.__version__, sys.version, platform.machine(),
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
        return module
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
        module = load_inline(NAME, cpp_sources=SOURCE, functions=["pack", "packed_linear", "threads_used"], extra_cflags=list(FLAGS),
                             extra_ldflags=list(LDFLAGS), build_directory=str(scratch), verbose=False)
        os.replace(scratch / f"{NAME}.so", built)  # atomic: a reader sees no file or the whole one
        return module
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
    flat = x.reshape(rows, x.shape[-1])
    out = _packed_linear(self, flat) if rows > MAX_ROWS else _kernel_linear(self, flat)
    if out is None:
        return F.linear(x, self.weight, self.bias)
    if self.bias is not None:
        out += self.bias
    return out.view(*x.shape[:-1], out.shape[-1])


def onednn_packs(weight: torch.Tensor) -> bool:
    """Whether oneDNN can multiply by a packed copy of `weight` (float32 on a CPU with oneDNN); the compiled
    core's kmajor layout asks the same (`spectr.native`)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def _kernel_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
    """x [M <= MAX_ROWS, K] times the layer's weight through the kernel over its packed copy, or None (no
    kernel, or no room for the copy)."""
    module = kernel()
    if module is None:
        return None
    packed = _copy(_rows_packed, layer, module.pack)
    return None if packed is None else module.packed_linear(x, packed, layer.out_features)


def _packed_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] times the layer's weight through oneDNN's packed copy of it, or None (no oneDNN, or no room)."""
    if not onednn_packs(layer.weight):
        return None
    packed = _copy(_packed, layer, lambda weight: torch.ops.mkldnn._reorder_linear_weight(weight, None))
    return None if packed is None else torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _copy(store: weakref.WeakKeyDictionary, layer: torch.nn.Linear, make) -> torch.Tensor | None:
    """The layer's copy of its weight in `store`, made by `make(weight)` on first use and again when the
    weight changed in place; None when it would take the copies of both stores past `PACKED_MAX_BYTES`."""
    weight = layer.weight
    version = None if weight.is_inference() else weight._version  # an inference tensor keeps no version
    held = store.get(layer)
    if held is None or held[0] != version or held[1] != weight.data_ptr():
        with _lock:  # the live copies' bytes (a model's copies go with it); once per layer, not per call
            others = sum(size for copies in (_packed, _rows_packed) for key, (*_, size) in list(copies.items())
                         if not (copies is store and key is layer))
            if others + weight.nbytes > PACKED_MAX_BYTES:
                return None
            held = store[layer] = (version, weight.data_ptr(), make(weight.detach()), weight.nbytes)
    return held[2]


def report() -> None:
    """Build the kernel now and say where (`make setup` runs it, so that no job or test builds it)."""
    print(f"spectr.cpu_linear: {'built' if kernel() is not None else 'NOT built (F.linear is used)'} in {build_dir()}")
