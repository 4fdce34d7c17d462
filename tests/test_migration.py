"""Config.from_deepspeed and Config.from_fsdp2: every key maps, warns naming it, or raises naming it."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from zpp_compile import Config

DEFAULT = Config()


def zero3(**zero_optimization) -> dict:
    """The smallest DeepSpeed config from_deepspeed accepts, plus these zero_optimization keys."""
    return {"zero_optimization": {"stage": 3, **zero_optimization}}


def from_deepspeed(ds_config, **overrides) -> tuple[Config, list[str]]:
    """The Config and the messages of every UserWarning it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = Config.from_deepspeed(ds_config, **overrides)
    return config, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def warned_about(messages: list[str], *words: str) -> bool:
    return any(all(word in message for word in words) for message in messages)


# The ZeRO++ tutorial's zero_optimization block, in a config as HF Accelerate writes it ("auto"s).
HF_ZEROPP_CONFIG = {
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": 1e7,
        "reduce_scatter": True,
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": 8,
        "zero_quantized_gradients": True,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "offload_optimizer": {"device": "none"},
        "offload_param": {"device": "none"},
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def test_hf_zeropp_config_maps_field_by_field():
    config, messages = from_deepspeed(HF_ZEROPP_CONFIG)
    expected = Config(
        quantize_weights=True,
        hpz_size=8,
        quantize_gradients=True,
        reduce_bucket_bytes=10**7 * 2,  # 1e7 bf16 elements
        param_dtype=torch.bfloat16,
    )
    assert config == expected  # prefetch_bytes stays the default: "auto"
    for key in (
        "overlap_comm",
        "contiguous_gradients",
        "reduce_scatter",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "stage3_gather_16bit_weights_on_model_save",
    ):
        assert warned_about(messages, "no effect", f"zero_optimization.{key} ("), key
    assert warned_about(messages, "training loop", "train_batch_size", "optimizer", "scheduler", "steps_per_print")
    assert warned_about(messages, "gradient_clipping='auto'", "clip_grad_norm_")
    assert not warned_about(messages, "offload"), "device 'none' is what zpp_compile does: nothing to say"
    assert not warned_about(messages, "Unknown")


@pytest.mark.parametrize(
    "precision, element_size",
    [
        ({"bf16": {"enabled": True}}, 2),
        ({"bfloat16": {"enabled": True}}, 2),  # DeepSpeed's older name for the bf16 section
        ({}, 4),
        ({"bf16": {"enabled": False}}, 4),
    ],
)
def test_bucket_elements_become_bytes_of_the_training_dtype(precision, element_size):
    ds = {**zero3(reduce_bucket_size=1000, allgather_bucket_size=2000, stage3_prefetch_bucket_size=5e8), **precision}
    config, _ = from_deepspeed(ds)
    assert config.reduce_bucket_bytes == 1000 * element_size
    assert config.gather_bucket_bytes == 2000 * element_size
    assert config.prefetch_bytes == 500_000_000 * element_size
    assert isinstance(config.prefetch_bytes, int)


def test_fp16_buckets_count_two_bytes():
    config, _ = from_deepspeed({**zero3(allgather_bucket_size=100), "fp16": {"enabled": True}})
    assert config.gather_bucket_bytes == 200


def test_prefixless_stage3_keys_are_read_like_deepspeed_reads_them():
    config, messages = from_deepspeed(zero3(prefetch_bucket_size=100, max_live_parameters=10))
    assert config.prefetch_bytes == 400
    assert warned_about(messages, "zero_optimization.stage3_max_live_parameters (")
    assert not warned_about(messages, "Unknown")


def test_auto_keeps_zpp_compile_defaults_silently():
    ds = zero3(
        reduce_bucket_size="auto",
        allgather_bucket_size="auto",
        stage3_prefetch_bucket_size="auto",
        zero_hpz_partition_size="auto",
    )
    config, messages = from_deepspeed(ds)
    assert config == DEFAULT
    assert messages == []


@pytest.mark.parametrize("value", ["big", 1.5, True, [1]])
def test_bucket_size_that_is_no_element_count_names_the_key(value):
    with pytest.raises(ValueError, match=r"zero_optimization\.reduce_bucket_size=.* must be a whole number"):
        Config.from_deepspeed(zero3(reduce_bucket_size=value))


@pytest.mark.parametrize("zero_optimization", [{"stage": 1}, {"stage": 2}, {"stage": 0}, {}])
def test_stages_other_than_3_are_refused(zero_optimization):
    with pytest.raises(ValueError, match=r"zero_optimization\.stage.*ZeRO-3 only.*reshard_after_forward=False"):
        Config.from_deepspeed({"zero_optimization": zero_optimization})


def test_missing_zero_section_is_stage_0():
    with pytest.raises(ValueError, match=r"zero_optimization\.stage is not set"):
        Config.from_deepspeed({"bf16": {"enabled": True}})


@pytest.mark.parametrize(
    "zero_optimization, key",
    [
        ({"offload_param": {"device": "cpu", "pin_memory": True}}, r"offload_param\.device='cpu'"),
        ({"offload_optimizer": {"device": "nvme"}}, r"offload_optimizer\.device='nvme'"),
        ({"offload_optimizer": {"pin_memory": True, "device": "cpu"}}, r"offload_optimizer\.device='cpu'"),
        ({"cpu_offload": True}, r"cpu_offload=true"),
        ({"cpu_offload_param": True}, r"cpu_offload_param=true"),
    ],
)
def test_offload_is_refused_naming_the_key(zero_optimization, key):
    with pytest.raises(ValueError, match=rf"zero_optimization\.{key}: zpp_compile has no CPU"):
        Config.from_deepspeed(zero3(**zero_optimization))


@pytest.mark.parametrize("hpz, expected", [(0, None), (1, None), (2, 2), (16, 16)])
def test_hpz_partition_size(hpz, expected):
    config, _ = from_deepspeed(zero3(zero_hpz_partition_size=hpz))
    assert config.hpz_size == expected


def test_quantized_nontrainable_weights_map_to_frozen_int8():
    config, _ = from_deepspeed(zero3(zero_quantized_nontrainable_weights=True))
    assert config == Config(quantize_frozen_weights=True)


def test_loco_turns_on_error_feedback_maps_err_beta_and_names_what_has_no_counterpart():
    ds = zero3(zero_quantized_gradients=True, zeropp_loco_param={"err_beta": 0.5, "reset_T": 1024})
    with pytest.warns(UserWarning, match=r"zeropp_loco_param's reset_T=1024 have no counterpart"):
        config = Config.from_deepspeed(ds)
    assert config.quantize_gradients and config.qgz_error_feedback and config.qgz_error_beta == 0.5


def test_loco_with_err_beta_alone_maps_silently_and_a_bad_one_is_refused_by_name():
    ds = zero3(zero_quantized_gradients=True, zeropp_loco_param={"err_beta": 0.9})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Config.from_deepspeed(ds).qgz_error_beta == 0.9
    with pytest.raises(ValueError, match=r"qgz_error_beta=1\.5 must be a number in \[0, 1\)"):
        Config.from_deepspeed(zero3(zero_quantized_gradients=True, zeropp_loco_param={"err_beta": 1.5}))


def test_loco_without_qgz_is_ignored_as_deepspeed_ignores_it():
    with pytest.warns(UserWarning, match=r"zeropp_loco_param has no effect without .*zero_quantized_gradients"):
        config = Config.from_deepspeed(zero3(zeropp_loco_param={"err_beta": 0.8}))
    assert not config.qgz_error_feedback


def test_fp16_maps_with_a_warning_naming_the_loss_scaling_keys_and_the_grad_scaler_to_use():
    ds = {**zero3(), "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500}}
    with pytest.warns(
        UserWarning, match=r"no loss scaler of its own: fp16\.initial_scale_power, fp16\.loss_scale,"
    ) as w:
        config = Config.from_deepspeed(ds)
    assert config.param_dtype == torch.float16 and config.reduce_dtype is None
    assert any("torch.amp.GradScaler(init_scale=2.0**12, growth_interval=500)" in str(x.message) for x in w)
    static = {**zero3(), "fp16": {"enabled": True, "loss_scale": 128}}
    with pytest.warns(UserWarning, match=r"a static scale: multiply the loss by 128"):
        Config.from_deepspeed(static)


def test_bf16_and_fp16_both_on_is_refused():
    with pytest.raises(ValueError, match=r"bf16\.enabled and fp16\.enabled are both true"):
        Config.from_deepspeed({**zero3(), "bf16": {"enabled": True}, "fp16": {"enabled": True}})


def test_bf16_optimizer_knobs_have_no_effect():
    ds = {**zero3(), "bf16": {"enabled": True, "immediate_grad_update": True}}
    with pytest.warns(UserWarning, match=r"no effect.*bf16\.immediate_grad_update"):
        Config.from_deepspeed(ds)


def test_enabled_auto_is_off_and_says_how_to_turn_it_on():
    ds = {**zero3(reduce_bucket_size=100), "bf16": {"enabled": "auto"}}
    with pytest.warns(UserWarning, match=r'bf16\.enabled="auto".*treated as false.*param_dtype=torch\.bfloat16'):
        config = Config.from_deepspeed(ds)
    assert config.param_dtype is None and config.reduce_bucket_bytes == 400


def test_param_dtype_override_settles_auto_and_sizes_the_buckets():
    ds = {**zero3(reduce_bucket_size=100), "bf16": {"enabled": "auto"}}
    config, messages = from_deepspeed(ds, param_dtype=torch.bfloat16)
    assert config.param_dtype == torch.bfloat16 and config.reduce_bucket_bytes == 200
    assert messages == []


@pytest.mark.parametrize(
    "extra, reduce_dtype",
    [
        ({"data_types": {"grad_accum_dtype": "fp32"}}, torch.float32),
        ({"communication_data_type": "bf16"}, torch.bfloat16),
        ({"communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"}}, torch.float32),
    ],
)
def test_reduce_dtype(extra, reduce_dtype):
    config, messages = from_deepspeed({**zero3(), "bf16": {"enabled": True}, **extra})
    assert config.reduce_dtype == reduce_dtype
    assert messages == []


def test_communication_dtype_wins_over_grad_accum_dtype():
    ds = {**zero3(), "communication_data_type": "bf16", "data_types": {"grad_accum_dtype": "fp32"}}
    with pytest.warns(UserWarning, match=r"data_types\.grad_accum_dtype='fp32' has no counterpart beside"):
        config = Config.from_deepspeed(ds)
    assert config.reduce_dtype == torch.bfloat16


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"data_types": {"grad_accum_dtype": "int8"}}, r"data_types\.grad_accum_dtype='int8'"),
        ({"communication_data_type": "fp8"}, r"communication_data_type='fp8'"),
    ],
)
def test_unknown_dtype_name_names_the_key(extra, key):
    with pytest.raises(ValueError, match=rf"{key} is not a dtype name"):
        Config.from_deepspeed({**zero3(), **extra})


def test_gradient_clipping_says_how_to_clip_in_the_loop():
    with pytest.warns(UserWarning, match=r"gradient_clipping=1\.0 .*clip_grad_norm_\(model\.parameters\(\), 1\.0\)"):
        Config.from_deepspeed({**zero3(), "gradient_clipping": 1.0})


def test_gradient_clipping_zero_means_off_and_says_nothing():
    _, messages = from_deepspeed({**zero3(), "gradient_clipping": 0})
    assert messages == []


def test_training_loop_keys_get_one_warning_listing_them():
    ds = {**zero3(), "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}
    _, messages = from_deepspeed(ds)
    assert len(messages) == 1
    assert warned_about(
        messages, "train_micro_batch_size_per_gpu, gradient_accumulation_steps belong to your training loop"
    )


def test_unknown_keys_are_named():
    ds = {**zero3(stage3_prefetch_bucket_sise=10), "zero_optimisation": {}, "data_types": {"grad_acum_dtype": "fp32"}}
    with pytest.warns(
        UserWarning,
        match=r"Unknown DeepSpeed keys.*zero_optimisation, "
        r"zero_optimization\.stage3_prefetch_bucket_sise, data_types\.grad_acum_dtype",
    ):
        Config.from_deepspeed(ds)


def test_top_level_keys_without_effect_give_their_reason():
    with pytest.warns(UserWarning, match=r"no effect.*compile \(zpp_compile is a torch\.compile backend itself"):
        Config.from_deepspeed({**zero3(), "compile": {"deepcompile": True}})


# Every zero_optimization key of DeepSpeed's DeepSpeedZeroConfig, with a value it accepts.
DEEPSPEED_ZERO_KEYS = {
    "contiguous_gradients": True,
    "reduce_scatter": True,
    "reduce_bucket_size": 5e8,
    "use_multi_rank_bucket_allreduce": True,
    "allgather_partitions": True,
    "allgather_bucket_size": 5e8,
    "overlap_comm": True,
    "load_from_fp32_weights": True,
    "elastic_checkpoint": False,
    "offload_param": {"device": "none"},
    "offload_optimizer": {"device": "none"},
    "sub_group_size": 1e9,
    "cpu_offload_param": False,
    "cpu_offload_use_pin_memory": False,
    "cpu_offload": False,
    "stage3_prefetch_bucket_size": 5e7,
    "stage3_param_persistence_threshold": 1e5,
    "stage3_model_persistence_threshold": 1e9,
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": False,
    "stage3_module_granularity_threshold": 0,
    "stage3_use_all_reduce_for_fetch_params": False,
    "stage3_gather_fp16_weights_on_model_save": False,
    "ignore_unused_parameters": True,
    "legacy_stage1": False,
    "round_robin_gradients": False,
    "zero_hpz_partition_size": 1,
    "zero_quantized_weights": False,
    "zero_quantized_nontrainable_weights": False,
    "zero_quantized_gradients": False,
    "zeropp_loco_param": None,
    "mics_shard_size": -1,
    "mics_hierarchical_params_gather": False,
    "memory_efficient_linear": True,
    "pipeline_loading_checkpoint": False,
    "override_module_apply": True,
}


@pytest.mark.parametrize("key", DEEPSPEED_ZERO_KEYS)
def test_every_deepspeed_zero_key_is_known(key):
    _, messages = from_deepspeed(zero3(**{key: DEEPSPEED_ZERO_KEYS[key]}))
    assert not warned_about(messages, "Unknown")


def test_param_persistence_threshold_keeps_small_parameters_whole():
    config, messages = from_deepspeed(zero3(stage3_param_persistence_threshold=1e5))
    assert config.keep_whole_numel == 100_000
    assert not warned_about(messages, "param_persistence_threshold")
    assert from_deepspeed(zero3(param_persistence_threshold="auto"))[0].keep_whole_numel == 0  # our default
    _, messages = from_deepspeed(zero3(stage3_model_persistence_threshold=1e9))
    assert warned_about(messages, "no effect", "stage3_model_persistence_threshold (no cap")


def test_overrides_apply_last():
    config, _ = from_deepspeed(HF_ZEROPP_CONFIG, hpz_size=4, ranks_per_node=4, reduce_bucket_bytes=123)
    assert (config.hpz_size, config.ranks_per_node, config.reduce_bucket_bytes) == (4, 4, 123)
    assert config.quantize_weights


@pytest.mark.parametrize(
    "zero_optimization, error, message, key",
    [
        (
            {"zero_hpz_partition_size": -2},
            ValueError,
            r"Config\.hpz_size=-2 is out of range",
            "zero_hpz_partition_size",
        ),
        (
            {"zero_quantized_weights": "yes"},
            TypeError,
            r"Config\.quantize_weights must be True or False",
            "zero_quantized_weights",
        ),
        (
            {"reduce_bucket_size": -1},
            ValueError,
            r"Config\.reduce_bucket_bytes=-4 is out of range",
            "reduce_bucket_size",
        ),
    ],
)
def test_config_validation_surfaces_with_the_deepspeed_key_noted(zero_optimization, error, message, key):
    with pytest.raises(error, match=message) as raised:
        Config.from_deepspeed(zero3(**zero_optimization))
    if sys.version_info >= (3, 11):  # exception notes
        assert any(f"zero_optimization.{key}=" in note for note in raised.value.__notes__)


@pytest.mark.parametrize("as_path", [str, lambda path: path])
def test_json_file_path(tmp_path, as_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(HF_ZEROPP_CONFIG))
    from_file, _ = from_deepspeed(as_path(path))
    from_dict, _ = from_deepspeed(HF_ZEROPP_CONFIG)
    assert from_file == from_dict and from_file.hpz_size == 8


def test_json_file_that_is_no_object_is_refused(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text("[1, 2]")
    with pytest.raises(TypeError, match="a dict or the path of a JSON file holding one, got list"):
        Config.from_deepspeed(path)


# --- FSDP2 ----------------------------------------------------------------------------------


def from_fsdp2(*args, **kwargs) -> tuple[Config, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = Config.from_fsdp2(*args, **kwargs)
    return config, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_fsdp2_defaults_are_zero3():
    config, messages = from_fsdp2()
    assert config == DEFAULT and messages == []


def test_fsdp2_mixed_precision_policy_dtypes():
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    config, messages = from_fsdp2(policy)
    assert (config.param_dtype, config.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert messages == []


def test_fsdp2_output_dtype_has_no_counterpart():
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    with pytest.warns(UserWarning, match=r"mp_policy\.output_dtype=torch\.float32 has no counterpart"):
        config = Config.from_fsdp2(policy)
    assert config.param_dtype == torch.bfloat16


def test_fsdp2_uncast_inputs_have_no_counterpart():
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)
    with pytest.warns(UserWarning, match=r"mp_policy\.cast_forward_inputs=False has no counterpart"):
        Config.from_fsdp2(policy)


def test_fsdp2_uncast_inputs_without_param_dtype_match_exactly():
    _, messages = from_fsdp2(MixedPrecisionPolicy(cast_forward_inputs=False))
    assert messages == []


@pytest.mark.parametrize(
    "reshard, field, value",
    [(True, "hpz_size", None), (None, "hpz_size", None), (False, "save_gathered_weights", True), (4, "hpz_size", 4)],
)
def test_fsdp2_reshard_after_forward(reshard, field, value):
    config, messages = from_fsdp2(reshard_after_forward=reshard)
    assert getattr(config, field) == value
    assert config == Config(**{field: value}) and messages == []


def test_fsdp2_reshard_to_one_rank_keeps_whole_weights():
    with pytest.warns(UserWarning, match=r"reshard_after_forward=1 \(int\)"):
        config = Config.from_fsdp2(reshard_after_forward=1)
    assert config.save_gathered_weights and config.hpz_size is None


@pytest.mark.parametrize(
    "reshard, error, message",
    [
        (0, ValueError, r"reshard_after_forward=0: an int is the number of ranks"),
        ("yes", TypeError, r"reshard_after_forward must be True, False, None or an int, got 'yes'"),
    ],
)
def test_fsdp2_bad_reshard_after_forward(reshard, error, message):
    with pytest.raises(error, match=message):
        Config.from_fsdp2(reshard_after_forward=reshard)


def test_fsdp2_overrides_apply_last():
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    config, _ = from_fsdp2(policy, 2, param_dtype=torch.float16, ranks_per_node=2)
    assert (config.param_dtype, config.hpz_size, config.ranks_per_node) == (torch.float16, 2, 2)


def test_fsdp2_wants_a_policy_not_a_dtype():
    with pytest.raises(TypeError, match=r"mp_policy must be FSDP2's .*MixedPrecisionPolicy, got dtype"):
        Config.from_fsdp2(torch.bfloat16)


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype"])
def test_policy_passed_as_a_dtype_points_to_from_fsdp2(field):
    with pytest.raises(TypeError, match=rf"Config\.{field} takes a torch dtype, got FSDP2's .*Config\.from_fsdp2"):
        Config(**{field: MixedPrecisionPolicy(param_dtype=torch.bfloat16)})


def test_importing_zpp_compile_does_not_load_the_migration_module():
    code = "import sys, zpp_compile; print('zpp_compile.migration' in sys.modules)"
    repo = pathlib.Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "False"
