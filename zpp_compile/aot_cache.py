"""Warm starts that skip AOTAutograd and zpp_compile's passes: AOTAutograd's own cache keeps the
graphs the passes left, and a restarted job only lowers them again (Inductor's FX graph cache).

AOTAutograd caches a compile only when its compilers return an OutputCode it can serialize.
Inductor's compilers do; a compiler that wraps Inductor (as zeropp's does: passes, then Inductor
region by region) gets no caching, so every start traced the joint graph, partitioned it and ran
every pass again (26-38 s of the backend's time on a warm start at GPT-2 small). Here each phase's compile returns a
ZeroppOutputCode: the rewritten graph (pickled with torch's GraphPickler, fake values included),
the schedule markers read before the passes, and the lowered callable. AOTAutograd keeps it in
its bundled cache entry next to its own runtime metadata (views, mutations, DTensor wrapping); a
cache hit unpickles it and lowers it in the new process.

What the key holds beyond AOTAutograd's own (the Dynamo graph, input metadata, torch and
Inductor configs): a tag with zpp_compile's code and pass lists, the Config, the Topology (rank and
group names included: they are in the graphs), the parameters' shard specs, the quantization
kernels forced by ZPP_QUANT_KERNELS and the cost model's rates (the scheduling passes order by
them). Config fields only the lowering and the run-time wrappers read (check_schedule,
collective_timeout_s, share_compiles, batch_cpu_kernels) are left out: a hit lowers with the new Config. The tag is
torch's `cache_key_tag`, set only while AOTAutograd computes its key; Inductor's compiles inside
see the user's own tag plus zpp_compile's code version (tagged_with_code), so the regions the
ranks of a host share keep one key.

Not cached (the compile runs as before; GraphRecord.aot_cache says why): Config(plan="auto") (the
plan depends on rates measured in this process), qgZ error feedback (its state slots are numbered
per process), graph dumps asked for (each compile writes them), lowering="aot_eager", and a
rewritten graph calling a Triton kernel (Triton's kernel table is per process: qwZ and qgZ on GPU).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import logging
import os
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._inductor.output_code import OutputCode

from . import eager_collectives, graph_pickling
from .cache_folders import code_version
from .config import Config
from .passes.graph_utils import has_static_geometry
from .schedule_check import ScheduledCollective
from .topology import Topology

log = logging.getLogger(__name__)

# The backend's lowering of a loaded phase, set while it runs AOTAutograd (see caching()).
_LOWER: contextvars.ContextVar[Optional[Callable[[RewrittenPhase, list[Any]], Callable]]] = contextvars.ContextVar(
    "zpp_aot_cache_lower", default=None
)
_USER_TAG: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("zpp_aot_cache_user_tag", default=None)


@dataclasses.dataclass
class RewrittenPhase:
    """One phase's graph as zpp_compile's passes left it, with what lowering it needs besides."""

    phase: str  # "forward" | "backward" | "inference"
    gm: Optional[fx.GraphModule]  # None only in the pickled copy (the graph is pickled apart)
    markers: tuple[ScheduledCollective, ...]  # the schedule entries read off the markers before the passes
    # The strides of the inputs AOTAutograd handed the compiler, where they differ from the
    # placeholders' values: it restrides the backward's saved activations to those the compiled
    # forward makes (Inductor's layout optimization), in its inputs only.
    input_strides: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    unkept: Optional[str] = None  # why the graph cannot be loaded in another process (unkept_reason)

    @staticmethod
    def of(
        phase: str, gm: fx.GraphModule, markers: Sequence[ScheduledCollective], inputs: Sequence[Any]
    ) -> RewrittenPhase:
        """The phase as the passes left `gm`; `inputs`: the example inputs the compiler was given."""
        placeholders = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
        strides = {
            i: tuple(given.stride())
            for i, (given, traced) in enumerate(zip(inputs, placeholders))
            if _static_tensor(given) and _static_tensor(traced) and given.stride() != traced.stride()
        }  # fmt: skip
        return RewrittenPhase(phase, gm, tuple(markers), strides, unkept_reason(gm))

    def example_inputs(self) -> list[Any]:
        """The inputs AOTAutograd handed the compiler: the placeholders' fake values, restrided."""
        assert self.gm is not None
        values = [n.meta.get("val") for n in self.gm.graph.nodes if n.op == "placeholder"]
        for i, stride in self.input_strides.items():
            values[i] = values[i].as_strided(values[i].size(), stride)
        return values


def _static_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and has_static_geometry(value)


class ZeroppOutputCode(OutputCode):
    """A compiled phase as AOTAutograd's cache keeps it (see the module docstring)."""

    def __init__(self, rewritten: RewrittenPhase, compiled: Callable) -> None:
        self._rewritten: Optional[RewrittenPhase] = rewritten
        self._compiled: Optional[Callable] = compiled
        self._pickled_graph: Optional[bytes] = None
        self._boxed_call = True
        self._fx_graph_cache_key = None
        self._fx_graph_cache_debug_lines = None
        self._time_taken_ns = 0

    def __call__(self, inputs: Sequence[Any]) -> Any:
        if self._compiled is None:
            raise RuntimeError("zpp_compile: a cached graph was called before it was loaded (post_compile)")
        return self._compiled(inputs)

    def prepare_for_serialization(self) -> None:
        """Runs on AOTAutograd's copy of this object before it is pickled into the cache entry."""
        from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache

        rewritten = self._rewritten
        if rewritten is None:
            return
        if rewritten.unkept is not None:
            raise BypassAOTAutogradCache(f"zpp_compile: {rewritten.unkept}")
        try:
            self._pickled_graph = graph_pickling.dumps(rewritten.gm)
        except Exception as err:  # anything GraphPickler cannot carry: compile again next time
            raise BypassAOTAutogradCache(f"zpp_compile: the rewritten graph cannot be pickled ({err})") from err
        self._rewritten = dataclasses.replace(rewritten, gm=None)
        self._compiled = None

    def post_compile(self, example_inputs: Sequence[Any], constants: Any, graph_kwargs: Any) -> None:
        """On a cache hit: unpickle the graph into this compile's fake mode and lower it. A failure
        counts as a miss: AOTAutograd compiles afresh and overwrites the entry."""
        from torch._functorch._aot_autograd.autograd_cache import FXGraphCacheMiss
        from torch._guards import detect_fake_mode

        if self._compiled is not None:
            return
        lower = _LOWER.get()
        if lower is None or self._pickled_graph is None or self._rewritten is None:
            raise FXGraphCacheMiss("zpp_compile: a cached zeropp graph can only be loaded by backend='zeropp'")
        try:
            gm = graph_pickling.loads(self._pickled_graph, detect_fake_mode(example_inputs))
            rewritten = dataclasses.replace(self._rewritten, gm=gm)
            self._compiled = lower(rewritten, rewritten.example_inputs())
        except Exception as err:
            log.warning(
                "zpp_compile: a cached %s graph could not be loaded (%r); compiling it again",
                self._rewritten.phase,
                err,
            )
            raise FXGraphCacheMiss(f"zpp_compile: loading the cached graph failed: {err!r}") from err
        self._rewritten, self._pickled_graph = rewritten, None

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass

    def __copy__(self) -> ZeroppOutputCode:
        # AOTAutograd serializes a shallow copy: the live object keeps its graph and callable.
        clone = ZeroppOutputCode.__new__(ZeroppOutputCode)
        clone.__dict__.update(self.__dict__)
        return clone


def unkept_reason(gm: fx.GraphModule) -> Optional[str]:
    """Why a rewritten graph cannot be loaded in another process, or None."""
    hops = torch.ops.higher_order
    per_process = {
        getattr(hops, name, None) for name in ("triton_kernel_wrapper_functional", "triton_kernel_wrapper_mutation")
    }
    per_process.discard(None)
    for module in gm.modules():  # subgraphs too (higher-order ops hold theirs as submodules)
        for node in module.graph.nodes if isinstance(module, fx.GraphModule) else ():
            if node.op == "call_function" and node.target in per_process:
                return f"{node.name} calls a Triton kernel by this process's kernel table index"
    return None


def bypass_reason(config: Config) -> Optional[str]:
    """Why the graphs of a model with this Config are not kept in AOTAutograd's cache, or None."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    if not functorch_config.enable_autograd_cache or not inductor_config.fx_graph_cache:
        return "AOTAutograd's or Inductor's local cache is off"
    if inductor_config.force_disable_caches:
        return "torch._inductor.config.force_disable_caches"
    if config.lowering != "inductor":
        return f'lowering="{config.lowering}"'
    if config.auto_plan:
        return 'plan="auto" chooses from rates measured in this process'
    if config.qgz_error_feedback:
        return "qgZ error feedback numbers its state slots per process"
    if config.graph_dump_dir is not None:
        return "graph_dump_dir is set: every compile writes its graphs"
    return None


# Config fields only the lowering and the run-time wrappers read, which a cache hit runs afresh
# with the new Config: changing them between starts must not miss.
_LOWERING_ONLY = ("check_schedule", "collective_timeout_s", "share_compiles", "batch_cpu_kernels")


def key_tag(config: Config, topology: Topology, shard_specs: Sequence[Any], cost_model: Any) -> str:
    """What zeropp's rewrite depends on beyond AOTAutograd's own key (see the module docstring):
    zpp_compile's code and pass lists, the Config, the Topology, the parameters' shard specs, the
    quantization kernels forced by ZPP_QUANT_KERNELS, and the cost model's rates."""
    from . import passes

    pipeline = [
        [p.__name__ for p in stage]
        for stage in (passes.PRE_AUTOGRAD_PASSES, passes.JOINT_PASSES, passes.PARTITION_PASSES,
                      passes.FORWARD_PASSES, passes.BACKWARD_PASSES)
    ]  # fmt: skip
    # A spec's plan_id (which shard() call) only keeps Dynamo's graphs apart; the rewrite never reads
    # it (qgZ error feedback does, and is not cached), so a second model of a process may load the first's.
    specs = tuple(repr(dataclasses.replace(spec, plan_id=0)) for spec in shard_specs)
    kernels = os.environ.get("ZPP_QUANT_KERNELS")  # the quantization kernels forced (codegen/registry.py)
    settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in _LOWERING_ONLY}
    topology = dataclasses.replace(topology, collective_timeout_s=None)  # the group names tell timeouts apart
    text = repr((code_version(), pipeline, settings, topology, specs, kernels, cost_model, _rooting()))
    return "zeropp-" + hashlib.sha256(text.encode()).hexdigest()


def _rooting() -> tuple:
    """What root_large_collectives decides by besides the graph: its size rule, and which backend
    carries which device (a graph rooted on gloo must not be loaded where NCCL carries it)."""
    backends = dist.get_backend_config() if dist.is_initialized() else ""
    return eager_collectives.ROOTED_MIN_BYTES, backends


@contextlib.contextmanager
def caching(tag: str, lower: Callable[[RewrittenPhase, list[Any]], Callable]) -> Iterator[None]:
    """Around one AOTAutograd call: its cache is on for zeropp's compilers, keyed with `tag`; the
    backward compiles inside the call (its entry is saved with the forward's); a hit lowers each
    phase with `lower`."""
    import torch._functorch.config as functorch_config
    import torch.compiler.config as compiler_config

    user_tag = compiler_config.cache_key_tag
    lower_token, tag_token = _LOWER.set(lower), _USER_TAG.set(user_tag)
    try:
        with (
            functorch_config.patch(bundled_autograd_cache=True, force_non_lazy_backward_lowering=True),
            compiler_config.patch(cache_key_tag=f"{user_tag}{tag}"),
        ):
            yield
    finally:
        _LOWER.reset(lower_token)
        _USER_TAG.reset(tag_token)


@contextlib.contextmanager
def inductor_own_settings() -> Iterator[None]:
    """Inductor's own compiles inside caching() see the user's settings: the user's cache tag, not
    zeropp's (see the module docstring), and the bundled cache off (under it Inductor would skip
    its FX graph cache, which the lowering of a loaded phase relies on)."""
    import torch._functorch.config as functorch_config
    import torch.compiler.config as compiler_config

    user_tag = _USER_TAG.get()
    if user_tag is None:
        yield
        return
    with (
        functorch_config.patch(bundled_autograd_cache=False),
        compiler_config.patch(cache_key_tag=user_tag),
    ):
        yield


@contextlib.contextmanager
def tagged_with_code() -> Iterator[None]:
    """Inductor's compiles of zeropp's graphs keyed by zpp_compile's code as well. Inductor's
    FX-graph cache key names a custom op, not its kernels: a graph calling zpp's ops, compiled
    against an older fake kernel (other output strides), was loaded and failed its stride check.
    The ranks of a host run the same code, so they still share each region's entry."""
    import torch.compiler.config as compiler_config

    with compiler_config.patch(cache_key_tag=f"{compiler_config.cache_key_tag}zpp-code-{code_version()[:16]}"):
        yield


def output_code(rewritten: RewrittenPhase, compiled: Callable) -> Callable:
    """What a phase's compiler returns: cacheable while caching() is on, else the callable itself."""
    if _LOWER.get() is None:
        return compiled
    return ZeroppOutputCode(rewritten, compiled)
