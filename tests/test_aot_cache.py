"""aot_cache's pieces that need no training: what the key holds and ignores, and which graphs
refuse to be kept (the warm starts themselves are tested in test_compile_time.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.fx as fx

from zpp_compile import Config
from zpp_compile.aot_cache import RewrittenPhase, key_tag
from zpp_compile.layout import ShardSpec
from zpp_compile.topology import Topology

TOPOLOGY = Topology(world_size=2, rank=0, ranks_per_node=2, world_group_name="0")
SPEC = ShardSpec(fqn="w", shape=(4, 4), numel=16, group_size=2, group_name="0")
DEFAULT = Config()


def _key(config: Config = DEFAULT, topology: Topology = TOPOLOGY, spec: ShardSpec = SPEC, rates=(1e9,)) -> str:
    return key_tag(config, topology, [spec], rates)


@pytest.mark.parametrize(
    "changed",
    [
        {"config": Config(quantize_weights=True)},
        {"config": Config(gather_bucket_bytes=2**20)},
        {"topology": dataclasses.replace(TOPOLOGY, rank=1)},  # ranks and group names are in the graphs
        {"spec": dataclasses.replace(SPEC, shape=(8, 2))},
        {"rates": (2e9,)},  # the scheduling passes order by them
    ],
    ids=["technique", "bucket_size", "rank", "shape", "rates"],
)
def test_what_the_rewrite_reads_is_in_the_key(changed):
    assert _key(**changed) != _key()


@pytest.mark.parametrize(
    "changed",
    [
        {"config": Config(check_schedule=False)},
        {"config": Config(collective_timeout_s=30.0)},
        {"config": Config(share_compiles=False)},
        {"config": Config(batch_cpu_kernels=False)},
        {"topology": dataclasses.replace(TOPOLOGY, collective_timeout_s=30.0)},
        {"spec": dataclasses.replace(SPEC, plan_id=3)},  # which shard() call: the rewrite never reads it
    ],
    ids=["check_schedule", "timeout", "share_compiles", "batch_cpu_kernels", "topology_timeout", "plan_id"],
)
def test_what_only_the_lowering_reads_leaves_the_key_alone(changed):
    """A hit lowers the graphs afresh with the new settings: changing these must not miss."""
    assert _key(**changed) == _key()


def _graph_calling(target) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(target, (x,)))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_a_graph_calling_a_triton_kernel_is_not_kept_even_inside_a_subgraph():
    """Triton kernels are called by an index into this process's kernel table: another process
    cannot run the graph, so the phase says why it is not kept."""
    wrapper = torch.ops.higher_order.triton_kernel_wrapper_functional
    plain = RewrittenPhase.of("forward", _graph_calling(torch.relu), (), ())
    assert plain.unkept is None
    outer = _graph_calling(torch.relu)
    outer.add_submodule("subgraph_0", _graph_calling(wrapper))  # as a higher-order op holds its body
    phase = RewrittenPhase.of("forward", outer, (), ())
    assert phase.unkept is not None and "Triton kernel" in phase.unkept, phase.unkept


def _inductor_cache_outcome(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> str:
    """Compile gm as zeropp's lowering does and say whether Inductor's FX-graph cache had it."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from zpp_compile import backend, compile_timing

    before = compile_timing.fx_graph_cache_counts()
    # Inductor caches only a graph traced with a shape environment, as Dynamo's are.
    with tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True))):
        backend._compile_unbatched(fx.GraphModule(gm, gm.graph), inputs)
    hits, misses, _ = (b - a for a, b in zip(before, compile_timing.fx_graph_cache_counts()))
    return "hit" if hits and not misses else "miss" if misses and not hits else f"{hits} hits, {misses} misses"


def test_inductors_cache_misses_when_zpp_compiles_code_changes(tmp_path, monkeypatch, group_of_one):
    """Inductor keys a custom op by its name only: a graph calling zpp's ops, compiled by other
    code (an older fake kernel's strides), must not be loaded."""
    import torch._inductor.config as inductor_config

    from zpp_compile import aot_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from torch.fx.experimental.proxy_tensor import make_fx

    inputs = [torch.randn(8, 4)]
    outcomes = []
    with inductor_config.patch(fx_graph_cache=True, force_disable_caches=False):
        for version in ("a", "a", "b"):
            monkeypatch.setattr(aot_cache, "code_version", lambda v=version: v * 16)
            # Traced anew for each compile, as the backend hands each compile a graph of its own
            # (a compile writes into its graph's node meta, which the cache key reads).
            gm = make_fx(lambda x: (torch.ops.zpp.owned_slot(x.reshape(-1), 1, group_of_one) * 2,))(*inputs)
            outcomes.append(_inductor_cache_outcome(gm, inputs))
    assert outcomes == ["miss", "hit", "miss"], outcomes
