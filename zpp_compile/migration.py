"""Config from a DeepSpeed config or from FSDP2's `fully_shard` arguments.

`Config.from_deepspeed` and `Config.from_fsdp2` call into this module, which they import only
when called. docs/migration.md has the same tables with the reasons and examples.

DeepSpeed key -> Config field:
    zero_optimization.stage                                must be 3 (zpp_compile is ZeRO-3 only)
    zero_optimization.zero_quantized_weights               quantize_weights (qwZ)
    zero_optimization.zero_quantized_nontrainable_weights  quantize_frozen_weights
    zero_optimization.zero_hpz_partition_size              hpz_size (hpZ; 0 or 1: None, off)
    zero_optimization.zero_quantized_gradients             quantize_gradients (qgZ)
    zero_optimization.zeropp_loco_param                    qgz_error_feedback=True, err_beta ->
                                                           qgz_error_beta (reset_T has no
                                                           counterpart: warning)
    zero_optimization.reduce_bucket_size                   reduce_bucket_bytes  } DeepSpeed counts
    zero_optimization.allgather_bucket_size                gather_bucket_bytes  } elements: times 2
    zero_optimization.stage3_prefetch_bucket_size          prefetch_bytes       } under bf16/fp16, 4
    zero_optimization.stage3_param_persistence_threshold   keep_whole_numel (elements)
    bf16.enabled / fp16.enabled                            param_dtype=torch.bfloat16 / float16
    communication_data_type, else data_types.grad_accum_dtype   reduce_dtype
A value "auto" (as HF Accelerate writes it) or a key left out keeps zpp_compile's default, not
DeepSpeed's. Every other key gets a UserWarning naming it and why it has no effect here, or a
ValueError naming it and the fix where ignoring it would change training: a ZeRO stage other
than 3, CPU/NVMe offload, bf16 and fp16 both on. gradient_clipping and fp16's loss scaling get a
warning saying what to do in the training loop instead (fp16: the torch.amp.GradScaler call).

FSDP2 argument -> Config field:
    mp_policy.param_dtype, mp_policy.reduce_dtype          param_dtype, reduce_dtype
    mp_policy.output_dtype, cast_forward_inputs=False      no counterpart (warning)
    reshard_after_forward=True or None                     the default, ZeRO-3
    reshard_after_forward=False                            save_gathered_weights=True
    reshard_after_forward=K (int >= 2)                     hpz_size=K
"""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from .config import Config

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

log = logging.getLogger(__name__)

DeepSpeedConfig = Union[Mapping[str, Any], str, "os.PathLike[str]"]
ReshardAfterForward = Union[bool, int, None]


class _Translation:
    """The Config fields read from a foreign config, the key each came from, and what to warn."""

    def __init__(self, origin: str) -> None:
        self.origin = origin  # "DeepSpeed" or "FSDP2", for messages
        self.fields: dict[str, Any] = {}
        self.sources: dict[str, str] = {}
        self.warnings: list[str] = []
        self.without_effect: dict[str, str] = {}  # foreign key -> why it does nothing here

    def set(self, field: str, value: Any, source: str) -> None:
        self.fields[field] = value
        self.sources[field] = source

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def ignore(self, key: str, reason: str) -> None:
        self.without_effect[key] = reason

    def build(self, overrides: Mapping[str, Any]) -> Config:
        """Config(fields, then overrides); its own validation errors name the key they came from."""
        try:
            config = Config(**{**self.fields, **overrides})
        except (TypeError, ValueError) as err:
            _note_source(err, {field: source for field, source in self.sources.items() if field not in overrides})
            raise
        if self.without_effect:
            listed = "; ".join(f"{key} ({reason})" for key, reason in self.without_effect.items())
            self.warn(f"{self.origin} keys with no effect in zpp_compile, ignored: {listed}.")
        for message in self.warnings:
            # stacklevel 4: the user's line calling Config.from_deepspeed / Config.from_fsdp2.
            warnings.warn(message, UserWarning, stacklevel=4)
        return config


def _note_source(err: Exception, sources: Mapping[str, str]) -> None:
    """Add to Config's own message which foreign key set the field it complains about."""
    for field, source in sources.items():
        if re.search(rf"\bConfig\.{field}\b", str(err)):
            _add_note(err, f"Config.{field} was set from {source}.")
            return


def _add_note(err: Exception, note: str) -> None:
    if hasattr(err, "add_note"):  # Python 3.11+; on 3.10 the message stays as it is
        err.add_note(note)


# --- DeepSpeed ----------------------------------------------------------------------------------

_UNSET = object()

_DTYPES_BY_NAME = {  # the names DeepSpeed accepts for communication_data_type / grad_accum_dtype
    **dict.fromkeys(("fp32", "float32", "float", "torch.float32"), torch.float32),
    **dict.fromkeys(("bf16", "bfloat16", "bfloat", "torch.bfloat16"), torch.bfloat16),
    **dict.fromkeys(("fp16", "float16", "half", "torch.float16"), torch.float16),
}

_ZEROPP_FLAGS = {  # boolean DeepSpeed key -> boolean Config field
    "zero_quantized_weights": "quantize_weights",
    "zero_quantized_nontrainable_weights": "quantize_frozen_weights",
    "zero_quantized_gradients": "quantize_gradients",
}

_BUCKETS = {  # DeepSpeed key, in elements -> Config field, in bytes
    "reduce_bucket_size": "reduce_bucket_bytes",
    "allgather_bucket_size": "gather_bucket_bytes",
    "stage3_prefetch_bucket_size": "prefetch_bytes",
}

_OFFLOAD_SECTIONS = ("offload_param", "offload_optimizer")
_DEPRECATED_OFFLOAD_FLAGS = ("cpu_offload", "cpu_offload_param")  # DeepSpeed's old spellings

_ZERO_KEYS_READ = frozenset(
    {
        "stage",
        "zero_hpz_partition_size",
        "zeropp_loco_param",
        *_ZEROPP_FLAGS,
        *_BUCKETS,
        "stage3_param_persistence_threshold",
        *_OFFLOAD_SECTIONS,
        *_DEPRECATED_OFFLOAD_FLAGS,
    }
)

# DeepSpeed accepts these stage-3 keys with or without their "stage3_" prefix.
_STAGE3_PREFIXED = (
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "model_persistence_threshold",
    "max_live_parameters",
    "max_reuse_distance",
    "gather_16bit_weights_on_model_save",
    "module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
)

_STAGE_1_2_ONLY = "a DeepSpeed stage 1/2 option"
_NO_TOTAL_CAP = (
    "no cap on the kept-whole parameters' total: keep_whole_numel (from stage3_param_persistence_threshold) "
    "alone decides, or plan='auto' within its memory budget"
)
_FULL_STATE_DICT = "zpp_compile.full_state_dict(model) gathers the full weights, save_checkpoint saves them sharded"
_MICS = "zpp_compile shards over the whole world (hpz_size keeps a node-local copy for backward)"

_ZERO_KEYS_WITHOUT_EFFECT = {
    "overlap_comm": "the compiled schedule overlaps collectives with compute; prefetch_limit=0 turns that off",
    "contiguous_gradients": "each shard's gradient is one contiguous tensor already",
    "reduce_scatter": "gradients are always reduce-scattered, by all-to-alls under qgZ",
    "allgather_partitions": _STAGE_1_2_ONLY,
    "use_multi_rank_bucket_allreduce": _STAGE_1_2_ONLY,
    "ignore_unused_parameters": _STAGE_1_2_ONLY,
    "legacy_stage1": _STAGE_1_2_ONLY,
    "round_robin_gradients": _STAGE_1_2_ONLY,
    "sub_group_size": "the optimizer steps on each shard as it is; there are no sub-groups",
    "stage3_max_live_parameters": "a compiled graph frees each gathered weight after its last use; "
    "prefetch_bytes bounds what is gathered ahead",
    "stage3_max_reuse_distance": "the forward's last weights outside the repeated blocks stay gathered into "
    "the backward (keep_last_weights_gathered, on by default); save_gathered_weights=True keeps them all",
    "stage3_model_persistence_threshold": _NO_TOTAL_CAP,
    "stage3_gather_16bit_weights_on_model_save": _FULL_STATE_DICT,
    "stage3_gather_fp16_weights_on_model_save": _FULL_STATE_DICT,
    "stage3_module_granularity_threshold": "gathers are planned per compiled graph, not per module",
    "stage3_use_all_reduce_for_fetch_params": "weights are gathered by all-gathers",
    "memory_efficient_linear": "no module is replaced; the backward re-gathers weights instead of saving them",
    "override_module_apply": "zpp_compile overrides no module method",
    "load_from_fp32_weights": "checkpoints hold the shards themselves (the fp32 masters under mixed precision)",
    "elastic_checkpoint": "checkpoints load at any world size already",
    "pipeline_loading_checkpoint": "pipeline parallelism is not part of zpp_compile",
    "mics_shard_size": _MICS,
    "mics_hierarchical_params_gather": _MICS,
    "cpu_offload_use_pin_memory": "zpp_compile does not offload",
}

_MIXED_PRECISION_SECTIONS = ("bf16", "bfloat16", "fp16")  # "bfloat16": DeepSpeed's older name for bf16

_TOP_LEVEL_KEYS_READ = frozenset(
    {"zero_optimization", *_MIXED_PRECISION_SECTIONS, "communication_data_type", "data_types", "gradient_clipping"}
)

_TRAINING_LOOP_KEYS = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "optimizer",
        "scheduler",
        "steps_per_print",
        "wall_clock_breakdown",
        "memory_breakdown",
        "dump_state",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "dataloader_drop_last",
        "flops_profiler",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "comms_logger",
        "timers",
        "checkpoint",
        "elasticity",
        "autotuning",
        "data_efficiency",
        "curriculum_learning",
    }
)

_AVERAGED_ONCE = "gradients are summed, then averaged once"

_TOP_LEVEL_KEYS_WITHOUT_EFFECT = {
    "prescale_gradients": _AVERAGED_ONCE,
    "gradient_predivide_factor": _AVERAGED_ONCE,
    "amp": "Apex AMP: use param_dtype, or torch.autocast in your loop",
    "torch_autocast": "use param_dtype, or torch.autocast around the forward in your loop",
    "compile": 'zpp_compile is a torch.compile backend itself: torch.compile(model, backend="zeropp")',
    "activation_checkpointing": "use torch.utils.checkpoint inside the model; the compiled backward "
    "re-gathers its weights",
    "sparse_gradients": "every gradient is reduce-scattered dense",
    "seq_parallel_communication_data_type": "sequence parallelism is not part of zpp_compile",
}


def config_from_deepspeed(ds_config: DeepSpeedConfig, **overrides: Any) -> Config:
    """The Config closest to a DeepSpeed ZeRO-3 / ZeRO++ config (a dict, or a JSON file's path).

    Keyword arguments are Config fields applied last, over what the DeepSpeed config says.
    """
    ds = _load_deepspeed_config(ds_config)
    zero = _zero_section(ds)
    _require_stage_3(zero)
    _refuse_offload(zero)
    translation = _Translation("DeepSpeed")
    _read_param_dtype(ds, translation, overridden="param_dtype" in overrides)
    _read_reduce_dtype(ds, translation)
    _read_zeropp(zero, translation)
    param_dtype = overrides.get("param_dtype", translation.fields.get("param_dtype"))
    _read_buckets(zero, _element_size(param_dtype), translation)
    _read_persistence_threshold(zero, translation)
    _read_gradient_clipping(ds, translation)
    _warn_about_keys_not_read(ds, zero, translation)
    return translation.build(overrides)


def _load_deepspeed_config(source: DeepSpeedConfig) -> Mapping[str, Any]:
    loaded = _read_json(source) if isinstance(source, (str, os.PathLike)) else source
    if not isinstance(loaded, Mapping):
        raise TypeError(
            f"A DeepSpeed config is a dict or the path of a JSON file holding one, got {type(loaded).__name__}."
        )
    return loaded


def _read_json(path: Union[str, os.PathLike[str]]) -> Any:
    with open(path, encoding="utf-8") as file:
        try:
            return json.load(file)
        except json.JSONDecodeError as err:
            _add_note(err, f"in the DeepSpeed config {os.fspath(path)}")
            raise


def _section(config: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any]:
    value = config.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"DeepSpeed key {path} must be a JSON object, got {value!r}.")
    return value


def _zero_section(ds: Mapping[str, Any]) -> dict[str, Any]:
    """ds["zero_optimization"] with every stage-3 key spelled "stage3_...": DeepSpeed takes both
    spellings (e.g. prefetch_bucket_size for stage3_prefetch_bucket_size)."""
    zero = _section(ds, "zero_optimization", "zero_optimization")
    return {f"stage3_{key}" if key in _STAGE3_PREFIXED else key: value for key, value in zero.items()}


def _given(section: Mapping[str, Any], key: str, path: str) -> Any:
    """section[key], or _UNSET when it is absent, null or "auto": zpp_compile's default then."""
    value = section.get(key)
    if isinstance(value, str) and value == "auto":
        # HF Accelerate's "auto" asks its Trainer to fill the value in from the model; no Trainer here.
        log.debug("DeepSpeed %s='auto': keeping zpp_compile's default", path)
        return _UNSET
    return _UNSET if value is None else value


def _require_stage_3(zero: Mapping[str, Any]) -> None:
    stage = zero.get("stage")
    if stage == 3 and not isinstance(stage, bool):
        return
    said = f"={stage!r}" if "stage" in zero else " is not set (DeepSpeed's default: 0, no ZeRO)"
    raise ValueError(
        f'zero_optimization.stage{said}: zpp_compile implements ZeRO-3 only. Set "stage": 3 here '
        "(adding save_gathered_weights=True gives stage 2's traffic: one all-gather and one "
        "reduce-scatter per step), or keep stage 1/2 outside zpp_compile: DDP, or FSDP2 with "
        "reshard_after_forward=False."
    )


def _refuse_offload(zero: Mapping[str, Any]) -> None:
    """Offload moves shards or optimizer state off the device, which zpp_compile cannot do."""
    fix = (
        "zpp_compile keeps shards, gradients and optimizer state on the training device "
        "(more ranks make each rank's shard smaller)."
    )
    for key in _OFFLOAD_SECTIONS:
        device = _section(zero, key, f"zero_optimization.{key}").get("device", "none")
        if device not in (None, "none"):
            raise ValueError(
                f"zero_optimization.{key}.device={device!r}: zpp_compile has no CPU or NVMe offload. "
                f'Remove {key} or set "device": "none"; {fix}'
            )
    for key in _DEPRECATED_OFFLOAD_FLAGS:
        if zero.get(key):
            raise ValueError(f"zero_optimization.{key}=true: zpp_compile has no CPU offload. Remove it; {fix}")


def _read_param_dtype(ds: Mapping[str, Any], translation: _Translation, *, overridden: bool) -> None:
    bf16_key = "bfloat16" if "bfloat16" in ds and "bf16" not in ds else "bf16"
    bf16 = _section(ds, bf16_key, bf16_key)
    fp16 = _section(ds, "fp16", "fp16")
    bf16_on = _enabled(bf16, bf16_key, translation, overridden=overridden)
    fp16_on = _enabled(fp16, "fp16", translation, overridden=overridden)
    if bf16_on and fp16_on:
        raise ValueError(
            f"{bf16_key}.enabled and fp16.enabled are both true: enable one of them (bf16 needs no loss scaling)."
        )
    if bf16_on:
        translation.set("param_dtype", torch.bfloat16, f"{bf16_key}.enabled")
        for key in bf16:
            if key != "enabled":  # the knobs of DeepSpeed's own bf16 optimizer
                translation.ignore(f"{bf16_key}.{key}", "shards, gradients and optimizer state keep the model's dtype")
    if fp16_on:
        translation.set("param_dtype", torch.float16, "fp16.enabled")
        translation.warn(_fp16_loss_scaling_warning(fp16))


def _enabled(section: Mapping[str, Any], name: str, translation: _Translation, *, overridden: bool) -> bool:
    enabled = section.get("enabled", False)
    if isinstance(enabled, str) and enabled == "auto":
        if not overridden:
            translation.warn(
                f'DeepSpeed {name}.enabled="auto" is resolved by the HF Trainer from its own flags, '
                "which zpp_compile cannot see: treated as false (no mixed precision). Pass "
                "param_dtype=torch.bfloat16 (or torch.float16) to from_deepspeed to turn it on."
            )
        return False
    if not isinstance(enabled, bool):
        raise TypeError(f'DeepSpeed {name}.enabled must be true, false or "auto", got {enabled!r}.')
    return enabled


def _fp16_loss_scaling_warning(fp16: Mapping[str, Any]) -> str:
    """DeepSpeed scales the loss inside its engine; here the loop does, with torch's GradScaler,
    whose overflow check spans all ranks on a sharded model (dtensor_ops)."""
    keys = [f"fp16.{key}" for key in sorted(fp16) if key != "enabled"] or ["fp16.loss_scale"]
    power, window = fp16.get("initial_scale_power"), fp16.get("loss_scale_window")
    scaler = (  # DeepSpeed's defaults where a value is left out or "auto"
        f"torch.amp.GradScaler(init_scale=2.0**{power if isinstance(power, int) else 16}, "
        f"growth_interval={window if isinstance(window, int) else 1000})"
    )
    static = fp16.get("loss_scale", 0)
    if isinstance(static, (int, float)) and static > 0:
        scaler = f"a static scale: multiply the loss by {static} and divide the gradients by it"
    return (
        "DeepSpeed fp16.enabled=true maps to param_dtype=torch.float16, but zpp_compile has no loss "
        f"scaler of its own: {', '.join(keys)} have no effect. Scale the loss in the training loop with "
        f"{scaler} (its overflow check spans all ranks on a sharded model), or prefer bf16, which needs "
        "no loss scaling."
    )


def _read_reduce_dtype(ds: Mapping[str, Any], translation: _Translation) -> None:
    """communication_data_type is the dtype gradients are averaged in: reduce_dtype itself.

    data_types.grad_accum_dtype is DeepSpeed's dtype for holding gradients; here they are held in
    reduce_dtype until they are cast to the shard's dtype, so it maps there when nothing else does.
    """
    communication = _given(ds, "communication_data_type", "communication_data_type")
    accumulation = _given(_section(ds, "data_types", "data_types"), "grad_accum_dtype", "data_types.grad_accum_dtype")
    if communication is not _UNSET:
        reduce_dtype = _dtype(communication, "communication_data_type")
        translation.set("reduce_dtype", reduce_dtype, f"communication_data_type={communication!r}")
        if accumulation is not _UNSET and _dtype(accumulation, "data_types.grad_accum_dtype") != reduce_dtype:
            translation.warn(
                f"DeepSpeed data_types.grad_accum_dtype={accumulation!r} has no counterpart beside "
                f"communication_data_type={communication!r} (reduce_dtype): gradients are averaged in "
                "reduce_dtype, then accumulated in the shard's own dtype (the fp32 masters)."
            )
    elif accumulation is not _UNSET:
        translation.set(
            "reduce_dtype",
            _dtype(accumulation, "data_types.grad_accum_dtype"),
            f"data_types.grad_accum_dtype={accumulation!r}",
        )


def _dtype(name: Any, path: str) -> torch.dtype:
    dtype = _DTYPES_BY_NAME.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f'DeepSpeed {path}={name!r} is not a dtype name; use "bf16", "fp16" or "fp32".')
    return dtype


def _read_zeropp(zero: Mapping[str, Any], translation: _Translation) -> None:
    for key, field in _ZEROPP_FLAGS.items():
        value = _given(zero, key, f"zero_optimization.{key}")
        if value is not _UNSET:
            translation.set(field, value, f"zero_optimization.{key}={value!r}")
    hpz = _given(zero, "zero_hpz_partition_size", "zero_optimization.zero_hpz_partition_size")
    if hpz is not _UNSET:
        hpz_off = type(hpz) is int and hpz in (0, 1)  # DeepSpeed turns hpZ on above 1
        translation.set("hpz_size", None if hpz_off else hpz, f"zero_optimization.zero_hpz_partition_size={hpz!r}")
    _read_loco(zero, translation)


def _read_loco(zero: Mapping[str, Any], translation: _Translation) -> None:
    """LoCo-Zero++ is qgZ with error feedback: err_beta is qgz_error_beta; nothing resets the error."""
    loco = _given(zero, "zeropp_loco_param", "zero_optimization.zeropp_loco_param")
    if loco is _UNSET:
        return
    if not isinstance(loco, Mapping):
        raise TypeError(
            f'DeepSpeed zero_optimization.zeropp_loco_param must be a JSON object like {{"err_beta": 0.8, '
            f'"reset_T": 1024}}, got {loco!r}.'
        )
    if translation.fields.get("quantize_gradients") is not True:
        translation.warn(
            "DeepSpeed zero_optimization.zeropp_loco_param has no effect without "
            "zero_optimization.zero_quantized_gradients=true (as in DeepSpeed): ignored."
        )
        return
    translation.set("qgz_error_feedback", True, "zero_optimization.zeropp_loco_param")
    if "err_beta" in loco:
        translation.set("qgz_error_beta", loco["err_beta"], "zero_optimization.zeropp_loco_param.err_beta")
    others = {key: value for key, value in loco.items() if key != "err_beta"}
    if others:
        settings = ", ".join(f"{key}={value!r}" for key, value in others.items())
        translation.warn(
            f"DeepSpeed zero_optimization.zeropp_loco_param's {settings} have no counterpart: zpp_compile "
            "never resets the stored int4 error (reset_T); err_beta maps to qgz_error_beta."
        )


def _element_size(param_dtype: Any) -> int:
    """Bytes per element of the training dtype: what turns DeepSpeed's element counts into bytes."""
    return param_dtype.itemsize if isinstance(param_dtype, torch.dtype) else torch.float32.itemsize


def _read_buckets(zero: Mapping[str, Any], element_size: int, translation: _Translation) -> None:
    for key, field in _BUCKETS.items():
        path = f"zero_optimization.{key}"
        elements = _given(zero, key, path)
        if elements is not _UNSET:
            byte_count = _whole_number(elements, path) * element_size
            translation.set(field, byte_count, f"{path}={elements!r} elements x {element_size} bytes")


def _read_persistence_threshold(zero: Mapping[str, Any], translation: _Translation) -> None:
    """DeepSpeed leaves parameters of at most this many elements unpartitioned: keep_whole_numel."""
    path = "zero_optimization.stage3_param_persistence_threshold"
    elements = _given(zero, "stage3_param_persistence_threshold", path)
    if elements is not _UNSET:
        translation.set("keep_whole_numel", _whole_number(elements, path), f"{path}={elements!r}")


def _whole_number(value: Any, path: str) -> int:
    """DeepSpeed's element counts: ints, or floats like 5e8 with no fractional part."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f'DeepSpeed {path}={value!r} must be a whole number of elements (5e8 is fine) or "auto".')
    return int(value)


def _read_gradient_clipping(ds: Mapping[str, Any], translation: _Translation) -> None:
    """Config has no clipping field: clipping is one line in the training loop."""
    max_norm = ds.get("gradient_clipping")
    if max_norm is None or max_norm == 0:  # DeepSpeed's 0: no clipping
        return
    if max_norm == "auto":
        said, argument = ' ("auto": the HF Trainer fills in its max_grad_norm)', "max_grad_norm"
    else:
        said, argument = "", repr(max_norm)
    translation.warn(
        f"DeepSpeed gradient_clipping={max_norm!r}{said} has no Config field: clip in your training "
        f"loop, between backward() and opt.step(), with torch.nn.utils.clip_grad_norm_(model.parameters(), "
        f"{argument}), which works on zpp_compile's sharded parameters and clips by the global norm."
    )


def _warn_about_keys_not_read(ds: Mapping[str, Any], zero: Mapping[str, Any], translation: _Translation) -> None:
    """Keys without effect here get their reason; training-loop and unknown keys one warning each."""
    for key in zero:
        if key in _ZERO_KEYS_WITHOUT_EFFECT:
            translation.ignore(f"zero_optimization.{key}", _ZERO_KEYS_WITHOUT_EFFECT[key])
    for key in ds:
        if key in _TOP_LEVEL_KEYS_WITHOUT_EFFECT:
            translation.ignore(key, _TOP_LEVEL_KEYS_WITHOUT_EFFECT[key])
    loop_keys = [key for key in ds if key in _TRAINING_LOOP_KEYS]
    if loop_keys:
        translation.warn(
            f"DeepSpeed keys {', '.join(loop_keys)} belong to your training loop (batch sizes, "
            "accumulation, optimizer, scheduler, logging), not to Config: ignored."
        )
    known_top_level = _TOP_LEVEL_KEYS_READ | _TRAINING_LOOP_KEYS | _TOP_LEVEL_KEYS_WITHOUT_EFFECT.keys()
    known_zero = _ZERO_KEYS_READ | _ZERO_KEYS_WITHOUT_EFFECT.keys()
    unknown = [key for key in ds if key not in known_top_level]
    unknown += [f"zero_optimization.{key}" for key in zero if key not in known_zero]
    unknown += [f"data_types.{key}" for key in _section(ds, "data_types", "data_types") if key != "grad_accum_dtype"]
    if unknown:
        translation.warn(
            f"Unknown DeepSpeed keys, ignored: {', '.join(unknown)}. Check their spelling against "
            "DeepSpeed's config reference; docs/migration.md lists the keys zpp_compile reads."
        )


# --- FSDP2 --------------------------------------------------------------------------------------


def config_from_fsdp2(
    mp_policy: Optional[MixedPrecisionPolicy] = None,
    reshard_after_forward: ReshardAfterForward = True,
    **overrides: Any,
) -> Config:
    """The Config matching FSDP2's `fully_shard(model, mp_policy=..., reshard_after_forward=...)`.

    reshard_after_forward=K (an int) keeps 1/K of each weight per rank between forward and
    backward, re-gathered over K ranks: hpZ, hpz_size=K. K must divide the ranks per node (shard()
    checks it). Keyword arguments are Config fields applied last.
    """
    translation = _Translation("FSDP2")
    if mp_policy is not None:
        _read_mixed_precision_policy(_require_policy(mp_policy), translation)
    _read_reshard_after_forward(reshard_after_forward, translation)
    return translation.build(overrides)


def _require_policy(mp_policy: Any) -> MixedPrecisionPolicy:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            "mp_policy must be FSDP2's torch.distributed.fsdp.MixedPrecisionPolicy, got "
            f"{type(mp_policy).__name__}; for plain dtypes use Config(param_dtype=..., reduce_dtype=...)."
        )
    return mp_policy


def _read_mixed_precision_policy(mp_policy: MixedPrecisionPolicy, translation: _Translation) -> None:
    for field in ("param_dtype", "reduce_dtype"):
        dtype = getattr(mp_policy, field)
        if dtype is not None:
            translation.set(field, dtype, f"mp_policy.{field}")
    if mp_policy.output_dtype is not None:
        translation.warn(
            f"FSDP2 mp_policy.output_dtype={mp_policy.output_dtype} has no counterpart: the model's "
            "outputs keep the dtype they are computed in (param_dtype); cast them yourself."
        )
    if not mp_policy.cast_forward_inputs and mp_policy.param_dtype is not None:
        translation.warn(
            "FSDP2 mp_policy.cast_forward_inputs=False has no counterpart: zpp_compile always casts "
            "the root module's floating-point inputs to param_dtype."
        )


def _read_reshard_after_forward(reshard: ReshardAfterForward, translation: _Translation) -> None:
    source = f"reshard_after_forward={reshard!r}"
    if reshard is None or reshard is True:  # None: FSDP2 keeps only the root's weights; ZeRO-3 here
        return
    if reshard is False:
        translation.set("save_gathered_weights", True, source)
    elif isinstance(reshard, int) and reshard == 1:
        translation.warn(
            "FSDP2 reshard_after_forward=1 (int) reshards to 1 rank, which keeps whole weights like "
            "False: mapped to save_gathered_weights=True. Pass True for ZeRO-3."
        )
        translation.set("save_gathered_weights", True, source)
    elif isinstance(reshard, int) and reshard > 1:
        translation.set("hpz_size", reshard, source)
    elif isinstance(reshard, int):
        raise ValueError(
            f"{source}: an int is the number of ranks to reshard to after forward (hpz_size here), "
            "at least 2 and dividing the ranks per node; pass True for plain ZeRO-3."
        )
    else:
        raise TypeError(f"reshard_after_forward must be True, False, None or an int, got {reshard!r}.")
