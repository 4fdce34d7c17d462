"""Compile time: where it goes (seconds per stage, logged), one compile for all the steps of a model,
and restarted jobs that hit Inductor's FX-graph cache (measured rates remembered; device meshes
kept out of the cache key)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch._functorch.aot_autograd import make_boxed_func
from torch.compiler._cache import CacheArtifactManager

import zpp_compile
from examples.training_utils import _CallbackHandler, compile_times_logged
from zpp_compile import passes
from zpp_compile.aot_cache import RewrittenPhase
from zpp_compile.backend import _opaque_inputs_outside, _with_opaque_inputs
from zpp_compile.cost_model import _best_of, _remembered, rates_file

from .models import batch, build, loss_curve, loss_of
from .workers import reset_process_state

ROOT = Path(__file__).resolve().parent.parent


def steps_with_compile_log(steps: int) -> dict:
    """Train the tiny GPT (ZeRO-3, Inductor) for `steps` steps with the compile-time log captured
    (AOTAutograd's cache off: every stage runs, as on a cold start)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    lines: list[str] = []
    try:
        torch.manual_seed(0)
        model = zpp_compile.shard(build("gpt"), zpp_compile.Config())
        compiled = torch.compile(model, backend="zeropp")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        start = time.perf_counter()
        with compile_times_logged(lines.append, enabled=True), aot_autograd_cache(False):  # what the example prints
            for step in range(steps):
                x, y = batch("gpt", 2 * world, step)
                loss_of("gpt", compiled, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
                opt.step()
                opt.zero_grad()
                if step == 0:
                    first_step_s = time.perf_counter() - start
        records = zpp_compile.compiled_graphs()
        return {
            "graphs": len(records),
            "graph_id": records[0].graph_id,  # process-wide numbering: earlier tasks' graphs count
            "stages": dict(records[0].compile_seconds),
            "inductor_cache": dict(records[0].inductor_cache),
            "aot_cache": records[0].aot_cache,
            "first_step_s": first_step_s,
            "lines": lines,
        }
    finally:
        reset_process_state()


def test_a_model_compiles_once_for_all_its_steps_and_says_where_the_time_went(pools):
    for result in pools(2).run(steps_with_compile_log, 3):
        # One graph for three steps: the second step used to recompile (a guard on the forward
        # counter's attribute, created by the first call).
        assert result["graphs"] == 1, result["graphs"]
        stages = result["stages"]
        expected = {
            *(f"dynamo/{p.__name__}" for p in passes.PRE_AUTOGRAD_PASSES),
            *(f"joint/{p.__name__}" for p in passes.JOINT_PASSES),
            *(f"partitioned/{p.__name__}" for p in passes.PARTITION_PASSES),
            *(f"forward/{p.__name__}" for p in passes.FORWARD_PASSES),
            *(f"backward/{p.__name__}" for p in passes.BACKWARD_PASSES),
            "aot_autograd", "joint/min_cut_partition", "joint/inductor_joint_passes",
            "forward/inductor", "backward/inductor",
        }  # fmt: skip
        assert expected <= set(stages), sorted(expected - set(stages))
        assert all(seconds >= 0 for seconds in stages.values()), stages
        assert stages["forward/inductor"] > 0 and stages["backward/inductor"] > 0
        # Exclusive times add up to no more than the first step that contains them all.
        assert sum(stages.values()) <= result["first_step_s"], (sum(stages.values()), result["first_step_s"])
        assert set(result["inductor_cache"]) == {"forward", "backward"}
        # Regions: a block's first region misses (a fresh cache) and the identical ones hit.
        assert all(re.fullmatch(r"hit|miss|\d+ hit, \d+ miss", v) for v in result["inductor_cache"].values())
        lines, graph = result["lines"], f"graph{result['graph_id']}"
        assert any(f"{graph}_forward compiled in" in line for line in lines), lines
        assert any(f"{graph}_backward compiled in" in line for line in lines), lines
        assert any(f"{graph}: backend took" in line for line in lines), lines
        off = "bypass: AOTAutograd's or Inductor's local cache is off"
        assert result["aot_cache"] == off and any(f"AOTAutograd cache {off}" in line for line in lines), lines


def aot_autograd_cache(enabled: bool):
    import torch._functorch.config as functorch_config

    return functorch_config.patch(enable_autograd_cache=enabled)


@contextlib.contextmanager
def _restrided_phases() -> Iterator[set[str]]:
    """The phases whose inputs AOTAutograd handed in other strides than the traced ones (Inductor's
    layout optimization of the forward), as compiled (RewrittenPhase.of) or loaded from the cache
    (RewrittenPhase.example_inputs): a spy on the real calls, which it leaves as they are."""
    found: set[str] = set()
    of, example_inputs = RewrittenPhase.of, RewrittenPhase.example_inputs

    def noting_of(*args: Any) -> RewrittenPhase:
        return noted(of(*args))

    def noting_example_inputs(self: RewrittenPhase) -> list[Any]:
        return example_inputs(noted(self))

    def noted(phase: RewrittenPhase) -> RewrittenPhase:
        if phase.input_strides:
            found.add(phase.phase)
        return phase

    RewrittenPhase.of, RewrittenPhase.example_inputs = staticmethod(noting_of), noting_example_inputs
    try:
        yield found
    finally:
        RewrittenPhase.of, RewrittenPhase.example_inputs = staticmethod(of), example_inputs


def _train_from(
    cache: str, config: zpp_compile.Config, steps: int = 2, artifacts: Optional[bytes] = None, model: str = "gpt"
) -> dict:
    """A fresh `model` trained `steps` steps with Inductor's (and AOTAutograd's) cache in `cache`,
    after torch.compiler.load_cache_artifacts(`artifacts`) when given."""
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    try:
        if artifacts is not None:
            torch.compiler.load_cache_artifacts(artifacts)
        with _restrided_phases() as restrided:
            losses, sharded = loss_curve(config, steps, lr=1e-2, model=model)
        records = zpp_compile.compiled_graphs()
        return {
            "rates": {f.name: f.read_text() for f in sorted(Path(cache, "zpp_compile").glob("rates-*.json"))},
            "restrided": restrided,
            "losses": losses,
            "shards": {n: p.to_local().detach().clone() for n, p in sharded.named_parameters()},
            "aot_cache": [r.aot_cache for r in records],
            "stages": [sorted(r.compile_seconds) for r in records],
            "graphs": [(r.forward.code, r.backward.code) for r in records],
            # Labels name the graph by its number in the process: not what is compared.
            "collectives": [
                {phase: [replace(c, label="") for c in cs] for phase, cs in r.collectives.items()} for r in records
            ],
        }
    finally:
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
        reset_process_state()


def train_twice_from_one_cache(cache: str, config: zpp_compile.Config, model: str) -> tuple[dict, dict]:
    return _train_from(cache, config, model=model), _train_from(cache, config, model=model)


FULL_ZEROPP = dict(ranks_per_node=2, hpz_size=2, quantize_weights=True, quantize_gradients=True)


# What full ZeRO++ must issue: qwZ's int8 gather, hpZ's int8 gather inside the node, qgZ's int4 all-to-all.
FULL_ZEROPP_COLLECTIVES = {("all_gather", torch.int8, 4), ("all_gather", torch.int8, 2), ("all_to_all", torch.uint8, 2)}


# Full ZeRO++ on the uneven MLP (a scalar, a frozen layer, a buffer): a cold compile of the tiny GPT's
# int8 and int4 kernels on 4 ranks took 275 s of 2 cores, near the task timeout on a busy machine.
# Convolutions compiled whole: Inductor's layout optimization (channels-last on CPU) makes the
# forward save activations the backward takes in other strides than traced; a loaded backward must
# be lowered for those (RewrittenPhase.input_strides), or its FX-graph key and stride checks differ.
@pytest.mark.parametrize(
    "world, config, model, expected_collectives, restrided",
    [
        (2, {}, "gpt", set(), set()),
        (4, FULL_ZEROPP, "mlp", FULL_ZEROPP_COLLECTIVES, set()),
        (2, {}, "conv", set(), {"backward"}),
    ],
    ids=["zero3", "full_zeropp", "zero3_channels_last"],
)
def test_a_second_start_loads_the_rewritten_graphs_and_trains_bitwise_alike(
    pools, tmp_path, world, config, model, expected_collectives, restrided
):
    """The second of two trainings from one cache folder (a restarted job, in-process) hits
    AOTAutograd's cache: no zpp_compile pass runs (only the lowering), the rewritten graphs and their
    collectives are those the first compile made, and losses and updated shards are bitwise equal."""
    results = pools(world).run(train_twice_from_one_cache, str(tmp_path), zpp_compile.Config(**config), model)
    for first, second in results:
        assert first["restrided"] == second["restrided"] == restrided, (first["restrided"], second["restrided"])
        kinds = {(c.op, c.dtype, len(c.group_ranks)) for r in first["collectives"] for cs in r.values() for c in cs}
        assert expected_collectives <= kinds, kinds
        assert first["aot_cache"] and all(outcome == "miss" for outcome in first["aot_cache"]), first["aot_cache"]
        assert all(outcome == "hit" for outcome in second["aot_cache"]), (
            second["aot_cache"],
            first["rates"],
            second["rates"],
        )
        ran = {stage.split("/")[-1] for stages in second["stages"] for stage in stages}
        assert not ran & {
            p.__name__ for p in (*passes.FORWARD_PASSES, *passes.BACKWARD_PASSES, *passes.JOINT_PASSES)
        }, ran
        assert second["graphs"] == first["graphs"]
        assert second["collectives"] == first["collectives"]
        assert second["losses"] == first["losses"]
        for name, shard in first["shards"].items():
            assert torch.equal(second["shards"][name], shard), name


def train_then_start_again_from_saved_artifacts(root: str, config: zpp_compile.Config) -> tuple[dict, dict, bytes]:
    """Train from an empty folder, keep what torch.compiler.save_cache_artifacts() gives, and train
    again from another empty folder after loading it (the "mega-cache" of a job moved elsewhere).
    Returns both trainings and the artifacts."""
    with CacheArtifactManager.with_fresh_cache():  # only this training's artifacts
        first = _train_from(os.path.join(root, "first"), config)
        artifacts, _ = torch.compiler.save_cache_artifacts()
    second = _train_from(os.path.join(root, f"second-rank{dist.get_rank()}"), config, artifacts=artifacts)
    return first, second, artifacts


# A process that loads the mega-cache before it imports zpp_compile (as a script may, at its top).
_LOAD_WITHOUT_ZPP_COMPILE = """
import json, sys, torch
info = torch.compiler.load_cache_artifacts(open(sys.argv[1], "rb").read())
assert "zpp_compile" not in sys.modules
print(json.dumps({kind: len(entries) for kind, entries in info.artifacts.items()}))
"""


def test_a_start_from_the_mega_cache_in_a_new_folder_loads_the_rewritten_graphs(pools, tmp_path):
    """The saved artifacts carry the measured rates (part of AOTAutograd's key, through the
    scheduling passes): a new folder loading them hits AOTAutograd's cache and trains alike. They
    load also where zpp_compile is not imported yet, graphs and rates alike."""
    results = pools(2).run(train_then_start_again_from_saved_artifacts, str(tmp_path), zpp_compile.Config())
    for first, second, _ in results:
        assert all(outcome == "miss" for outcome in first["aot_cache"]), first["aot_cache"]
        assert all(outcome == "hit" for outcome in second["aot_cache"]), (second["aot_cache"], second["rates"])
        assert second["losses"] == first["losses"]
    (tmp_path / "artifacts").write_bytes(results[0][2])
    cache = tmp_path / "third"
    loaded = subprocess.run(
        [sys.executable, "-c", _LOAD_WITHOUT_ZPP_COMPILE, str(tmp_path / "artifacts")],
        env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache)), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr
    kinds = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert kinds.get("aot_autograd") and kinds.get("inductor"), kinds
    name = rates_file(2, torch.device("cpu")).name
    remembered = json.loads((cache / "zpp_compile" / name).read_text())
    assert remembered == json.loads((tmp_path / "first" / "zpp_compile" / name).read_text())


def train_once_from(cache: str, config: zpp_compile.Config) -> dict:
    return _train_from(cache, config, steps=1)


def test_a_config_the_cache_cannot_serve_is_compiled_every_time_and_says_why(pools, tmp_path):
    """qgZ error feedback numbers its state slots per process: its graphs are not kept (every
    pass runs on every start), and the record says why."""
    config = zpp_compile.Config(ranks_per_node=1, quantize_gradients=True, qgz_error_feedback=True)
    for result in pools(2).run(train_once_from, str(tmp_path), config):
        assert result["aot_cache"] == ["bypass: qgZ error feedback numbers its state slots per process"], result
        assert any("backward/qgz" in stages for stages in result["stages"]), result["stages"]


_RATE_NAMES = ("bytes_per_s", "flops_per_s")


def _remembered_on_every_rank(stored: dict[int, tuple], measurements: list[tuple], root: str) -> tuple:
    """_remembered() with this rank's own cache folder holding `stored[rank]` (absent: no file),
    measuring `measurements` in turn (each a collective, as the real measurement is). Returns the
    rates, the file written, how many measurements were taken and what was logged."""
    rank, device = dist.get_rank(), torch.device("cpu")
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, f"rank{rank}")
    taken, logged = iter(measurements), []

    def measure() -> dict[str, float]:
        dist.barrier()  # ranks that measured different numbers of times would hang here
        return dict(zip(_RATE_NAMES, next(taken)))

    handler = _CallbackHandler(logged.append)
    cost_model_log = logging.getLogger("zpp_compile.cost_model")
    cost_model_log.addHandler(handler)
    try:
        path = rates_file(dist.get_world_size(), device)
        path.unlink(missing_ok=True)
        if rank in stored:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(dict(zip(_RATE_NAMES, stored[rank]))))
        os.environ["LOCAL_RANK"] = "0"  # each rank here stands for a node of its own: it writes
        rates = tuple(_remembered(measure, None, device).values())
        written = json.loads(path.read_text()) if path.exists() else None
        return rates, written, len(measurements) - len(list(taken)), logged
    finally:
        cost_model_log.removeHandler(handler)
        os.environ.pop("LOCAL_RANK", None)
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


_SLOW = (1e8, 1e10)  # what the measurements below give, but for the one that says otherwise
_FAR_OFF = (1e9, 1e10)  # 10x the bytes/s of _SLOW: another network, or a measurement under load


@pytest.mark.parametrize(
    "stored, measurements, expected, taken",
    [
        ({}, [_SLOW] * 4, _SLOW, 4),  # nothing remembered: the best of 4 measurements, which is then written
        ({0: (1.5e8, 2e10), 1: (1.5e8, 2e10)}, [_SLOW] * 4, (1.5e8, 2e10), 1),  # close to it: the remembered
        ({0: _FAR_OFF, 1: _FAR_OFF}, [_SLOW] * 4, _SLOW, 4),  # 10x off four times: measured afresh
        ({0: _FAR_OFF, 1: _FAR_OFF}, [_SLOW, (2e8, 1e10), _SLOW, _SLOW], (2e8, 1e10), 4),  # the best of them
        # Off once (a busy machine), then back within the tolerance: the remembered rates stand.
        ({0: _FAR_OFF, 1: _FAR_OFF}, [_SLOW, (5e8, 1e10), _SLOW, _SLOW], _FAR_OFF, 2),
        ({0: (1.5e8, 2e10)}, [_SLOW] * 4, _SLOW, 4),  # ranks that chose differently agree on the smaller
        ({0: _FAR_OFF}, [_SLOW] * 4, _SLOW, 4),  # one rank's file off: every rank measures again with it
    ],
    ids=["nothing_remembered", "remembered", "too_far_off", "best_kept", "off_once", "ranks_disagree", "one_rank_off"],
)
def test_measured_rates_are_remembered_so_a_restart_schedules_alike(
    pools, tmp_path, stored, measurements, expected, taken
):
    results = pools(2).run(_remembered_on_every_rank, stored, measurements, str(tmp_path))
    for rank, (rates, written, measured, logged) in enumerate(results):
        assert rates == pytest.approx(expected)
        assert written == {"bytes_per_s": pytest.approx(expected[0]), "flops_per_s": pytest.approx(expected[1])}
        assert measured == taken
        replaced = rank in stored and stored[rank] != expected
        assert len(logged) == replaced, logged  # a replaced rate says so: the graphs will compile again
        if replaced:
            assert "replace those remembered" in logged[0] and "compile again" in logged[0], logged[0]
            assert "Config(intra_node_gbps=" in logged[0], logged[0]


def test_the_best_of_two_measurements_is_the_faster_rate_and_the_shorter_time():
    first = {"bytes_per_s": 1e8, "flops_per_s": 4e10, "latency_s": 2e-4}
    second = {"bytes_per_s": 3e8, "flops_per_s": 1e10, "latency_s": 5e-4}
    assert _best_of(first, second) == {"bytes_per_s": 3e8, "flops_per_s": 4e10, "latency_s": 2e-4}


def test_device_meshes_stay_outside_the_inductor_graph_and_come_back_where_they_were():
    graph = fx.Graph()
    x, mesh = graph.placeholder("x"), graph.placeholder("mesh")
    graph.placeholder("unused_mesh")  # read by no node
    y = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    graph.output((y, mesh, None, mesh))
    gm = fx.GraphModule({}, graph)
    meshes = (object(), object())
    lowered, inputs, moved = _opaque_inputs_outside(gm, [torch.ones(3), *meshes])
    assert [n.name for n in lowered.graph.nodes if n.op == "placeholder"] == ["x"]
    assert len(inputs) == 1 and isinstance(inputs[0], torch.Tensor)
    assert [n.op for n in gm.graph.nodes].count("placeholder") == 3  # the original graph is left alone
    compiled = _with_opaque_inputs(make_boxed_func(lowered.forward), moved)
    args = [torch.arange(3.0), *meshes]
    out = compiled(args)
    assert torch.equal(out[0], torch.arange(3.0) * 2)
    assert out[1] is meshes[0] and out[2] is None and out[3] is meshes[0]
    assert args == []  # the boxed convention: the inputs are released to the callee
    # A graph whose opaque inputs are read by a node keeps them (nothing to move).
    kept_graph = fx.Graph()
    a, m = kept_graph.placeholder("a"), kept_graph.placeholder("m")
    kept_graph.output((kept_graph.call_function(id, (m,)), a))
    kept = fx.GraphModule({}, kept_graph)
    assert _opaque_inputs_outside(kept, [torch.ones(1), object()])[0] is kept


def _train_example(out: Path, cache: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "examples" / "train_gpt.py"), "--out-dir", str(out), "--data-mb", "0.5", "--steps", "2",
           "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "2"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=str(cache))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env, check=False)


@pytest.mark.distributed  # launches torchrun
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_restarted_job_hits_the_caches_for_every_graph(tmp_path):
    """The example run twice with one cache folder, as a restarted job: the second run's graphs all
    come from AOTAutograd's cache and their regions from Inductor's FX-graph cache (its log says so
    per graph), the first run's were compiled."""
    logs, losses, rates_replaced = [], [], []
    for run in ("cold", "warm"):
        done = _train_example(tmp_path / run, tmp_path / "inductor_cache")
        assert done.returncode == 0, done.stderr[-3000:]
        logs.append([line for line in done.stdout.splitlines() if "compiled in" in line or "backend took" in line])
        rates_replaced += [line for line in done.stderr.splitlines() if "replace those remembered" in line]
        losses.append(re.findall(r"step \d+/\d+ \| loss [0-9.]+", done.stdout))
    cold, warm = ([line for line in log if "compiled in" in line] for log in logs)
    assert cold and len(cold) == len(warm), (cold, warm)
    # The whole backend: AOTAutograd's cache kept the rewritten graphs (aot_cache.py).
    cold_graphs, warm_graphs = ([line for line in log if "backend took" in line] for log in logs)
    assert cold_graphs and all(line.endswith("AOTAutograd cache miss") for line in cold_graphs), cold_graphs
    assert len(warm_graphs) == len(cold_graphs), warm_graphs
    assert all(line.endswith("AOTAutograd cache hit") for line in warm_graphs), (warm_graphs, rates_replaced)
    assert losses[0] and losses[0] == losses[1], losses  # the loaded graphs train as the compiled ones
    # Cold: every phase looks its graphs up. Mostly they miss, but a rank may find what the other
    # rank, which shares the cache folder, wrote a moment before (its repeated regions, too, may
    # hit each other): a hit here is a race between the ranks, not a stale cache.
    assert all(re.search(r"FX graph cache (hit|(\d+ hit, \d+ )?miss)$", line) for line in cold), cold
    assert all(line.endswith("FX graph cache hit") for line in warm), warm
