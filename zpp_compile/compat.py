"""What differs between torch versions, in one place: the torch versions zpp_compile is tested
on, the private torch APIs it needs (checked when zpp_compile is imported), and renamed functions.

zpp_compile rewrites Dynamo/AOTAutograd/Inductor graphs and so reaches into torch's private
modules, which change between minor releases without deprecation (torch 2.11 lacks
torch.fx.experimental.symbolic_shapes.optimization_hint, for one). `check_torch()` runs first in
`import zpp_compile`: a missing private API raises one ImportError naming the symbol, the
installed torch and the supported range, instead of an AttributeError deep inside an import; an
untested torch version that has them all imports with an UntestedTorchWarning.
"""

from __future__ import annotations

import importlib
import re
import warnings
from typing import Callable, Mapping, Optional

import torch

# The torch versions zpp_compile is tested on; pyproject.toml's dependency is the same range
# (tests/test_packaging.py checks that they agree).
SUPPORTED_TORCH = ">=2.13,<2.14"
_SUPPORTED_MINORS = ((2, 13),)
TESTED_TORCH_VERSIONS = ("2.13.0",)

# {module: names zpp_compile takes from it} for every private torch API it uses. These modules are
# imported by `import zpp_compile` anyway, so checking them costs nothing.
PRIVATE_APIS: Mapping[str, tuple[str, ...]] = {
    "torch._C": ("_current_graph_task_id",),
    "torch._C._autograd": ("_top_saved_tensors_default_hooks",),
    "torch._C._dynamo.eval_frame": ("get_eval_frame_callback",),
    "torch._dynamo.backends.common": ("aot_autograd",),
    "torch._dynamo.backends.registry": ("register_backend", "_COMPILER_FNS"),
    "torch._dynamo.config": ("recompile_limit", "fail_on_recompile_limit_hit"),
    "torch._dynamo.eval_frame": ("set_code_exec_strategy",),
    "torch._dynamo.types": ("FrameAction", "FrameExecStrategy"),
    "torch._functorch._aot_autograd.autograd_cache": ("BypassAOTAutogradCache",),
    "torch._functorch._aot_autograd.graph_compile": ("is_opaque_node",),
    "torch._functorch._aot_autograd.schemas": ("SerializableAOTDispatchCompiler",),
    "torch._functorch.config": ("bundled_autograd_cache", "force_non_lazy_backward_lowering"),
    "torch._functorch.aot_autograd": ("make_boxed_func",),
    "torch._functorch.partitioners": ("is_sym_node", "min_cut_rematerialization_partition"),
    "torch._guards": ("CompileContext", "TracingContext", "detect_fake_mode", "tracing"),
    "torch._inductor.config": ("patch", "fallback_random"),
    "torch._inductor.output_code": ("OutputCode",),
    "torch.compiler._cache": ("CacheArtifactManager",),
    "torch._inductor.fx_passes.bucketing": (
        "bucket_key",
        "greedy_bucket_collective_by_mb",
        "is_all_gather_into_tensor",
        "is_reduce_scatter_tensor",
        "merge_all_gather",
        "merge_reduce_scatter",
    ),
    "torch.fx.graph": ("_BoxedCodeGen",),
    "torch.fx._graph_pickler": ("GraphPickler", "Options", "_TensorPickleData"),
    "torch.utils._mode_utils": ("no_dispatch",),
    "torch._subclasses.functional_tensor": ("dispatch_functionalize",),
    "torch.distributed.checkpoint.state_dict": ("_init_optim_state",),
    "torch.distributed.distributed_c10d": ("_resolve_process_group",),
    "torch.fx.experimental.proxy_tensor": ("make_fx",),
    "torch.fx.experimental.symbolic_shapes": ("optimization_hint",),
    "torch.utils._pytree": ("tree_map", "tree_map_only"),
}

# Private APIs of modules that take a second to import, checked when the backend first compiles.
LAZY_PRIVATE_APIS: Mapping[str, tuple[str, ...]] = {
    "torch._inductor.async_compile": ("AsyncCompile", "get_compile_threads"),
    "torch._inductor.codecache": ("CodeCacheFuture", "CppPythonBindingsCodeCache"),
    "torch._inductor.codegen.cpp": ("stride_at_vec_range",),
    "torch._inductor.compile_fx": ("compile_fx", "compile_fx_inner", "partition_fn"),
    "torch._inductor.decomposition": ("select_decomp_table",),
    "torch._inductor.utils": ("clear_on_fresh_cache",),
    "torch._inductor.runtime.autotune_cache": ("AutotuneCacheArtifact",),
}


class UntestedTorchWarning(UserWarning):
    """zpp_compile is imported with a torch version outside the tested range."""


def _minor(version: str) -> Optional[tuple[int, int]]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def untested_torch_message(version: str) -> Optional[str]:
    """The warning for torch `version` (e.g. "2.14.0+cu128"), or None inside the tested range."""
    if _minor(version) in _SUPPORTED_MINORS:
        return None
    return (
        f"zpp_compile is tested with torch{SUPPORTED_TORCH} ({', '.join(TESTED_TORCH_VERSIONS)}), and "
        f"torch {version} is installed: zpp_compile rewrites torch.compile's graphs through private "
        "torch APIs that change between releases, so it may fail or compute wrongly with this version. "
        f"Install a tested one: pip install 'torch{SUPPORTED_TORCH}'."
    )


def missing_private_api(
    apis: Mapping[str, tuple[str, ...]], import_module: Callable[[str], object] = importlib.import_module
) -> Optional[str]:
    """The first API of `apis` ({module: names}) this torch lacks, as "module.name" (or the module,
    with the reason it does not import), or None when all are there."""
    for module_name, names in apis.items():
        try:
            module = import_module(module_name)
        except (ImportError, AttributeError) as err:  # gone, or a module that changed under it
            return f"{module_name} ({type(err).__name__}: {err})"
        for name in names:
            if not hasattr(module, name):
                return f"{module_name}.{name}"
    return None


def unsupported_torch_error(symbol: str, version: str) -> ImportError:
    return ImportError(
        f"zpp_compile needs {symbol}, which the installed torch {version} does not provide: zpp_compile "
        f"supports torch{SUPPORTED_TORCH} (tested with {', '.join(TESTED_TORCH_VERSIONS)}) and relies on "
        f"private torch APIs that change between releases. Install a supported torch: "
        f"pip install 'torch{SUPPORTED_TORCH}'."
    )


def check_torch(
    version: Optional[str] = None,
    apis: Mapping[str, tuple[str, ...]] = PRIVATE_APIS,
    import_module: Callable[[str], object] = importlib.import_module,
) -> None:
    """Raise ImportError when torch lacks a private API zpp_compile needs; else warn
    (UntestedTorchWarning) when its version is outside the tested range."""
    version = torch.__version__ if version is None else version
    missing = missing_private_api(apis, import_module)
    if missing is not None:
        raise unsupported_torch_error(missing, version)
    message = untested_torch_message(version)
    if message is not None:
        warnings.warn(message, UntestedTorchWarning, stacklevel=2)


_lazy_checked = False


def check_lazy_private_apis() -> None:
    """check_torch for the APIs of slow-to-import modules (once, at the first compile)."""
    global _lazy_checked
    if not _lazy_checked:
        missing = missing_private_api(LAZY_PRIVATE_APIS)
        if missing is not None:
            raise unsupported_torch_error(missing, torch.__version__)
        _lazy_checked = True


check_torch()

import torch.distributed as dist  # noqa: E402  (after the check: a torch without them fails above)

# torch 2.13 renamed the flat-tensor collectives (the old names warn with a FutureWarning).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
