"""The rooted collectives of compiled graphs: issued where the functional collective was, completed
by a wait where its wait_tensor was, so they overlap compute as the functional ones do.

gloo's tensor collectives stage the whole tensor (eager_collectives.py measures it): a compiled
backward that reduce-scatters a 147 MB gradient holds its padded copy, gloo's staging copy and the
shard at once. The eager path already takes the rooted per-owner form for such tensors;
passes/root_large_collectives.py gives compiled graphs the same, through two ops here:

    out = zpp.rooted_reduce_scatter(flat, shard_numel, group_size, group_name)  # issued, async
    ...                                                                         # compute overlaps
    zpp.wait_rooted(out, flat)                                   # completed; `out` is ready

- rooted_reduce_scatter: one gloo reduce per owner and piece, issued asynchronously. Peers'
  slices are reduced in place in `flat` (gloo's reduce writes its buffer on every rank); that is
  why it declares `flat` mutated and why the pass only gives it a flat nothing else reads (a
  gradient of its own, a pad or a bucket concatenation). This rank's slice is copied into `out`
  and reduced there. `flat` may stop short of the last shards' end (it is the gradient before
  the reduction's zero pad): the missing elements are zeros on every rank, so they are not sent
  and `out`'s tail is zero-filled. No staging: the extra memory is `out`, as for the functional
  form, minus gloo's copy (and the pad's copy).
- rooted_all_gather: this rank's shard copied into its slot of `out`, then one broadcast per
  owner into that owner's slot.
- wait_rooted: waits for the op's works and marks `out` written (it declares `out` mutated, so
  Inductor orders every reader of `out` after it). Its second argument only keeps the
  collective's input alive to that point: Inductor would otherwise reuse the input's buffer for a
  later kernel while gloo still reads or writes it (the functional collectives get the same
  guarantee from Inductor's lowering, NOTE [Out-of-Place Collective Safety]).

Between the two ops a future per work is held here, keyed by `out`'s storage address and holding a
weak reference to it (a result dropped unwaited gives its address back); the wait raises the first
failure in issue order (a stuck peer costs one timeout, not one per work).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.multiprocessing.reductions import StorageWeakRef

from .eager_collectives import pieces
from .faults import explained_collective_failures
from .process_state import register_reset
from .topology import group_timeout_s


@dataclasses.dataclass
class _InFlight:
    done: list[torch.futures.Future]  # one per work, in issue order, holding no tensor
    group_name: str
    what: str
    out: StorageWeakRef  # expired: `out` was dropped unwaited, so its address may come back


_IN_FLIGHT: dict[int, _InFlight] = {}
# A step that failed between an issue and its wait leaves its entry; reset() drops them.
register_reset(_IN_FLIGHT.clear)


@torch.library.custom_op("zpp::rooted_reduce_scatter", mutates_args=("flat",))
def rooted_reduce_scatter(flat: Tensor, shard_numel: int, group_size: int, group_name: str) -> Tensor:
    """Issue the sum over the group of each rank's slice of `flat` into that rank's `out`
    (shard_numel elements); `flat`'s other slices are left undefined. `flat` may end before
    group size x shard_numel: what is missing counts as zeros (the reduction's zero pad, which
    the rooted form need not copy). Complete with wait_rooted."""
    _check_fits(flat, shard_numel, group_size)
    group = _resolve_process_group(group_name)
    out = flat.new_empty(shard_numel)
    rank = dist.get_rank(group)
    parts = flat.split(shard_numel)  # the trailing ranks' parts may be short, or missing
    out[parts[rank].numel() if rank < len(parts) else 0 :].zero_()
    works = []
    with explained_failures_in("the issue of a rooted reduce-scatter", group_name):
        for owner, part in enumerate(parts):
            target = out[: part.numel()].copy_(part) if owner == rank else part
            for start, stop in pieces(target):
                works.append(
                    dist.reduce(target[start:stop], op=dist.ReduceOp.SUM, group=group, group_dst=owner, async_op=True)
                )
    _hold(out, works, group_name, "a rooted reduce-scatter")
    return out


@rooted_reduce_scatter.register_fake
def _(flat: Tensor, shard_numel: int, group_size: int, group_name: str) -> Tensor:
    _check_fits(flat, shard_numel, group_size)
    return flat.new_empty(shard_numel)


def _check_fits(flat: Tensor, shard_numel: int, group_size: int) -> None:
    if flat.numel() > group_size * shard_numel:
        raise ValueError(
            f"zpp::rooted_reduce_scatter: {flat.numel()} elements do not fit {group_size} shards of {shard_numel}"
        )


@torch.library.custom_op("zpp::rooted_all_gather", mutates_args=())
def rooted_all_gather(shard: Tensor, group_size: int, group_name: str) -> Tensor:
    """Issue the gather of every rank's `shard` into `out` (group size x shard numel, flat, in
    group-rank order). Complete with wait_rooted."""
    group = _resolve_process_group(group_name)
    out = shard.new_empty(shard.numel() * group_size)
    slots = out.view(group_size, -1)
    slots[dist.get_rank(group)].copy_(shard.reshape(-1))
    with explained_failures_in("the issue of a rooted all-gather", group_name):
        works = [dist.broadcast(slot, group=group, group_src=owner, async_op=True) for owner, slot in enumerate(slots)]
    _hold(out, works, group_name, "a rooted all-gather")
    return out


@rooted_all_gather.register_fake
def _(shard: Tensor, group_size: int, group_name: str) -> Tensor:
    return shard.new_empty(shard.numel() * group_size)


@torch.library.custom_op("zpp::wait_rooted", mutates_args=("out",))
def wait_rooted(out: Tensor, keep_alive: Optional[Tensor] = None) -> None:
    """Complete the rooted collective that returned `out`."""
    in_flight = _IN_FLIGHT.pop(_key(out), None)
    if in_flight is None:
        raise RuntimeError(
            "zpp::wait_rooted: no rooted collective in flight for this tensor: each "
            "zpp.rooted_* result must be waited on exactly once, by the graph that issued it."
        )
    with explained_failures_in(f"the wait of {in_flight.what}", in_flight.group_name):
        for done in in_flight.done:  # in issue order: the first failure raises, the rest are not awaited
            done.wait()


@wait_rooted.register_fake
def _(out: Tensor, keep_alive: Optional[Tensor] = None) -> None:
    return None


def in_flight_count() -> int:
    """Rooted collectives issued and not yet waited on (0 between steps)."""
    return len(_IN_FLIGHT)


def _hold(out: Tensor, works: list, group_name: str, what: str) -> None:
    """Keep a future per work that holds no tensor, not the works: gloo's works and their futures
    keep the tensors they send until dropped, so a reduce's input is freed when its reduces finish
    (as with gloo's own reduce-scatter), not at the wait. In a graph Inductor compiles whole,
    wait_rooted's second argument keeps it to the wait, as Inductor does for its collectives."""
    key = _key(out)
    earlier = _IN_FLIGHT.get(key)
    if earlier is not None and not earlier.out.expired():
        raise RuntimeError(f"zpp::rooted ops: {what} returned a tensor already in flight (a bug in zpp_compile)")
    # An expired entry is a result dropped without its wait (opcheck runs an op and drops it; a step
    # that failed before its waits): its works held `out` until they finished, so they are done with
    # this memory, and the allocator handing it out again is no conflict.
    _IN_FLIGHT[key] = _InFlight(
        [work.get_future().then(_without_value) for work in works],
        group_name,
        what,
        StorageWeakRef(out.untyped_storage()),
    )


def _without_value(done: torch.futures.Future) -> None:
    done.value()  # raises the work's error, which the chained future then carries


def _key(out: Tensor) -> int:
    return out.untyped_storage().data_ptr()


def explained_failures_in(where: str, group_name: str):
    """faults.explained_collective_failures with the timeout of the group `group_name`."""
    return explained_collective_failures(where, group_timeout_s(group_name))
