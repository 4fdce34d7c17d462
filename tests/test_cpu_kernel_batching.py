"""cpu_kernel_batching: the C++ kernels of a compiled graph built as one library (real Inductor,
real g++, fresh cache directories): bitwise the same results, fewer compiler runs, loaded from the
cache on a restart, and Inductor's own way wherever the batch cannot be built."""

from __future__ import annotations

import glob
import logging
import os
import re

import pytest
import torch
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.codecache import CppPythonBindingsCodeCache, PyCodeCache
from torch._inductor.compile_fx import compile_fx
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

import zpp_compile
from zpp_compile import cpu_kernel_batching
from zpp_compile.cpu_kernel_batching import PendingKernel, namespaced_kernel

from .test_compile_sharing import RATES
from .workers import reset_process_state

PREFIX = "#include <torch/csrc/inductor/cpp_prefix.h>\n"
SCALE = PREFIX + (
    'extern "C" void kernel(const float* in_ptr0, float* out_ptr0, int64_t n, float scale)\n'
    "{\n    for (int64_t i = 0; i < n; ++i) out_ptr0[i] = in_ptr0[i] * scale;\n}\n"
)
SCALE_ARGS = ["const float*", "float*", "int64_t", "float"]


def several_kernels(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A graph Inductor gives five C++ kernels (the matmuls between them are not its own): a norm,
    a relu, a gelu, a softmax with an int8 quantization, a sum."""
    y = torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b)
    y = torch.nn.functional.gelu(torch.relu(y @ y.t()) @ x)
    z = torch.softmax(y @ y.t(), -1)
    scale = z.abs().amax(-1, keepdim=True) / 127
    return torch.round(z / scale).to(torch.int8), scale, (z @ x).sum(0)


INPUTS = (torch.randn(64, 128, generator=torch.Generator().manual_seed(0)), torch.randn(128), torch.randn(128))


def _batched_inductor(gm, example_inputs):
    with cpu_kernel_batching.batched():
        return compile_fx(gm, example_inputs)


def _libraries(folder) -> int:
    """Kernel libraries Inductor's code cache built in `folder` (its own or a batch's)."""
    return len(glob.glob(os.path.join(folder, "*", "*.main.so")))


def _compiled_in(folder, backend) -> tuple[tuple[torch.Tensor, ...], int]:
    """several_kernels compiled by `backend` in the Inductor cache `folder`, run once: its outputs and
    how many kernel libraries the folder then holds. In-process caches are emptied first, so the
    graph module is loaded (and its kernels asked for) from the folder, as in a restarted job."""
    torch._dynamo.reset()
    PyCodeCache.cache_clear()
    cpu_kernel_batching._BatchedBindings.cache_clear()
    with temporary_cache_dir(str(folder)):
        out = torch.compile(several_kernels, backend=backend)(*INPUTS)
    return out, _libraries(folder)


def test_a_graphs_kernels_build_as_one_library_with_bitwise_equal_results(tmp_path):
    ref, alone = _compiled_in(tmp_path / "inductor", "inductor")
    out, together = _compiled_in(tmp_path / "batched", _batched_inductor)
    assert alone == 5, alone  # Inductor's way: one library per kernel
    assert together == 1
    assert all(torch.equal(a, b) for a, b in zip(ref, out))
    # A restart (module loaded from the FX graph cache) finds the library: nothing is built again.
    (library,) = glob.glob(str(tmp_path / "batched" / "*" / "*.main.so"))
    built = os.stat(library).st_mtime_ns
    again, libraries = _compiled_in(tmp_path / "batched", _batched_inductor)
    assert libraries == 1 and os.stat(library).st_mtime_ns == built
    assert all(torch.equal(a, b) for a, b in zip(ref, again))


def test_with_one_compile_thread_the_library_builds_in_place(tmp_path):
    """Inductor builds in its own process then (TORCHINDUCTOR_COMPILE_THREADS=1, one CPU)."""
    ref, _ = _compiled_in(tmp_path / "inductor", "inductor")
    with torch._inductor.config.patch(compile_threads=1):
        out, libraries = _compiled_in(tmp_path / "batched", _batched_inductor)
    assert libraries == 1
    assert all(torch.equal(a, b) for a, b in zip(ref, out))


def test_many_kernels_build_as_several_libraries_side_by_side(tmp_path, monkeypatch):
    """No library of more than MAX_KERNELS_PER_LIBRARY kernels: five kernels, at most three each."""
    monkeypatch.setattr(cpu_kernel_batching, "MAX_KERNELS_PER_LIBRARY", 3)
    ref, _ = _compiled_in(tmp_path / "inductor", "inductor")
    out, libraries = _compiled_in(tmp_path / "batched", _batched_inductor)
    assert libraries == 2
    assert all(torch.equal(a, b) for a, b in zip(ref, out))


def test_a_library_that_fails_to_build_leaves_each_kernel_to_inductor(tmp_path, monkeypatch, caplog):
    """A real compiler error (bindings that do not compile): warned, each kernel built alone."""
    monkeypatch.setattr(cpu_kernel_batching, "_BINDINGS", cpu_kernel_batching._BINDINGS + "\nnot C++;\n")
    ref, alone = _compiled_in(tmp_path / "inductor", "inductor")
    with caplog.at_level(logging.WARNING, logger="zpp_compile.cpu_kernel_batching"):
        out, libraries = _compiled_in(tmp_path / "batched", _batched_inductor)
    assert "failed to build as one library" in caplog.text
    assert libraries == alone
    assert all(torch.equal(a, b) for a, b in zip(ref, out))


def test_a_pending_kernel_reads_pointers_ints_and_floats_and_checks_its_arguments(tmp_path):
    """Called before any wait (the module never waited), it builds its batch and runs."""
    with temporary_cache_dir(str(tmp_path)), cpu_kernel_batching.batched():
        kernel = AsyncCompile().cpp_pybinding(SCALE_ARGS, SCALE)
    assert isinstance(kernel, PendingKernel)
    x, out = torch.arange(8, dtype=torch.float32), torch.zeros(8)
    kernel(x, out, 5, 2.5)
    assert out.tolist() == [0.0, 2.5, 5.0, 7.5, 10.0, 0.0, 0.0, 0.0]
    with pytest.raises(TypeError, match="takes 4 arguments"):
        kernel(x, out, 5)


def test_outside_batched_inductor_builds_its_own_way():
    cpu_kernel_batching._PATCH.install()
    assert not isinstance(AsyncCompile().cpp_pybinding(SCALE_ARGS, SCALE), PendingKernel)


@pytest.mark.parametrize(
    "source, argtypes",
    [
        (SCALE.replace(PREFIX, ""), SCALE_ARGS),  # not Inductor's header first
        (SCALE.replace(PREFIX, PREFIX + "#include <vector>\n"), SCALE_ARGS),  # an include inside a namespace
        (SCALE.replace(PREFIX, PREFIX + "#define N 4\n"), SCALE_ARGS),  # macros would clash across kernels
        (SCALE.replace(PREFIX, PREFIX + '#pragma GCC optimize("O0")\n'), SCALE_ARGS),  # would reach later kernels
        (SCALE + SCALE.replace(PREFIX, ""), SCALE_ARGS),  # two entry points
        (SCALE.replace("float scale", "double scale"), SCALE_ARGS[:3] + ["double"]),  # unread argument type
    ],
    ids=["no_prefix", "include", "define", "file_pragma", "two_entries", "double_arg"],
)
def test_a_kernel_of_another_form_is_not_batched(source, argtypes):
    assert namespaced_kernel(source, argtypes, 0) is None


def test_the_bindings_read_the_scalar_types_inductors_bindings_read():
    """Caught on a torch upgrade: Inductor's parse_arg specialisations are the ones _BINDINGS has."""
    inductor = set(re.findall(r"parse_arg<(\w+)>\(PyObject", CppPythonBindingsCodeCache.suffix_template))
    ours = set(re.findall(r"arg<(\w+)>\(PyObject", cpu_kernel_batching._BINDINGS))
    assert inductor == ours == set(cpu_kernel_batching._SCALAR_ARGS)


def test_inductors_kernel_becomes_a_namespaced_function():
    namespaced = namespaced_kernel(SCALE, SCALE_ARGS, 7)
    assert namespaced.startswith("namespace zpp_kernel_7 {") and namespaced.rstrip().endswith("}")
    assert 'extern "C"' not in namespaced and "void kernel(const float* in_ptr0" in namespaced


def _steps(cache: str, batch: bool) -> dict:
    """Two training steps of the test GPT (ZeRO-3, 2 ranks, compiled by region) in the Inductor
    cache `cache`: the losses and the kernel libraries the cache then holds."""
    import torch.distributed as dist

    from .models import batch as batch_of
    from .models import build, loss_of

    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        with temporary_cache_dir(cache):
            torch.manual_seed(0)
            config = zpp_compile.Config(inductor_regions=True, batch_cpu_kernels=batch, **RATES)
            model = zpp_compile.shard(build("gpt"), config)
            compiled = torch.compile(model, backend="zeropp")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            losses = []
            for step in range(2):
                x, y = batch_of("gpt", 2 * world, step)
                loss = loss_of("gpt", compiled, x.chunk(world)[rank], y.chunk(world)[rank])
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            dist.barrier()
            return {"losses": losses, "libraries": _libraries(cache)}
    finally:
        reset_process_state()


def test_the_backend_builds_fewer_libraries_and_trains_bitwise_alike(pools, tmp_path):
    """Config.batch_cpu_kernels on and off, each in a fresh cache shared by both ranks."""
    alone = pools(2).run(_steps, str(tmp_path / "alone"), False)
    batched = pools(2).run(_steps, str(tmp_path / "batched"), True)
    assert [r["losses"] for r in batched] == [r["losses"] for r in alone]
    # Its regions hold 1 to 5 kernels each: 35 libraries against 18 when this was written.
    assert batched[0]["libraries"] <= 0.6 * alone[0]["libraries"], (batched[0], alone[0])
