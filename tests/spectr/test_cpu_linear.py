"""The CPU small-row linear kernel (`spectr.cpu_linear`): same products as `F.linear` over its packed copy of
the weight (any shape), on torch's threads, one row's result independent of how many rows share the call,
oneDNN's packed copy over a few more rows (both copies within one memory budget, remade when the weight
changes), used only inside the engine's forwards, and `F.linear` bit for bit
everywhere else (more rows, other dtypes, autograd, outside `active()`, a failed build)."""

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from hf_tiny import hf_greedy, tiny_model

import spectr
from spectr import cpu_linear


def linear(in_features=37, out_features=45, bias=True, seed=0, dtype=torch.float32):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layer = torch.nn.Linear(in_features, out_features, bias=bias).to(dtype)
    assert cpu_linear.install(layer) == (1 if dtype == torch.float32 else 0)
    return layer


@pytest.fixture(scope="module")
def built():
    if cpu_linear.kernel() is None:
        pytest.skip("the kernel could not be built on this machine (a warning said why)")
    return cpu_linear.kernel()


@pytest.mark.parametrize("rows", range(1, cpu_linear.MAX_ROWS + 1))
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_computes_the_linear(built, rows, bias):
    layer = linear(in_features=16 * 3 + 5, bias=bias)  # K not a multiple of the kernel's 16 lanes
    x = torch.randn(rows, layer.in_features)
    with torch.no_grad(), cpu_linear.active():
        out = layer(x)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_batched_shapes_keep_their_leading_axes(built):
    layer = linear()
    x = torch.randn(2, 3, layer.in_features)  # 6 rows: [B, T, K]
    with torch.no_grad(), cpu_linear.active():
        out = layer(x)
    assert out.shape == (2, 3, layer.out_features)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("in_features", [576, 53])  # whole blocks of 16 lanes, and a zero-padded tail
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(built, in_features):
    layer = linear(in_features=in_features, out_features=301)  # and a last block of one output row
    x = torch.randn(cpu_linear.MAX_ROWS, layer.in_features)
    with torch.no_grad(), cpu_linear.active():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
        together = layer(x)
    assert torch.equal(alone, together)
    # the control: one output one float step away is told apart (MKL's own row-invariance varies by CPU)
    nudged = alone.clone()
    nudged[-1, -1] = torch.nextafter(nudged[-1, -1], torch.tensor(float("inf")))
    assert not torch.equal(nudged, together)


def test_everything_else_is_f_linear_bit_for_bit(built):
    layer = linear()
    few, many = torch.randn(3, layer.in_features), torch.randn(cpu_linear.PACKED_MAX_ROWS + 1, layer.in_features)
    with torch.no_grad():
        assert torch.equal(layer(few), F.linear(few, layer.weight, layer.bias))  # outside active()
        with cpu_linear.active():
            assert torch.equal(layer(many), F.linear(many, layer.weight, layer.bias))  # past PACKED_MAX_ROWS
    with cpu_linear.active():  # autograd: the kernel has no backward
        out = layer(few)
        assert torch.equal(out, F.linear(few, layer.weight, layer.bias))
        out.sum().backward()
    assert layer.weight.grad is not None
    bf16 = linear(dtype=torch.bfloat16)  # not patched at all
    assert "forward" not in bf16.__dict__


@pytest.mark.parametrize("shape", [(1, 1), (15, 3), (16, 4), (17, 5), (576, 192)])  # K, N around 16 lanes, 4 rows
def test_the_packed_copy_pads_any_shape(built, shape):
    in_features, out_features = shape
    layer = linear(in_features=in_features, out_features=out_features, bias=False)
    x = torch.randn(cpu_linear.MAX_ROWS, in_features)
    with torch.no_grad(), cpu_linear.active():
        out = layer(x)
        packed = cpu_linear._rows_packed[layer][2]
        torch.testing.assert_close(out, F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
        layer.weight.mul_(2)  # a weight changed in place: its packed copy is made again
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    assert cpu_linear._rows_packed[layer][2] is not packed
    assert packed.shape == (-(-out_features // 4), -(-in_features // 16), 4, 16)  # blocks of 4 rows x 16 lanes


def test_the_kernel_runs_on_torchs_threads(built):
    """Built with OpenMP, `at::parallel_for` splits the weight's blocks over torch's threads (without it, the
    kernel ran on one core): the structural count is the distinct OpenMP threads that ran a product."""
    x, packed, before = torch.zeros(1, 64), built.pack(torch.zeros(4096, 64)), torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the suite runs one thread per worker
        assert built.threads_used(x, packed, 4096) == 2
        torch.set_num_threads(1)  # the control: one thread allowed, one thread used
        assert built.threads_used(x, packed, 4096) == 1
    finally:
        torch.set_num_threads(before)


def vm_flags(address: int) -> list[str]:
    """The kernel's VmFlags of the mapping that holds `address` in this process (`/proc/self/smaps`)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_large_packed_copies_are_advised_as_huge_pages(built):
    """Streaming a copy of 2 MiB or more misses the TLB once per huge page: it is 2 MiB-aligned and advised
    (`hg` in its mapping's VmFlags); a smaller copy is torch's ordinary allocation (the control)."""
    if not os.path.exists("/proc/self/smaps") or not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        pytest.skip("no transparent huge pages on this system")
    large = built.pack(torch.zeros(1024, 576))  # 2.25 MiB
    assert large.data_ptr() % (2 << 20) == 0 and "hg" in vm_flags(large.data_ptr())
    small = built.pack(torch.zeros(64, 64))
    assert "hg" not in vm_flags(small.data_ptr())


@pytest.mark.parametrize("rows", [cpu_linear.MAX_ROWS + 1, cpu_linear.PACKED_MAX_ROWS])
def test_more_rows_go_through_onednns_packed_copy(built, rows):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    layer = linear(in_features=64, out_features=70)
    x = torch.randn(rows, layer.in_features)
    with torch.no_grad(), cpu_linear.active():
        out = layer(x)
        packed = cpu_linear._packed[layer][2]
        torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        layer.weight.mul_(2)  # a weight changed in place: its packed copy is made again
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert cpu_linear._packed[layer][2] is not packed
    copy.deepcopy(layer)  # the packed copy is not the module's: a model still deep-copies


@pytest.mark.parametrize("rows", [2, cpu_linear.MAX_ROWS + 1])  # the kernel's copy, oneDNN's
def test_packed_copies_stay_within_their_memory_budget(built, monkeypatch, rows):
    monkeypatch.setattr(cpu_linear, "PACKED_MAX_BYTES", 0)
    layer = linear()
    x = torch.randn(rows, layer.in_features)
    with torch.no_grad(), cpu_linear.active():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert layer not in cpu_linear._packed and layer not in cpu_linear._rows_packed


def test_a_failed_build_warns_once_and_falls_back(monkeypatch, tmp_path):
    import torch.utils.cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", no_compiler)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_linear, "_kernel", [])
    layer = linear()
    x = torch.randn(2, layer.in_features)
    with pytest.warns(RuntimeWarning, match="could not be built.*no C\\+\\+ compiler here"):
        assert cpu_linear.kernel() is None
    with torch.no_grad(), cpu_linear.active():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_a_build_in_progress_elsewhere_is_waited_for_then_given_up_on(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_linear, "BUILD_TIMEOUT_S", 1.0)
    where = cpu_linear.build_dir()
    where.mkdir(parents=True)
    (where / "building").touch()  # another process's build, still fresh: this one waits, then gives up
    with pytest.warns(RuntimeWarning, match="TimeoutError: another process has been building"):
        assert cpu_linear._build() is None


def test_a_dead_builders_marker_is_taken_over(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_linear, "STALE_MARKER_S", 60.0)
    compiled = []
    monkeypatch.setattr(cpu_linear, "_compile", lambda where, built: compiled.append(built) or F.linear)
    where = cpu_linear.build_dir()
    where.mkdir(parents=True)
    marker = where / "building"
    marker.touch()
    old = marker.stat().st_mtime - 120  # its builder died two minutes ago
    os.utime(marker, (old, old))
    assert cpu_linear._build() is F.linear and compiled == [where / f"{cpu_linear.NAME}.so"]
    assert not marker.exists()


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV, "0")
    layer = torch.nn.Linear(8, 8)
    assert cpu_linear.install(layer) == 0 and "forward" not in layer.__dict__


class Counting:
    """The built module, counting the rows of each product."""

    def __init__(self, module):
        self.module, self.calls = module, []

    def pack(self, weight):
        return self.module.pack(weight)

    def packed_linear(self, x, packed, out_features):
        self.calls.append(x.shape[0])
        return self.module.packed_linear(x, packed, out_features)


def test_the_engine_uses_it_and_hf_generate_does_not(built, monkeypatch):
    counting = Counting(built)
    calls = counting.calls
    monkeypatch.setattr(cpu_linear, "_kernel", [counting])
    target = tiny_model(seed=3)
    prompt = [1, 5, 9, 2]
    ours = spectr.generate(target, None, [prompt], method="autoregressive", max_new_tokens=12, temperature=0.0)
    linears = sum(isinstance(m, torch.nn.Linear) for m in target.modules())
    assert len(calls) >= linears * 11  # every linear of every one-token step after the prefill
    assert set(calls) <= set(range(1, cpu_linear.MAX_ROWS + 1))
    calls.clear()
    reference = hf_greedy(target, prompt, 12)  # the same patched modules, outside the engine's forwards
    assert calls == []
    assert ours.tokens[0] == reference


def test_a_dropped_layers_packed_copy_leaves_the_budget(built, monkeypatch):
    import gc

    first, second = linear(seed=1), linear(seed=2)
    held = sum(size for copies in (cpu_linear._packed, cpu_linear._rows_packed)
               for *_, size in list(copies.values()))  # other tests' live models (both kinds of copy)
    monkeypatch.setattr(cpu_linear, "PACKED_MAX_BYTES", held + first.weight.nbytes)  # room for one more copy
    x = torch.randn(cpu_linear.MAX_ROWS + 1, first.in_features)
    with torch.no_grad(), cpu_linear.active():
        first(x)
        second(x)
        assert first in cpu_linear._packed and second not in cpu_linear._packed  # over the budget: F.linear
        del first
        gc.collect()
        second(x)
    assert second in cpu_linear._packed
