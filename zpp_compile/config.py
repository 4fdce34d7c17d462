"""The one configuration object of zpp_compile: a frozen dataclass, validated on construction.

Each field's documentation is written once, next to the field (its `doc` metadata): Config's
docstring lists them, and README.md's Config table is config_table_markdown() pasted in
(tests/test_config_docs.py keeps the two equal)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

# The schedule check's default: the first 8 checked runs of a process (schedule_check.py).
DEFAULT_CHECKED_RUNS = 8

# The cost model's fixed costs (cost_model.py), defaults of Config.collective_latency_us and
# Config.kernel_us. Order-of-magnitude figures, not measured by zpp_compile: a small collective
# between nodes (NCCL over InfiniBand or RoCE) takes tens of microseconds whatever its size, and
# launching one GPU kernel a few. Only the overlap scheduling reads them (how much compute hides a
# gather); a measured value, e.g. the time of an all-gather of a few bytes, can replace them.
DEFAULT_COLLECTIVE_LATENCY_US = 50.0
DEFAULT_KERNEL_US = 5.0

Lowering = Literal["inductor", "aot_eager"]
PlanMode = Literal["manual", "auto"]

# The fields Config(plan="auto") chooses per graph (auto_plan.py); with "auto" they must keep their
# defaults, so that no choice of the user's is silently overridden.
PLANNED_FIELDS = (
    "quantize_weights",
    "qwz_parameters",
    "hpz_size",
    "hpz_quantized_secondary",
    "hpz_parameters",
    "quantize_gradients",
    "hierarchical_reduce",
    "hierarchical_gather",
    "gather_bucket_bytes",
    "reduce_bucket_bytes",
    "prefetch_limit",
    "keep_whole_numel",
)
# Config(plan="auto")'s default memory budget per rank: this fraction of the memory of the device
# the model trains on (a CUDA device's total memory; on the CPU, the machine's memory divided by
# the ranks of the node). The rest is left to activations, the optimizer and the allocator.
DEFAULT_MEMORY_BUDGET_FRACTION = 0.25


def _field(default: Any, doc: str) -> Any:
    """A Config field with its documentation: the one source of the class docstring's Attributes
    and of README.md's Config table (config_table_markdown(); tests/test_config_docs.py)."""
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclasses.dataclass(frozen=True)
class Config:
    """How `zpp_compile.shard` partitions a model and how the "zeropp" backend compiles it.

    Every field is a keyword argument; what each means is written next to it below (the `doc` of
    its dataclasses.field metadata), listed under Attributes at the end of this docstring and in
    README.md's Config table.
    """

    quantize_weights: bool = _field(
        False,
        "qwZ: the compiled forward all-gathers each weight as one int8 payload (int8 blocks, then one fp32 "
        "scale per block) and dequantizes it to the parameter's dtype (`param_dtype` under mixed precision). "
        "Backward gathers stay full precision; the eager path is not quantized",
    )
    qwz_parameters: Optional[tuple[str, ...]] = _field(
        None,
        "with `quantize_weights`: the parameters (names as `named_parameters()` gives them) whose forward "
        "gathers are int8; the others' stay in full precision (e.g. leave out a tied embedding / output head, "
        "which take the rounding hardest). `None`: every parameter. Under hpZ, the secondary shard of a "
        'weight left out is kept in full precision. `plan="auto"` sets it when it leaves the forward\'s tail '
        "(the weights kept gathered into the backward) out of qwZ. An unknown name is refused by `shard()`",
    )
    weight_block_size: int = _field(
        256,
        "elements per int8 block (one scale each), a multiple of 8. 256 is the knee measured in "
        "docs/qwz_kernels_cpu.md: scales add 1.56% to the wire; 64 cuts the error by 15% for 4x the scale "
        "bytes and a 2.6x slower quantize, 1024 saves 1.2% of bytes for 13% more error (59% more on "
        "heavy-tailed weights)",
    )
    quantize_frozen_weights: bool = _field(
        False,
        "parameters with `requires_grad=False` at `shard()` are stored as their int8 payload, quantized once: "
        "~1/4 of the fp32 shard memory, and their gathers (forward and backward) move int8 with no quantize "
        "step. For LoRA / fine-tuning; works with or without `quantize_weights`. `full_state_dict` returns "
        "their dequantized values",
    )
    hpz_size: Optional[int] = _field(
        None,
        "hpZ: after each forward gather, a rank keeps its 1/K of the weights the backward needs (a tensor "
        "handed from forward to backward, nothing kept between steps); the backward gathers them over the K "
        "ranks of its node instead of the world, so backward weight gathers cross no node boundary. K must "
        "divide `ranks_per_node` (a warning on a single node, where hpZ saves nothing); `None`/1 is off. "
        "Compiled path only",
    )
    hpz_quantized_secondary: bool = _field(
        True,
        "with hpZ and qwZ (or frozen int8 weights), keep the secondary shard as the int8 payloads the forward "
        "gathered: the backward dequantizes the same bytes the forward did, for 1/4 (fp32) or 1/2 (16-bit) of "
        "the memory and intra-node bytes of the dequantized alternative (`False`)",
    )
    hpz_parameters: Optional[tuple[str, ...]] = _field(
        None,
        "with hpZ: the parameters (names as `named_parameters()` gives them) whose backward gathers read "
        "secondary shards in the node; the others' cross nodes as under ZeRO-3 and cost no secondary "
        'memory. `None`: every parameter. `plan="auto"` sets it when the memory budget holds the secondary '
        "shards of only some weights (those the backward gathers first). An unknown name is refused by "
        "`shard()`; a graph Dynamo runs for several modules follows the names of the one it was compiled for",
    )
    quantize_gradients: bool = _field(
        False,
        "qgZ: each gradient reduce-scatter becomes int4 quantize (chunks reordered by destination) -> "
        "all-to-all in the node -> dequantize, sum, re-quantize -> all-to-all across nodes -> dequantize, sum, "
        "divide by the world once, in fp32. Inter-node gradient bytes: 1/8 of fp32 plus one scale per block. "
        "Compiled path only",
    )
    hierarchical_reduce: bool = _field(
        False,
        "lossless gradient reduce-scatter by qgZ's route: each bucket of gradients goes as an all-to-all in the "
        "node, a sum (fp32), then an all-to-all of the node sums across nodes and a sum, in the gradients' own "
        "dtype. A node sends the others (N-1)/N of the gradient bytes (N nodes) against (W-1)/W for a ring "
        "reduce-scatter over W ranks and twice that for gloo's: 3x fewer bytes between nodes on 2 nodes x 2 "
        "over gloo (docs/auto_plan.md). Equal to the reduce-scatter within float rounding, not bitwise (another "
        'summation order). Implied by `quantize_gradients`; chosen by `plan="auto"` where it pays. Compiled path only',
    )
    hierarchical_gather: bool = _field(
        False,
        "each all-gather over the world (bucketed; int8 payloads under qwZ) becomes an all-gather across nodes "
        "(each rank's part to its counterpart on every other node), then one in the node, and a copy into world "
        "order. A node receives each other node's L parts once (L ranks per node) instead of the W-1 a ring "
        "carries across the boundary: 2 against 3 per direction on 2 nodes x 2 over gloo. Bitwise the same "
        'values. With several nodes of several ranks; chosen by `plan="auto"` where it pays. Compiled path only',
    )
    gradient_block_size: int = _field(
        128,
        "elements per int4 block for qgZ (one fp32 scale each), a multiple of 8. 128 is the knee measured in "
        "docs/qgz_block_size.md: scales add 6.25% to the int4 bytes; 64 cuts the error on real GPT gradients "
        "by 8% for twice the scale bytes, 256 saves 3.1% of bytes for 14% more error",
    )
    qgz_error_feedback: bool = _field(
        False,
        "qgZ with error feedback (LoCo-style): each rank adds the int4 error of its last send back into the "
        "next, at both stages, so the compressed gradient is unbiased over time. State: bf16, about one "
        "unsharded gradient per rank; off by default (docs/qgz_convergence.md has the measurement). "
        "`zpp_compile.clear_error_feedback()` drops it",
    )
    qgz_error_beta: float = _field(
        0.0,
        "with `qgz_error_feedback`: the share of its stored error a rank keeps each step, as DeepSpeed LoCo's "
        "`err_beta`: stored = beta * stored + (1 - beta) * this step's error; 0 feeds the whole last error "
        "back. A number in [0, 1). Measured with AdamW in docs/convergence_at_scale.md: neither 0 nor 0.8 "
        "(LoCo's usual value) trained closer to fp32 than no feedback",
    )
    gather_bucket_bytes: int = _field(
        25 * 2**20,
        "neighbouring all-gathers of one group and dtype travel as one collective up to this many bytes as "
        "sent (int8 payloads under qwZ); Inductor's own bucketing pass does the merge. 0: one collective per "
        "parameter",
    )
    reduce_bucket_bytes: int = _field(
        25 * 2**20,
        "the same for gradient reduce-scatters, and for qgZ's all-to-all pairs (counted there in the "
        "gradients' dtype; whole int4 blocks per parameter, so bucketing does not change the result)",
    )
    prefetch_limit: int = _field(
        2,
        "collectives in flight at once. Each gather starts early enough, by the cost model, to hide behind "
        "the compute before it; each wait sits right before the first use. 0 turns overlap scheduling off "
        "(each collective is issued where its result is needed, then waited)",
    )
    keep_whole_numel: int = _field(
        0,
        "parameters of at most this many elements are not sharded: every rank holds them whole, with their "
        "gradients and optimizer state, and their gradients are all-reduced (compiled: bucketed up to "
        "`reduce_bucket_bytes` across blocks; eager: one each), so biases and norms take no slot in any gather "
        "(DeepSpeed's `stage3_param_persistence_threshold`, whose gradients stay partitioned). Frozen weights "
        'stored int8 stay sharded. 0: every parameter with a dim is sharded. `plan="auto"` sets it from the '
        "measured links and the memory budget",
    )
    prefetch_bytes: int = _field(256 * 2**20, "and the most bytes (as received) those in-flight collectives may hold")
    intra_node_gbps: Optional[float] = _field(
        None,
        "the cost model's bandwidth between ranks of one node, Gbit/s per rank; `None` measures it once in "
        '`shard()` (one all-gather of the world, or, with `plan="auto"` on several nodes, inside each node; the '
        "slowest rank's value, so all ranks decide alike)",
    )
    inter_node_gbps: Optional[float] = _field(
        None,
        "the cost model's bandwidth between nodes, Gbit/s per rank; `None`: measured with `intra_node_gbps` "
        '(with `plan="auto"` on several nodes: by one all-gather across nodes, every rank at once)',
    )
    compute_tflops: Optional[float] = _field(
        None,
        "the cost model's compute rate, TFLOP/s; `None` measures it once in `shard()` (one matmul; the "
        "slowest rank's value)",
    )
    collective_latency_us: float = _field(
        DEFAULT_COLLECTIVE_LATENCY_US,
        "the cost model's fixed cost of one collective, microseconds, added to its bytes / bandwidth; the "
        "default is the order of a small inter-node NCCL collective (put a measured one here: the time of an "
        "all-gather of a few bytes)",
    )
    kernel_us: float = _field(
        DEFAULT_KERNEL_US,
        "the cost model's fixed cost of one compute kernel, microseconds, added to its FLOPs / "
        "`compute_tflops`; the default is the order of one GPU kernel launch",
    )
    collective_timeout_s: Optional[float] = _field(
        None,
        "seconds a collective issued by zpp_compile waits for a missing rank before every waiting rank raises "
        "`CollectiveError` naming the graph (a rank that dies fails its peers at once); `shard()` then creates "
        "zpp_compile's own process groups (a world-wide one included) with this timeout; `float('inf')`: "
        "never time out. `None`: world-wide collectives use the default process group and its timeout "
        "(hpZ/qgZ sub-groups get torch's default timeout for new groups). Keep it above how far ranks can "
        "drift apart without a fault (first compile); docs/faults.md",
    )
    check_schedule: Union[bool, int] = _field(
        DEFAULT_CHECKED_RUNS,
        "`bool` or `int`: before each of the first N compiled-graph runs and eager collectives of the process, "
        "every rank all-gathers a 16-byte digest of the collectives it is about to issue and the parameters "
        "they carry; a difference raises `ScheduleMismatchError` on every rank naming the first differing "
        "collective and parameter, instead of hanging or mixing parameters. Never blocks a correct program. "
        "`True` (also `ZPP_CHECK_SCHEDULE=1`): every run, for debugging; `False`: off. docs/faults.md",
    )
    param_dtype: Optional[torch.dtype] = _field(
        None,
        "mixed precision (in the spirit of FSDP2's `MixedPrecisionPolicy`): the dtype every gather casts the "
        "shard to before the wire, and the forward/backward compute dtype (e.g. `torch.bfloat16`). The shards "
        "the optimizer steps on keep their own dtype (fp32 masters). Floating-point inputs of the root "
        "module's forward are cast to it; buffers are not. Under qwZ the master shard is quantized and "
        "dequantized to this dtype. `None`: off",
    )
    reduce_dtype: Optional[torch.dtype] = _field(
        None,
        "the dtype gradients are reduce-scattered (averaged) in, then cast to the shard's dtype; `None`: "
        "`param_dtype` (else the gradient's own), except fp32 under `param_dtype=torch.float16`, whose sum "
        "over many ranks overflows (fp16 also needs loss scaling: `torch.amp.GradScaler` works, its overflow "
        "check spanning all ranks; bf16 needs none). qgZ reads the gradient in this dtype before quantizing "
        "it to int4",
    )
    ranks_per_node: Optional[int] = _field(
        None,
        "ranks per node; `None` reads torchrun's `LOCAL_WORLD_SIZE`, else one node. Set it to simulate "
        "several nodes on one machine",
    )
    save_gathered_weights: bool = _field(
        False,
        "keep gathered weights from forward for backward instead of re-gathering them there (trades the "
        "ZeRO-3 memory bound for one fewer all-gather)",
    )
    keep_last_weights_gathered: bool = _field(
        True,
        "the weights the forward reads last outside any repeated block (output head, final norm, a tied "
        "embedding; in a graph without repeated blocks, the last weight it reads) stay gathered from forward "
        "into the backward, which starts with them, instead of being freed and gathered again: one all-gather "
        "fewer per step for them (HF GPT-2 small: 31% of the backward's all-gather bytes; its peak memory did not "
        "move, as the backward gathers them first). FSDP2 keeps its root module's parameters gathered alike. "
        "Each graph split off by a graph break, and each forward run before one backward, holds its own tail "
        "until its backward. Not the weights qwZ quantizes (`qwz_parameters`), whose forward copies are "
        "approximate: the backward gathers them again. `False`: the backward gathers every weight again",
    )
    lowering: Lowering = _field(
        "inductor",
        '`"inductor"` compiles the rewritten graphs with Inductor; `"aot_eager"` runs them as plain FX '
        "graphs, for debugging the passes",
    )
    inductor_regions: Optional[bool] = _field(
        None,
        "cut the graphs by block: buckets never span two repeated blocks (`h.3.` vs `h.4.`), and under "
        "Inductor each run of computation between two collectives compiles as a region of its own, so "
        "identical blocks compile once (compile time grows little with depth). `None`: when the model "
        "has at least 4 repeated blocks; `False`: buckets across blocks, each graph compiled whole",
    )
    share_compiles: bool = _field(
        True,
        "the ranks of one host that share an Inductor cache directory compile each distinct region of a graph "
        "(`inductor_regions`), or each graph compiled whole, once between them: a rank skips the regions another "
        "is compiling (a file lock in the cache directory) and loads them from the cache afterwards. No "
        "collective; `False`: each rank compiles every region itself",
    )
    batch_cpu_kernels: bool = _field(
        True,
        "on CPU, the C++ kernels of each graph zeropp rewrites (of each region, where cut) are built as one "
        "library, one compiler run instead of one per kernel (zpp_compile/cpu_kernel_batching.py): the same "
        "kernels, bitwise the same results with Inductor's default flags, most of the compiler's per-run cost "
        "saved on a cold start. `False`: Inductor's own way, a library per kernel",
    )
    plan: PlanMode = _field(
        "manual",
        '`"manual"`: the fields above say which ZeRO++ techniques run. `"auto"`: each compiled graph gets the '
        "communication plan the cost model estimates fastest within `memory_budget_bytes` -- qwZ, hpZ (and its "
        "int8 secondary), the hierarchical reduce and gather, bucket sizes, prefetch depth; qgZ only with `allow_lossy` -- "
        "from the links and compute "
        "rate measured in `shard()` and the graph's own parameters and FLOPs; the fields it chooses must keep "
        "their defaults. Every rank chooses alike; `zpp_compile.explain(model)` prints each choice and the "
        "options weighed (docs/auto_plan.md)",
    )
    memory_budget_bytes: Optional[int] = _field(
        None,
        'with `plan="auto"`: the bytes per rank the plan may hold for the parameters -- shards, gradient shards, '
        "gathered weights and buckets in flight, hpZ's secondary shards, qgZ's error feedback -- not counting "
        "activations and optimizer state. `None`: a quarter of the device's memory (CPU: of the machine's, "
        "divided by the ranks per node). Below what ZeRO-3 needs, `shard()` raises with the figures",
    )
    allow_lossy: bool = _field(
        False,
        'with `plan="auto"`: the plan may also choose qgZ (int4 gradients), which changes the numerics of the '
        "gradient (qwZ is chosen without it: it rounds the forward's weights, not the update); with "
        "`qgz_error_feedback=True` as well, a graph that gets qgZ gets error feedback. Off: gradients are "
        "reduced in full precision, by ZeRO-3's reduce-scatter or the hierarchical reduce (the same sums within "
        "float rounding)",
    )
    plan_trial_steps: int = _field(
        0,
        'with `plan="auto"`: where the estimate cannot tell apart the best options of several sets of techniques '
        "(hpZ with an int8 or an fp32 secondary counts as one; within its 10% tie, at most 3), each training graph compiles each of them and runs each for this many "
        "steps (after one warm-up step), then keeps the one whose median step was shortest on the slowest rank; "
        "every rank keeps the same one. Costs one compile per extra candidate and, while the trial runs, "
        "steps under plans that are not the fastest (and, where one candidate has qwZ and another not, "
        "forward numerics that change from candidate to candidate). What a trial keeps is remembered in "
        "Inductor's cache folder: a restarted job weighing the same candidates takes it without timing again. "
        "0: the estimate alone decides",
    )
    dump_graphs_dir: Optional[str] = _field(
        None, "dump every graph before/after every pass to this folder (also `ZPP_DUMP_GRAPHS=dir`)"
    )

    def __post_init__(self) -> None:
        _require_bool(self, "quantize_weights")
        _require_bool(self, "quantize_frozen_weights")
        _require_bool(self, "quantize_gradients")
        _require_bool(self, "hierarchical_reduce")
        _require_bool(self, "hierarchical_gather")
        if self.inductor_regions is not None:
            _require_bool(self, "inductor_regions")
        _require_bool(self, "share_compiles")
        _require_bool(self, "batch_cpu_kernels")
        _require_bool(self, "hpz_quantized_secondary")
        _require_bool(self, "qgz_error_feedback")
        _require_fraction(self, "qgz_error_beta")
        if self.qgz_error_feedback and not self.quantize_gradients and not (self.auto_plan and self.allow_lossy):
            raise ValueError("Config.qgz_error_feedback=True needs quantize_gradients=True (it is part of qgZ).")
        if self.qgz_error_beta and not self.qgz_error_feedback:
            raise ValueError(
                f"Config.qgz_error_beta={self.qgz_error_beta!r} is a setting of error feedback: set "
                "qgz_error_feedback=True too, or leave qgz_error_beta at 0."
            )
        _require_bool(self, "save_gathered_weights")
        _require_bool(self, "keep_last_weights_gathered")
        _require_block_size(self, "weight_block_size", suggestion=256)
        _require_block_size(self, "gradient_block_size", suggestion=128)
        _require_int(self, "gather_bucket_bytes", minimum=0)
        _require_int(self, "reduce_bucket_bytes", minimum=0)
        _require_int(self, "prefetch_limit", minimum=0)
        _require_int(self, "keep_whole_numel", minimum=0)
        _require_int(self, "prefetch_bytes", minimum=0)
        for name in ("intra_node_gbps", "inter_node_gbps", "compute_tflops"):
            _require_positive_or_none(self, name, none_means="measure it in shard()")
        for name in ("collective_latency_us", "kernel_us"):
            _require_non_negative_number(self, name)
        _require_positive_or_none(
            self, "collective_timeout_s", none_means="use the process group's timeout (float('inf'): never time out)"
        )
        if not isinstance(self.check_schedule, bool):
            _require_int(self, "check_schedule", minimum=0)
        _require_float_dtype_or_none(self, "param_dtype")
        _require_float_dtype_or_none(self, "reduce_dtype")
        if self.hpz_size is not None:
            _require_int(self, "hpz_size", minimum=1)
        _check_parameter_names(self, "hpz_parameters", "hpZ covers", self.hpz_enabled, "set hpz_size too")
        _check_parameter_names(
            self, "qwz_parameters", "qwZ quantizes", self.quantize_weights, "set quantize_weights=True too"
        )
        if self.ranks_per_node is not None:
            _require_int(self, "ranks_per_node", minimum=1)
        if self.lowering not in ("inductor", "aot_eager"):
            raise ValueError(f"Config.lowering={self.lowering!r} is not a lowering; use 'inductor' or 'aot_eager'.")
        _check_plan_fields(self)
        if self.dump_graphs_dir is not None and not isinstance(self.dump_graphs_dir, (str, os.PathLike)):
            raise TypeError(f"Config.dump_graphs_dir must be a folder path, got {type(self.dump_graphs_dir).__name__}.")

    @classmethod
    def from_deepspeed(cls, ds_config: Union[Mapping[str, Any], str, os.PathLike], **overrides: Any) -> Config:
        """The Config closest to a DeepSpeed ZeRO-3 / ZeRO++ config: a dict, or a JSON file's path.

        Keyword arguments are Config fields, applied last. Keys with no counterpart warn; keys that
        would change training and that zpp_compile cannot honour (ZeRO stage 1/2, offload) raise.
        The mapping: zpp_compile/migration.py and docs/migration.md.
        """
        from .migration import config_from_deepspeed  # only when used: keeps `import zpp_compile` light

        return config_from_deepspeed(ds_config, **overrides)

    @classmethod
    def from_fsdp2(
        cls,
        mp_policy: Optional[MixedPrecisionPolicy] = None,
        reshard_after_forward: Union[bool, int, None] = True,
        **overrides: Any,
    ) -> Config:
        """The Config matching FSDP2's fully_shard(mp_policy=..., reshard_after_forward=...).

        reshard_after_forward: True (ZeRO-3), False (save_gathered_weights=True) or an int K
        (hpz_size=K; K must divide the ranks per node). Keyword arguments are Config fields,
        applied last. The mapping: zpp_compile/migration.py and docs/migration.md.
        """
        from .migration import config_from_fsdp2

        return config_from_fsdp2(mp_policy, reshard_after_forward, **overrides)

    @property
    def auto_plan(self) -> bool:
        return self.plan == "auto"

    @property
    def hpz_enabled(self) -> bool:
        return self.hpz_size is not None and self.hpz_size > 1

    def quantizes_weight(self, name: Optional[str]) -> bool:
        """Whether qwZ gathers the parameter `name` as int8 in the forward (Config.qwz_parameters).
        None (a gather of no named parameter) counts as named only when every parameter is."""
        return self.quantize_weights and (self.qwz_parameters is None or name in self.qwz_parameters)

    @property
    def checked_runs(self) -> Union[bool, int]:
        """check_schedule, or True when the environment asks for every run (ZPP_CHECK_SCHEDULE=1)."""
        return True if os.environ.get("ZPP_CHECK_SCHEDULE", "") not in ("", "0") else self.check_schedule

    @property
    def graph_dump_dir(self) -> Optional[str]:
        """The folder graphs are dumped to: the config's, else $ZPP_DUMP_GRAPHS, else None."""
        return os.fspath(self.dump_graphs_dir) if self.dump_graphs_dir else os.environ.get("ZPP_DUMP_GRAPHS") or None


def _check_parameter_names(config: Config, field: str, chooses: str, enabled: bool, fix: str) -> None:
    """hpz_parameters / qwz_parameters: None, or a tuple of names, for a technique that is on."""
    names = getattr(config, field)
    if names is None:
        return
    if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"Config.{field} must be a tuple of parameter names (str), got {names!r}; "
            f"e.g. {field}=tuple(name for name, _ in model.named_parameters() if 'h.11.' in name)."
        )
    if not enabled and not config.auto_plan:
        raise ValueError(f"Config.{field} chooses which weights {chooses}: {fix}, or remove it.")


def _check_plan_fields(config: Config) -> None:
    if config.plan not in ("manual", "auto"):
        raise ValueError(f"Config.plan={config.plan!r} is not a plan mode; use 'manual' or 'auto'.")
    _require_bool(config, "allow_lossy")
    if config.memory_budget_bytes is not None:
        _require_int(config, "memory_budget_bytes", minimum=1)
    _require_int(config, "plan_trial_steps", minimum=0)
    if not config.auto_plan:
        for name in ("memory_budget_bytes", "allow_lossy", "plan_trial_steps"):
            if getattr(config, name) != _DEFAULTS[name]:
                raise ValueError(
                    f"Config.{name} is read by the automatic plan only; add plan='auto', or remove {name}."
                )
        return
    chosen = [n for n in PLANNED_FIELDS if getattr(config, n) != _DEFAULTS[n]]
    if chosen:
        raise ValueError(
            f"Config(plan='auto') chooses {', '.join(chosen)} itself, and this Config sets "
            f"{'it' if len(chosen) == 1 else 'them'}: remove {', '.join(chosen)} to let the plan choose "
            "(memory_budget_bytes and allow_lossy steer it), or use plan='manual' to keep your settings."
        )


def _shown_default(value: Any) -> str:
    """A default as README's Config table shows it: `None`, `False`, `"inductor"`, 256, 25 MiB."""
    if value is None or isinstance(value, bool):
        return f"`{value}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, int) and value >= 2**20 and value % 2**20 == 0:
        return f"{value // 2**20} MiB"
    return f"{value:g}"


def config_table_markdown() -> str:
    """README.md's Config table (field | default | meaning), written from the fields' documentation."""
    rows = ["| field | default | meaning |", "| --- | --- | --- |"]
    for f in dataclasses.fields(Config):
        rows.append(f"| `{f.name}` | {_shown_default(f.default)} | {f.metadata['doc']} |")
    return "\n".join(rows)


def _attributes_section() -> str:
    lines = ["", "    Attributes:"]
    for f in dataclasses.fields(Config):
        lines.append(f"        {f.name} (default {f.default!r}): {f.metadata['doc'].replace('`', '')}.")
    return "\n".join(lines) + "\n"


Config.__doc__ = (Config.__doc__ or "") + _attributes_section()
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}


def _require_bool(config: Config, name: str) -> None:
    value = getattr(config, name)
    if not isinstance(value, bool):
        raise TypeError(f"Config.{name} must be True or False, got {value!r}.")


# Larger blocks save under 0.1% of the bytes (one fp32 scale per block) and pad every shard to
# whole blocks: 2**26 cost 1.6 GB and 15 s per step on a 616-parameter MLP. The kernels tile a
# block into one program, so very large blocks are slow as well.
MAX_BLOCK_SIZE = 8192


def _require_block_size(config: Config, name: str, *, suggestion: int) -> None:
    _require_int(config, name, minimum=8)
    value = getattr(config, name)
    if value % 8:
        raise ValueError(
            f"Config.{name}={value} must be a multiple of 8 "
            f"so that blocks stay aligned in the communication buffer; try {suggestion}."
        )
    if value > MAX_BLOCK_SIZE:
        raise ValueError(
            f"Config.{name}={value} is larger than {MAX_BLOCK_SIZE}: every shard is padded to whole blocks "
            f"(2**26 took 1.6 GB and 15 s per step on a 616-parameter MLP) and the scales it saves are "
            f"under 0.1% of the bytes; use {suggestion} (the measured knee, docs/) or at most {MAX_BLOCK_SIZE}."
        )


def _require_int(config: Config, name: str, *, minimum: int) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Config.{name} must be an int, got {value!r}.")
    if value < minimum:
        raise ValueError(f"Config.{name}={value} is out of range: it must be >= {minimum}.")


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _require_float_dtype_or_none(config: Config, name: str) -> None:
    value = getattr(config, name)
    if value is not None and not isinstance(value, torch.dtype) and _is_fsdp2_mixed_precision_policy(value):
        raise TypeError(
            f"Config.{name} takes a torch dtype, got FSDP2's MixedPrecisionPolicy; build the Config "
            "from the policy with Config.from_fsdp2(mp_policy=...)."
        )
    if value is not None and value not in _FLOAT_DTYPES:
        raise ValueError(
            f"Config.{name}={value!r} is not a floating-point torch dtype; use torch.bfloat16, "
            "torch.float16 or torch.float32 (or None for no mixed precision)."
        )


def _is_fsdp2_mixed_precision_policy(value: object) -> bool:
    # Imported only for a value that is not a dtype: config.py itself never loads FSDP.
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    except ImportError:  # a torch built without torch.distributed has no policy to mistake
        return False
    return isinstance(value, MixedPrecisionPolicy)


def _require_fraction(config: Config, name: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"Config.{name}={value!r} must be a number in [0, 1).")


def _require_non_negative_number(config: Config, name: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
        raise ValueError(f"Config.{name}={value!r} must be a finite number >= 0 (microseconds).")


def _require_positive_or_none(config: Config, name: str, *, none_means: str) -> None:
    value = getattr(config, name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"Config.{name}={value!r} must be a positive number, or None to {none_means}.")
