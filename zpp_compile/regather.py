"""Eager ZeRO-3: the backward re-gathers a weight instead of keeping the forward's gathered copy.

Uncompiled, a module's matmul saves the weight it was given for its backward: the full, gathered
weight, so every weight of the model stayed gathered from its forward until its backward, the
unsharded model's size on every rank at the peak. While a sharded model's forward runs eagerly,
saved-tensor hooks replace a saved gathered weight (or a view of it: nn.Linear saves its
transpose) by a recipe, the sharded parameter and the view's geometry, and the backward gathers
the weight again when it needs it (ZeRO-3's traffic: two all-gathers and one reduce-scatter per
weight and step). The compiled path does the same in its graphs (passes/recompute.py);
`Config.save_gathered_weights=True` keeps the gathered weights in both.

Every rank runs the same autograd graph in the same order, so the backward's gathers pair up as
the forward's did; the eager schedule check covers them like any eager collective.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

# The storage of each gathered weight still alive -> how to gather it again. Keyed by storage:
# what autograd saves is often a view whose _base is the gather's padded buffer, not the weight.
_GATHERED: dict[int, _Recipe] = {}


@dataclass(eq=False)
class _Recipe:
    gather: Callable[[], Tensor]  # the gather again, a full weight with the same storage layout
    weight: weakref.ref[Tensor]
    last_regathered: Optional[weakref.ref[Tensor]] = field(default=None)

    def regathered(self) -> Tensor:
        """One gather serves every saved view the backward unpacks while the copy is alive."""
        full = self.last_regathered() if self.last_regathered is not None else None
        if full is None:
            with torch.no_grad():
                full = self.gather()
            self.last_regathered = weakref.ref(full)
        return full


@dataclass(frozen=True)
class _SavedView:
    recipe: _Recipe
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int

    def unpack(self) -> Tensor:
        return self.recipe.regathered().as_strided(self.size, self.stride, self.storage_offset)


def remember(weight: Tensor, gather: Callable[[], Tensor]) -> None:
    """Mark `weight`, just gathered eagerly, as one the backward may gather again with `gather`."""
    key = weight.untyped_storage().data_ptr()
    if key == 0:  # an empty weight: nothing to save, and every empty storage has this address
        return

    def forget(_ref, key=key) -> None:
        if _GATHERED.get(key) is recipe:
            del _GATHERED[key]

    recipe = _Recipe(gather, weakref.ref(weight, forget))
    _GATHERED[key] = recipe


def _pack(saved: Tensor):
    key = saved.untyped_storage().data_ptr() if saved.device.type != "meta" else 0
    recipe = _GATHERED.get(key) if key != 0 else None  # 0: every empty storage
    weight = recipe.weight() if recipe is not None else None
    if weight is None or weight.dtype != saved.dtype:
        return saved
    return _SavedView(recipe, tuple(saved.size()), tuple(saved.stride()), saved.storage_offset())


def _unpack(packed):
    return packed.unpack() if isinstance(packed, _SavedView) else packed


def saving_recipes():
    """The context a sharded model's eager forward runs in. A no-op (None) where other saved-tensor
    hooks are active already (activation offloading, checkpointing): theirs stay in charge."""
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return None
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
