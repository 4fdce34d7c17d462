"""DTensor semantics on zpp_compile's meshes, where stock DTensor would be silently wrong.

zpp_compile's parameters are DTensors (see layout.py). Outside forward, users' code runs torch ops
on them: initialization, copies of full tensors, gradient clipping. Stock DTensor (torch 2.13)
gets some of these wrong without an error, on CPU meshes in particular:

  * random in-place ops (nn.init.normal_, uniform_, ...) draw each rank's chunk from the same
    generator state, so every rank gets the values of the first rows (CPU has no offset-based
    RNG tracker), and the result differs from the unsharded init with the same seed;
  * `p[i].fill_(0)` (nn.Embedding's padding_idx) writes into a replicated copy of the row;
  * `torch.eye(n, m, out=p)` (nn.init.eye_) resizes the local tensor to the full shape;
  * `p.copy_(full_tensor)` is refused (mixed Tensor and DTensor), though the meaning is clear;
  * the inf-norm of a rank's empty chunk raises on that rank only, so the other ranks wait in
    the norm's all-reduce (clip_grad_norm_(..., norm_type=inf) with short parameters);
  * GradScaler's overflow check reduces over the ranks only if the first gradient is sharded:
    with a replicated parameter first, each rank decides alone whether to skip the step.

Each case gets a handler in DTensor's own extension point (`DTensor._op_dispatcher.
_custom_op_handlers`, also used by torch's loss_parallel and context parallel) that applies only
to DTensors on a mesh made here (`world_mesh`) and defers to stock DTensor for every other tensor.
The random ops draw the full tensor from the caller's generator, as the unsharded op would, and
keep this rank's chunk: values equal the unsharded init with the same seed on any device, for the
memory of one unsharded parameter at a time. Every rank must seed alike (torch.manual_seed), as
for any data-parallel initialization.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor, Replicate, Shard

from .codegen.quantize import ceil_div

aten = torch.ops.aten

_MESHES: dict[tuple[str, str], DeviceMesh] = {}
_ZPP_MESH_IDS: set[int] = set()


def world_mesh(group_name: str, device_type: str) -> DeviceMesh:
    """The 1-D mesh over the process group `group_name` that zpp_compile's DTensors live on."""
    key = (group_name, device_type)
    if key not in _MESHES:
        mesh = DeviceMesh.from_group(_resolve_process_group(group_name), device_type)
        _MESHES[key] = mesh
        _ZPP_MESH_IDS.add(id(mesh))
    return _MESHES[key]


def is_zpp_dtensor(value: Any) -> bool:
    return isinstance(value, DTensor) and id(value.device_mesh) in _ZPP_MESH_IDS


def chunk_of(full: Tensor, like: DTensor) -> Tensor:
    """This rank's part of `full` (a tensor of like's global shape) for like's placement."""
    placement = like.placements[0]
    if isinstance(placement, Replicate):
        return full
    if not isinstance(placement, Shard) or placement.dim != 0:
        raise NotImplementedError(f"zpp_compile DTensors are Shard(0) or Replicate, not {placement}")
    chunks = torch.chunk(full, like.device_mesh.size(), dim=0)
    rank = like.device_mesh.get_local_rank()
    return chunks[rank] if rank < len(chunks) else full[full.shape[0] :]


# --------------------------------------------------------------------------------------------
# Registration: a handler sees (op, args, kwargs) with DTensors in them and returns the result.

Handler = Callable[[Any, tuple, dict], Any]
_HANDLERS: dict[Any, Handler] = {}
_PREVIOUS: dict[Any, Optional[Handler]] = {}  # what DTensor had registered before us


def _handles(*ops: Any) -> Callable[[Handler], Handler]:
    def register(handler: Handler) -> Handler:
        for op in ops:
            _HANDLERS[op] = handler
        return handler

    return register


def install() -> None:
    """Register the handlers with DTensor (idempotent; called when zpp_compile is imported)."""
    table = DTensor._op_dispatcher._custom_op_handlers
    for op, handler in _HANDLERS.items():
        if table.get(op) is not handler:
            _PREVIOUS[op] = table.get(op)
            table[op] = handler


def stock(op: Any, args: tuple, kwargs: dict) -> Any:
    """Run `op` as DTensor would without our handler (or the handler that was there before)."""
    previous = _PREVIOUS.get(op)
    if previous is not None:
        return previous(op, args, kwargs)
    table = DTensor._op_dispatcher._custom_op_handlers
    mine = table.pop(op)
    try:
        return op(*args, **kwargs)
    finally:
        table[op] = mine


def _ours(value: Any) -> bool:
    """A DTensor of ours with real storage, outside tracing (where stock DTensor is right)."""
    if not is_zpp_dtensor(value) or value._local_tensor.is_meta:
        return False
    return not torch.compiler.is_compiling()


# --------------------------------------------------------------------------------------------
# Random in-place ops: draw the full tensor, keep this rank's chunk.

_RANDOM_INPLACE = (
    aten.normal_.default,
    aten.uniform_.default,
    aten.bernoulli_.float,
    aten.random_.default,
    getattr(aten.random_, "from"),  # a Python keyword as an overload name
    aten.random_.to,
    aten.exponential_.default,
    aten.log_normal_.default,
    aten.cauchy_.default,
    aten.geometric_.default,
)


@_handles(*_RANDOM_INPLACE)
def _random_inplace(op: Any, args: tuple, kwargs: dict) -> Any:
    target = args[0]
    if not _ours(target):
        return stock(op, args, kwargs)
    full = torch.empty(target.shape, dtype=target.dtype, device=target._local_tensor.device)
    op(full, *args[1:], **kwargs)  # the draw the unsharded op makes, from the same generator
    _write_local(target, chunk_of(full, target))
    return target


_RANDOM_LIKE = (
    aten.rand_like.default,
    aten.randn_like.default,
    aten.randint_like.default,
    aten.randint_like.low_dtype,
)


@_handles(*_RANDOM_LIKE)
def _random_like(op: Any, args: tuple, kwargs: dict) -> Any:
    like = args[0]
    if not _ours(like):
        return stock(op, args, kwargs)
    full = op(torch.empty(like.shape, dtype=like.dtype, device=like._local_tensor.device), *args[1:], **kwargs)
    local = chunk_of(full, like).contiguous()
    return DTensor.from_local(
        local, like.device_mesh, like.placements, shape=full.shape, stride=full.stride(), run_check=False
    )


def _write_local(target: DTensor, values: Tensor) -> None:
    with torch.no_grad():
        target._local_tensor.copy_(values)


# --------------------------------------------------------------------------------------------
# Writes of plain tensors: p.copy_(full), torch.eye(..., out=p).


@_handles(aten.copy_.default)
def _copy_full_tensor(op: Any, args: tuple, kwargs: dict) -> Any:
    target, source = args[0], args[1]
    if not _ours(target) or isinstance(source, DTensor):
        return stock(op, args, kwargs)
    # A plain tensor copied into a sharded parameter means its global value: keep our chunk.
    _write_local(target, chunk_of(source.expand(target.shape), target))
    return target


@_handles(aten.eye.m_out, aten.eye.out)
def _eye_into(op: Any, args: tuple, kwargs: dict) -> Any:
    out = kwargs.get("out")
    if not _ours(out):
        return stock(op, args, kwargs)
    full = torch.eye(*args, dtype=out.dtype, device=out._local_tensor.device)
    _write_local(out, chunk_of(full, out))
    return out


# --------------------------------------------------------------------------------------------
# p[i] on the sharded dim: a replicated row that aliases the owner's storage, so writes land.


@_handles(aten.select.int)
def _select_row(op: Any, args: tuple, kwargs: dict) -> Any:
    target, dim, index = args[0], args[1], args[2]
    if not _ours(target) or dim not in (0, -target.dim()) or not isinstance(target.placements[0], Shard):
        return stock(op, args, kwargs)
    index = index + target.shape[0] if index < 0 else index
    rows = ceil_div(target.shape[0], target.device_mesh.size())
    owner = index // rows
    local = target._local_tensor
    mesh = target.device_mesh
    if mesh.get_local_rank() == owner:
        row = local[index - owner * rows]  # a view: writes through it land in the shard
    else:
        row = local.new_empty(target.shape[1:])
    group = mesh.get_group()
    dist.broadcast(row, src=dist.get_global_rank(group, owner), group=group)
    return DTensor.from_local(row, mesh, [Replicate()], shape=target.shape[1:], stride=row.stride(), run_check=False)


# --------------------------------------------------------------------------------------------
# Norms of empty chunks: a rank holding no rows of a parameter contributes 0.


@_handles(aten._foreach_norm.Scalar)
def _foreach_norm(op: Any, args: tuple, kwargs: dict) -> Any:
    return stock(op, (_fill_empty(args[0]), *args[1:]), kwargs)


@_handles(aten.linalg_vector_norm.default)
def _vector_norm(op: Any, args: tuple, kwargs: dict) -> Any:
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if dim is not None:
        return stock(op, args, kwargs)
    return stock(op, (_fill_empty([args[0]])[0], *args[1:]), kwargs)


def _fill_empty(tensors: list) -> list:
    """Stand a one-zero local in for each empty chunk of ours: the norm's identity, and no error
    (the inf-norm of an empty tensor raises, on that rank only)."""
    return [_one_zero(t) if _ours(t) and t._local_tensor.numel() == 0 else t for t in tensors]


def _one_zero(t: DTensor) -> DTensor:
    local = t._local_tensor.new_zeros((1,) * max(t.dim(), 1))
    return DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape, stride=t.stride(), run_check=False)


# --------------------------------------------------------------------------------------------
# GradScaler's overflow check: every rank must agree whether a step overflowed.


@_handles(aten._amp_foreach_non_finite_check_and_unscale_.default)
def _unscale_and_find_nonfinite(op: Any, args: tuple, kwargs: dict) -> Any:
    """torch.amp.GradScaler.unscale_ runs this on each device's gradients; `found_inf` must be 1 on
    every rank if any rank's shard holds an inf or nan, or the ranks that saw none step while the
    others skip, and their loss scales part. Stock DTensor reduces `found_inf` only when the
    list's first gradient is sharded: a replicated first one (a 0-d parameter, one kept whole by
    `keep_whole_numel`, CLIP's `logit_scale` on the root) leaves each rank its own answer."""
    grads, found_inf, inv_scale = args
    if not any(_ours(g) for g in grads) or any(isinstance(g, DTensor) and not _ours(g) for g in grads):
        return stock(op, args, kwargs)
    local = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]
    op(local, found_inf, inv_scale, **kwargs)
    for group in _groups_of_sharded(grads):  # in list order: the same on every rank
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)


def _groups_of_sharded(tensors: list) -> list[dist.ProcessGroup]:
    """The process group of each distinct mesh that holds one of `tensors` sharded."""
    meshes = {id(t.device_mesh): t.device_mesh for t in tensors if isinstance(t, DTensor) and not is_replicated(t)}
    return [mesh.get_group() for mesh in meshes.values()]


def is_replicated(t: DTensor) -> bool:
    """Every rank holds the whole tensor (a 0-d parameter, one kept whole)."""
    return all(isinstance(p, Replicate) for p in t.placements)


@contextlib.contextmanager
def uninstalled() -> Iterator[None]:
    """Stock DTensor behaviour inside the block (for tests that show what the handlers fix)."""
    table = DTensor._op_dispatcher._custom_op_handlers
    saved = {op: table.pop(op) for op in _HANDLERS if table.get(op) is _HANDLERS[op]}
    try:
        yield
    finally:
        table.update(saved)


__all__ = ["chunk_of", "install", "is_replicated", "is_zpp_dtensor", "stock", "uninstalled", "world_mesh"]
