"""Models larger than one rank: shard on the meta device, then materialize only this rank's share.

    with torch.device("meta"):
        model = GPT(cfg)                          # no memory: shapes only
    zpp_compile.shard(model, zpp_compile.Config())
    zpp_compile.materialize(model, init=lambda m: m.apply(_init_weights))

materialize() allocates every parameter's chunk (and the buffers) on the training device and runs
the model's initialization on the sharded parameters: each module's reset_parameters() by
default, or your function (torchtitan's init_weights, Hugging Face's init_weights). Random init
draws each parameter in full and keeps this rank's chunk (dtensor_ops.py), so the values equal
those the same initialization gives the unsharded model with the same seed, and a rank never
holds more than its shards plus one unsharded parameter. A parameter or floating-point buffer
that the initialization did not write raises ShardingError naming it (on every rank).
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from .layout import ShardingError, sharded_state, unwrap_compiled
from .peft_models import init_adapters, is_peft_model

Init = Callable[[nn.Module], object]


@torch.no_grad()
def materialize(
    model: nn.Module, device: Optional[Union[str, torch.device]] = None, *, init: Optional[Init] = None
) -> nn.Module:
    """Allocate this rank's chunks of a model sharded on the meta device, and initialize them.

    `device`: where the model trains (default: CPU under gloo, the current CUDA device under
    NCCL). `init(model)`: the initialization, called once on the sharded model (None: each
    module's reset_parameters(), in model.modules() order, as FSDP2's recipe does). It must also
    set buffers computed in __init__ (rotary tables, masks): to_empty leaves them unset. A PEFT
    model's adapters are then initialized as PEFT initializes them (peft_models.py).
    Collective (the check of what was written). Returns `model`.
    """
    model = unwrap_compiled(model)
    state = sharded_state(model)
    device = torch.device(device) if device is not None else torch.device(state.mesh.device_type)
    model.to_empty(device=device)
    tensors = _initializable(model)
    for t in tensors.values():
        _local(t).fill_(float("nan"))  # a sentinel: what stays NaN, nothing wrote
    if init is None:
        for module in model.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
    else:
        init(model)
    if is_peft_model(model):  # after any init, which would treat lora_B as a plain Linear
        init_adapters(model)
    _refuse_unwritten(tensors)
    return model


def _initializable(model: nn.Module) -> dict[str, Tensor]:
    """Parameters and floating-point buffers, by name (tied ones once)."""
    found: dict[str, Tensor] = {}
    seen: set[int] = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) not in seen and t.is_floating_point() and not _stored_int8(t):
            seen.add(id(t))
            found[name] = t
    return found


def _stored_int8(t: Tensor) -> bool:
    return getattr(t, "_zpp_payload", None) is not None


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _refuse_unwritten(tensors: dict[str, Tensor]) -> None:
    mine = [name for name, t in tensors.items() if bool(torch.isnan(_local(t)).any())]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    unwritten = sorted({name for names in everyone for name in names})
    if unwritten:
        raise ShardingError(
            f"materialize(): the initialization left {unwritten} unwritten (still NaN on some rank). Every "
            "parameter and floating-point buffer needs a value: give those modules a reset_parameters(), "
            "or pass init=... that sets them (buffers computed in __init__, such as rotary tables, too); "
            "or load weights into them (zpp_compile.load_safetensors)."
        )
