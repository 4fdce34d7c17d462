"""The one configuration object of zpp_compile: a frozen dataclass, validated on construction."""

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

Lowering = Literal["inductor", "aot_eager"]


@dataclasses.dataclass(frozen=True)
class Config:
    """How `zpp_compile.shard` partitions a model and how the "zeropp" backend compiles it.

    Attributes:
        quantize_weights: qwZ, int8 block-quantized forward all-gather (compiled path only; the
            eager reference path gathers full precision).
        weight_block_size: elements per quantization block for qwZ (one scale per block).
        quantize_frozen_weights: store every frozen parameter (requires_grad=False at shard()
            time) as its packed int8 payload, quantized once: its gathers, forward and backward,
            then move int8 and need no quantize step, and its shard takes ~1/4 of fp32 memory.
            The LoRA / fine-tuning case. Works with or without quantize_weights.
        hpz_size: hpZ: after the forward gather each rank keeps 1/hpz_size of every weight it
            needs in backward, and the backward gather runs over hpz_size ranks of one node
            instead of the world. Must divide ranks_per_node; None or 1 turns hpZ off.
        hpz_quantized_secondary: with hpZ and qwZ (or frozen weights stored int8), keep the
            secondary shard as the int8 payloads the forward gathered, not dequantized: the same
            backward values, 1/4 (fp32) or 1/2 (16-bit) of the saved memory and of the bytes.
        quantize_gradients: qgZ, int4 hierarchical all-to-all gradient reduce-scatter (compiled path
            only): int4 inside the node, re-quantized int4 across nodes, averaged once in fp32.
        gradient_block_size: elements per int4 block for qgZ (one fp32 scale per block), a
            multiple of 8; 128 by measurement (docs/qgz_block_size.md).
        qgz_error_feedback: each rank adds the int4 error of its last send back into the next
            one (LoCo-style), at both qgZ stages. Costs bf16 state of about one unsharded
            gradient per rank; off by default (see docs/qgz_convergence.md for the measurement).
        gather_bucket_bytes: neighbouring all-gathers of one group and dtype travel as one
            collective up to this many bytes (as sent: int8 payloads under qwZ); 0: one each.
        reduce_bucket_bytes: the same for gradient reduce-scatters, and for qgZ's all-to-alls
            (there counted in the gradients' dtype, before int4).
        prefetch_limit: how many collectives may be in flight at once (0 turns the overlap
            scheduling off: each collective is issued where its result is needed, then waited).
            Each gather is issued early enough to hide behind the compute before it, by the cost
            model, and each wait sits right before the first use of its result.
        prefetch_bytes: and how many bytes (as received) those in-flight collectives may hold.
        intra_node_gbps, inter_node_gbps, compute_tflops: the cost model's link bandwidths
            (Gbit/s per rank) and compute rate; None measures them once in shard() (the slowest
            rank's value, so every rank decides alike).
        collective_timeout_s: how long a collective waits for a rank that does not arrive before
            every waiting rank fails with a CollectiveError naming the graph (a rank that dies
            fails its peers at once). shard() then creates zpp_compile's own process groups,
            the world-wide one included, with this timeout. None: the default process group's
            timeout (torch.distributed.init_process_group(timeout=...)) and its world group.
        check_schedule: before a checked compiled-graph run or eager collective, every rank
            compares a digest of the collectives it is about to issue and of the parameters they
            carry; a difference raises ScheduleMismatchError on every rank naming the first
            differing collective and parameter, instead of hanging or mixing parameters. An int
            N checks the first N runs of the process (default 8: cheap, one small all-gather per
            run); True checks every run (debug; also ZPP_CHECK_SCHEDULE=1); False none.
        param_dtype: mixed precision, in the spirit of FSDP2's MixedPrecisionPolicy: the shards
            (which the optimizer steps on) keep their dtype, e.g. fp32 masters; each gather casts
            the shard to param_dtype first, so the wire and the forward/backward compute carry
            it. qwZ quantizes straight from the master shard and dequantizes to param_dtype.
            Floating-point inputs of the root module's forward are cast to it too (like FSDP2's
            cast_forward_inputs), so float activations meet weights of their dtype. None: off.
        reduce_dtype: the dtype gradients are reduce-scattered (averaged) in; None: param_dtype
            (or the gradient's own dtype), except fp32 under param_dtype=torch.float16, whose sum
            over many ranks overflows. (fp16 also needs loss scaling whose inf check spans all
            ranks: each rank sees only its own gradient shards; prefer bf16.) The averaged shard gradient is then cast to the
            shard's dtype. qgZ reads the gradient in this dtype and quantizes it to int4.
        ranks_per_node: ranks per node; None reads torchrun's LOCAL_WORLD_SIZE, else one node.
            Setting it simulates several nodes on one machine.
        save_gathered_weights: keep gathered full weights from forward for backward instead of
            re-gathering them there (trades the ZeRO-3 memory bound for one fewer all-gather).
        lowering: "inductor" (default) compiles the rewritten graphs with Inductor;
            "aot_eager" runs them as plain FX graphs, for debugging the passes.
        dump_graphs_dir: write every graph before and after every pass to this folder
            (also set by the environment variable ZPP_DUMP_GRAPHS).
    """

    quantize_weights: bool = False
    weight_block_size: int = 256
    quantize_frozen_weights: bool = False
    hpz_size: Optional[int] = None
    hpz_quantized_secondary: bool = True
    quantize_gradients: bool = False
    gradient_block_size: int = 128
    qgz_error_feedback: bool = False
    gather_bucket_bytes: int = 25 * 2**20
    reduce_bucket_bytes: int = 25 * 2**20
    prefetch_limit: int = 2
    prefetch_bytes: int = 256 * 2**20
    intra_node_gbps: Optional[float] = None
    inter_node_gbps: Optional[float] = None
    compute_tflops: Optional[float] = None
    collective_timeout_s: Optional[float] = None
    check_schedule: Union[bool, int] = DEFAULT_CHECKED_RUNS
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    ranks_per_node: Optional[int] = None
    save_gathered_weights: bool = False
    lowering: Lowering = "inductor"
    dump_graphs_dir: Optional[str] = None

    def __post_init__(self) -> None:
        _require_bool(self, "quantize_weights")
        _require_bool(self, "quantize_frozen_weights")
        _require_bool(self, "quantize_gradients")
        _require_bool(self, "hpz_quantized_secondary")
        _require_bool(self, "qgz_error_feedback")
        if self.qgz_error_feedback and not self.quantize_gradients:
            raise ValueError("Config.qgz_error_feedback=True needs quantize_gradients=True (it is part of qgZ).")
        _require_bool(self, "save_gathered_weights")
        _require_block_size(self, "weight_block_size", suggestion=256)
        _require_block_size(self, "gradient_block_size", suggestion=128)
        _require_int(self, "gather_bucket_bytes", minimum=0)
        _require_int(self, "reduce_bucket_bytes", minimum=0)
        _require_int(self, "prefetch_limit", minimum=0)
        _require_int(self, "prefetch_bytes", minimum=0)
        for name in ("intra_node_gbps", "inter_node_gbps", "compute_tflops"):
            _require_positive_or_none(self, name, none_means="measure it in shard()")
        _require_positive_or_none(
            self, "collective_timeout_s", none_means="use the process group's timeout (float('inf'): never time out)"
        )
        if not isinstance(self.check_schedule, bool):
            _require_int(self, "check_schedule", minimum=0)
        _require_float_dtype_or_none(self, "param_dtype")
        _require_float_dtype_or_none(self, "reduce_dtype")
        if self.hpz_size is not None:
            _require_int(self, "hpz_size", minimum=1)
        if self.ranks_per_node is not None:
            _require_int(self, "ranks_per_node", minimum=1)
        if self.lowering not in ("inductor", "aot_eager"):
            raise ValueError(
                f"Config.lowering={self.lowering!r} is not a lowering; use 'inductor' or 'aot_eager'."
            )
        if self.dump_graphs_dir is not None and not isinstance(self.dump_graphs_dir, (str, os.PathLike)):
            raise TypeError(
                f"Config.dump_graphs_dir must be a folder path, got {type(self.dump_graphs_dir).__name__}."
            )

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
    def hpz_enabled(self) -> bool:
        return self.hpz_size is not None and self.hpz_size > 1

    @property
    def checked_runs(self) -> Union[bool, int]:
        """check_schedule, or True when the environment asks for every run (ZPP_CHECK_SCHEDULE=1)."""
        return True if os.environ.get("ZPP_CHECK_SCHEDULE", "") not in ("", "0") else self.check_schedule

    @property
    def graph_dump_dir(self) -> Optional[str]:
        """The folder graphs are dumped to: the config's, else $ZPP_DUMP_GRAPHS, else None."""
        return os.fspath(self.dump_graphs_dir) if self.dump_graphs_dir else os.environ.get("ZPP_DUMP_GRAPHS") or None


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


def _require_positive_or_none(config: Config, name: str, *, none_means: str) -> None:
    value = getattr(config, name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"Config.{name}={value!r} must be a positive number, or None to {none_means}.")
