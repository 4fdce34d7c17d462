"""The C++ kernels of one compiled graph built as one library (Config.batch_cpu_kernels).

Inductor builds every C++ kernel of a graph as a library of its own: one g++ run per kernel. The
kernel's own code is the small part of that run; most of it is the compiler loading torch's
vectorized headers (precompiled, still ~1.3 s of a kernel's ~2 s on this project's machine), paid
again for every kernel. On a cold start that is most of the first step: the 79 kernels of a
4-block HF GPT-2 under full ZeRO++ took ~1.5 s each as Inductor builds them, and 10.5 s all in one
library (docs/compile_time.md).

While the backend's Inductor compiles run (`batched()`), each graph module's
`async_compile.cpp_pybinding(argtypes, source)` returns a PendingKernel instead of building; the
module's closing `async_compile.wait(globals())` builds all of its kernels as one library -- each
kernel in a namespace of its own, one Python entry point per kernel -- and puts the entry points in
the module's place. Inductor's code cache keys the library by its source, so a restarted job, or
another rank of the host, loads it instead of building it.

What a kernel computes is untouched: the same source, compiler flags and calling convention
(tensor arguments read through Inductor's data-pointer hook), so with Inductor's default flags
(no fast-math, no floating-point contraction) results are bitwise the same. A kernel whose source
is not of the form Inductor writes today (cpp_prefix.h, then one `extern "C" void kernel(`, no
other preprocessor lines than the pragmas Inductor puts in loops) or that takes an argument type
the bindings do not read is built Inductor's way; so is every kernel of a library that fails to
build (logged). Errors raised by a batched entry point are TypeError for a wrong argument count
and RuntimeError otherwise (Inductor's own bindings raise RuntimeError for both).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any, Callable, ContextManager, NamedTuple, Optional

from torch._inductor.async_compile import AsyncCompile, get_compile_threads
from torch._inductor.codecache import CodeCacheFuture, CppPythonBindingsCodeCache
from torch._inductor.utils import clear_on_fresh_cache

from .codegen.quantize import ceil_div
from .inductor_patching import ScopedPatch

log = logging.getLogger(__name__)

_PREFIX = "#include <torch/csrc/inductor/cpp_prefix.h>"
_ENTRY = re.compile(r'extern\s+"C"\s+void\s+kernel\s*\(')
_SCALAR_ARGS = ("int64_t", "uintptr_t", "float")  # besides pointers: what Inductor's bindings read
# The pragmas Inductor writes inside its kernels; any other (a file-level `GCC optimize`) would
# carry into every later kernel of a library.
_KERNEL_PRAGMA = re.compile(r"#pragma\s+(omp\b|GCC\s+ivdep\b|GCC\s+unroll\b|unroll\b)")
# A module of more kernels than this is built as several libraries, side by side in Inductor's
# compile workers. A number of kernels, not of workers: every host cuts a module alike, so the
# libraries a cache folder (or a mega-cache) holds serve any host.
MAX_KERNELS_PER_LIBRARY = 32


def batched() -> ContextManager[None]:
    """Within: the C++ kernels of each graph module Inductor loads are built as one library."""
    return _PATCH.scope()


def namespaced_kernel(source: str, argtypes: list[str], index: int) -> Optional[str]:
    """Inductor's source of one kernel as `zpp_kernel_<index>::kernel`, or None where it is not of
    the form this module knows (the kernel is then built Inductor's way)."""
    body = source.strip()
    if not body.startswith(_PREFIX):
        return None
    body = body[len(_PREFIX) :]
    directives = [line.strip() for line in body.splitlines() if line.strip().startswith("#")]
    if any(not _KERNEL_PRAGMA.match(d) for d in directives) or len(_ENTRY.findall(body)) != 1:
        return None
    if not all(t.endswith("*") or t.replace("const ", "") in _SCALAR_ARGS for t in argtypes):
        return None
    # A C++ function in a namespace of its own: the kernels' names and file-level helpers never clash.
    return f"namespace zpp_kernel_{index} {{\n{_ENTRY.sub('void kernel(', body)}\n}}"


class PendingKernel(CodeCacheFuture):
    """One kernel of a batch: its entry point once the batch's libraries are built."""

    def __init__(self, batch: _Batch, index: int) -> None:
        self.batch, self.index = batch, index

    def result(self, timeout: Optional[float] = None) -> Callable[..., Any]:
        return self.batch.entry(self.index)

    def __call__(self, *args: Any) -> Any:
        # Only where a module calls a kernel it never waited for (Inductor's modules always wait).
        return self.result()(*args)


class _Kernel(NamedTuple):
    index: int  # its place in the graph module: its namespace and entry point are named by it
    argtypes: list[str]
    source: str  # as Inductor wrote it
    namespaced: str


class _Batch:
    """The kernels one graph module asked for, built together on the first entry point asked for."""

    def __init__(self) -> None:
        self.kernels: list[_Kernel] = []
        self.entries: Optional[list[Callable[..., Any]]] = None

    def add(self, argtypes: list[str], source: str) -> Optional[int]:
        """The kernel's index in the batch; None for a kernel of a form not batched."""
        index = len(self.kernels)
        namespaced = namespaced_kernel(source, argtypes, index)
        if namespaced is not None:
            self.kernels.append(_Kernel(index, list(argtypes), source, namespaced))
            return index
        return None

    def entry(self, index: int) -> Callable[..., Any]:
        if self.entries is None:
            loads = [_start_build(library) for library in _libraries(self.kernels)]  # side by side
            self.entries = [entry for load in loads for entry in load()]
        return self.entries[index]


@clear_on_fresh_cache
class _BatchedBindings(CppPythonBindingsCodeCache):
    """Inductor's code cache for the batch libraries (a cache of their own: the entry point differs)."""

    cache: dict[str, Callable[[], Any]] = {}
    entry_function = "kernels"  # the module's name, hence its PyInit_kernels

    @staticmethod
    def cache_clear() -> None:
        _BatchedBindings.cache.clear()


def _libraries(kernels: list[_Kernel]) -> list[list[_Kernel]]:
    """The kernels cut into libraries of at most MAX_KERNELS_PER_LIBRARY, of even sizes."""
    size = ceil_div(len(kernels), ceil_div(len(kernels), MAX_KERNELS_PER_LIBRARY))
    return [kernels[start : start + size] for start in range(0, len(kernels), size)]


def _start_build(kernels: list[_Kernel]) -> Callable[[], list[Callable[..., Any]]]:
    """Starts building one library (in Inductor's compile workers, where it has them); returns how to
    wait for its entry points. A library that fails to build gets each kernel built Inductor's way."""
    source = "\n".join([_PREFIX, *(k.namespaced for k in kernels), _bindings(kernels)])
    # With one compile thread Inductor builds in place, without a submit function: submitting would
    # run the build under the file lock load_async holds, and the build takes that lock again.
    submit = AsyncCompile.submit if get_compile_threads() > 1 else None
    try:
        load = _BatchedBindings.load_async(source, "cpu", submit_fn=submit)
    except Exception as err:  # a failure to start: Inductor's way
        return functools.partial(_each_alone, kernels, err)

    def entries() -> list[Callable[..., Any]]:
        try:
            module = load()
        except Exception as err:  # a compiler or loader failure
            return _each_alone(kernels, err)
        return [getattr(module, f"kernel_{k.index}") for k in kernels]

    return entries


def _each_alone(kernels: list[_Kernel], err: Exception) -> list[Callable[..., Any]]:
    log.warning(
        "zpp_compile: %d C++ kernels failed to build as one library (%s); building each alone", len(kernels), err
    )
    return [CppPythonBindingsCodeCache.load_pybinding(k.argtypes, k.source) for k in kernels]


def _bindings(kernels: list[_Kernel]) -> str:
    """The Python module `kernels`: `kernel_<i>(*args)` calls `zpp_kernel_<i>::kernel` with each
    argument read as Inductor's own bindings read it (a tensor as its data pointer)."""
    calls = []
    for k in kernels:
        args = ", ".join(f"arg<{t.replace('const ', '')}>(args, {n})" for n, t in enumerate(k.argtypes))
        calls.append(
            f"static PyObject* kernel_{k.index}(PyObject*, PyObject* args) {{\n"
            f"    return run(args, {len(k.argtypes)}, [&] {{ zpp_kernel_{k.index}::kernel({args}); }});\n}}"
        )
    methods = "".join(f'    {{"kernel_{k.index}", kernel_{k.index}, METH_VARARGS, ""}},\n' for k in kernels)
    return _BINDINGS.replace("@CALLS@", "\n".join(calls)).replace("@METHODS@", methods)


_BINDINGS = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <type_traits>

// Inductor's hook from a tensor (PyObject*) to its data pointer; its address comes in the
// environment variable Inductor's code cache sets before loading a library.
static void* (*tensor_data_ptr)(PyObject*) = nullptr;

template <typename T> static inline T arg(PyObject* args, Py_ssize_t n) {
    static_assert(std::is_pointer_v<T>, "a kernel argument is a pointer, int64_t, uintptr_t or float");
    return static_cast<T>(tensor_data_ptr(PyTuple_GET_ITEM(args, n)));
}
template <> inline int64_t arg<int64_t>(PyObject* args, Py_ssize_t n) {
    Py_ssize_t value = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, n));
    if (value == -1 && PyErr_Occurred()) throw std::runtime_error("expected an int argument");
    return value;
}
template <> inline uintptr_t arg<uintptr_t>(PyObject* args, Py_ssize_t n) {
    void* value = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args, n));
    if (value == reinterpret_cast<void*>(-1) && PyErr_Occurred()) throw std::runtime_error("expected an int argument");
    return reinterpret_cast<uintptr_t>(value);
}
template <> inline float arg<float>(PyObject* args, Py_ssize_t n) {
    double value = PyFloat_AsDouble(PyTuple_GET_ITEM(args, n));
    if (value == -1.0 && PyErr_Occurred()) throw std::runtime_error("expected a float argument");
    return static_cast<float>(value);
}

template <typename Call> static PyObject* run(PyObject* args, Py_ssize_t expected, Call call) {
    if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != expected) {
        PyErr_Format(PyExc_TypeError, "a batched kernel takes %zd arguments", expected);
        return nullptr;
    }
    try {
        call();
    } catch (std::exception const& e) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    } catch (...) {
        PyErr_SetString(PyExc_RuntimeError, "a batched kernel raised a non-standard C++ exception");
        return nullptr;
    }
    Py_RETURN_NONE;
}

@CALLS@

static PyMethodDef methods[] = {
@METHODS@    {nullptr, nullptr, 0, nullptr}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "kernels", nullptr, -1, methods};

PyMODINIT_FUNC PyInit_kernels(void) {
    const char* address = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    if (address == nullptr || std::strtoull(address, nullptr, 10) == 0) {
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR is not set");
        return nullptr;
    }
    tensor_data_ptr = reinterpret_cast<void* (*)(PyObject*)>(std::strtoull(address, nullptr, 10));
    return PyModule_Create(&module_def);
}
"""


def _cpp_pybinding(self: AsyncCompile, argtypes: list[str], source_code: str) -> Any:
    if not _PATCH.active():
        return _PATCH.original("cpp_pybinding")(self, argtypes, source_code)
    batch = self.__dict__.get("_zpp_batch")
    if batch is None or batch.entries is not None:  # a module's first kernel, or one after its wait
        batch = self.__dict__["_zpp_batch"] = _Batch()
    index = batch.add(argtypes, source_code)
    if index is None:
        return _PATCH.original("cpp_pybinding")(self, argtypes, source_code)
    return PendingKernel(batch, index)


def _wait(self: AsyncCompile, scope: dict[str, Any]) -> None:
    for name, value in list(scope.items()):
        if isinstance(value, PendingKernel):
            scope[name] = value.result()
    _PATCH.original("wait")(self, scope)


# Outside batched() AsyncCompile builds as before.
_PATCH = ScopedPatch(
    "zpp_compile_batch_cpu_kernels", lambda: AsyncCompile, {"cpp_pybinding": _cpp_pybinding, "wait": _wait}
)
