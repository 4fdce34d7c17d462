"""The eager path's two flat collectives, in the form that holds least memory on the group's backend.

gloo's tensor collectives stage the whole tensor in a buffer of their own: an all-gather of a
147 MB weight briefly holds 294 MB (the output and gloo's copy of it), a reduce-scatter of its
gradient 147 MB more than its input. For a large tensor on gloo the same exchange is done per
owner instead: one broadcast from each rank into its slice of the output, or one reduce of each
rank's slice into that rank's output, in pieces, the peers' through a scratch of one piece. Each
rank still sends and receives one tensor's worth; the extra memory falls from a whole tensor to
one piece (8 MiB), and at these sizes the rooted forms were faster on gloo, not slower (4 ranks,
147 MB, one run: gather 440 ms against 506, reduce 226 ms against 382). NCCL's collectives stage
nothing, so every other backend keeps the tensor collectives, as does every tensor below
ROOTED_MIN_BYTES (at a few MB the rooted forms' per-owner latency costs more than the copy).
Checkpoints' whole-tensor gathers (DTensor full_tensor / redistribute) are not routed here.

Compiled graphs lower to functional collectives (passes/); for the same large tensors on gloo,
passes/root_large_collectives.py swaps them for rooted_ops.py's asynchronous rooted forms.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import ProcessGroup

from .compat import all_gather_single, reduce_scatter_single

# Whole-tensor bytes from which the rooted forms are used on gloo (measured: at 9 MB the two
# forms took the same time, at 2 MB the rooted reduce took twice as long).
ROOTED_MIN_BYTES = 16 << 20
# The rooted reduce's pieces: its scratch, and how much one reduce carries (4 ranks, a 147 MB
# gradient: 226 ms in 8 MiB pieces, 262 ms in whole slices, 382 ms as one reduce-scatter).
ROOTED_PIECE_BYTES = 8 << 20


def all_gather_flat(out: Tensor, shard: Tensor, group: ProcessGroup) -> None:
    """out (group size x shard's numel, flat) <- every rank's `shard`, in group-rank order."""
    world = dist.get_world_size(group)
    _check_sizes("all-gather", out, shard, world)
    if not uses_rooted_form(out, group):
        all_gather_single(out, shard, group=group)
        return
    slices = out.view(world, -1)
    slices[dist.get_rank(group)].copy_(shard)
    for owner, piece in enumerate(slices):
        dist.broadcast(piece, group=group, group_src=owner)


def reduce_scatter_flat(out: Tensor, flat: Tensor, group: ProcessGroup) -> None:
    """out <- the sum over ranks of this rank's slice of `flat` (group size x out's numel); `flat`
    is left as it was."""
    world = dist.get_world_size(group)
    _check_sizes("reduce-scatter", flat, out, world)
    if not uses_rooted_form(flat, group):
        reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=group)
        return
    rank = dist.get_rank(group)
    # gloo's reduce writes into its buffer on every rank, and `flat` (autograd's gradient) may be
    # shared: peers' slices go through a scratch of one piece, this rank's straight into `out`.
    scratch = out.new_empty(min(piece_numel(out), out.numel()))
    for owner, part in enumerate(flat.view(world, -1)):
        for start, stop in pieces(out):
            target = out[start:stop] if owner == rank else scratch[: stop - start]
            target.copy_(part[start:stop])
            dist.reduce(target, op=dist.ReduceOp.SUM, group=group, group_dst=owner)


def piece_numel(part: Tensor) -> int:
    return max(1, ROOTED_PIECE_BYTES // part.element_size())


def pieces(part: Tensor) -> list[tuple[int, int]]:
    """The (start, stop) element ranges one rooted reduce carries of a rank's `part`."""
    step = piece_numel(part)
    return [(start, min(start + step, part.numel())) for start in range(0, part.numel(), step)]


def _check_sizes(what: str, whole: Tensor, part: Tensor, world: int) -> None:
    # The rooted forms would cut mismatched sizes silently, where the tensor collectives raise.
    if whole.numel() != world * part.numel():
        raise ValueError(f"{what}: {whole.numel()} elements are not {world} x {part.numel()}")


def uses_rooted_form(whole: Tensor, group: ProcessGroup) -> bool:
    """Whether a collective whose whole tensor (gathered output, or reduced input) is `whole` takes
    the rooted per-owner form on `group` (a fake tensor will do: the compiled path asks too)."""
    return whole.numel() * whole.element_size() >= ROOTED_MIN_BYTES and _on_gloo(whole, group)


def _on_gloo(tensor: Tensor, group: ProcessGroup) -> bool:
    """Whether gloo carries `tensor` in `group`. From the group's per-device backends
    ("cpu:gloo,cuda:nccl"): dist.get_backend says "undefined" for a group made without naming one."""
    return backend_for_device(dist.get_backend_config(group), tensor.device.type) == "gloo"


def backend_for_device(config: str, device_type: str) -> str:
    """The backend of `device_type` in a backend config ("cpu:gloo,cuda:nccl", or "gloo" for all)."""
    for entry in config.split(","):
        device, _, backend = entry.strip().rpartition(":")
        if device in ("", device_type):
            return backend
    return ""
