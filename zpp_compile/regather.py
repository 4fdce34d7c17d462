"""Eager ZeRO-3: the backward re-gathers a weight instead of keeping the forward's gathered copy.

Uncompiled, a module's matmul saves the weight it was given for its backward: the full, gathered
weight, so every weight of the model stayed gathered from its forward until its backward, the
unsharded model's size on every rank at the peak. While a sharded model's forward runs eagerly,
saved-tensor hooks replace a saved gathered weight (or a view of it: nn.Linear saves its
transpose) by a recipe, the sharded parameter and the view's geometry, and the backward gathers
the weight again when it needs it (ZeRO-3's traffic: two all-gathers and one reduce-scatter per
weight and step). The compiled path does the same in its graphs (passes/recompute.py);
`Config.save_gathered_weights=True` keeps the gathered weights in both.

Except the forward's last weights outside any repeated block (Config.keep_last_weights_gathered;
in a model without repeated blocks, the last weight read): the backward starts with them, so the
forward's copies stay (`_Tail`), as the compiled graphs save them (passes/recompute.py).

Every rank runs the same autograd graph in the same order, so the backward's gathers pair up as
the forward's did; the eager schedule check covers them like any eager collective.
"""

from __future__ import annotations

import contextlib
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
    kept: Optional[Tensor] = None  # the forward's own copy, where the forward's tail keeps it
    saved: bool = False  # whether autograd saved (a view of) the weight

    def regathered(self) -> Tensor:
        """One gather serves every saved view the backward unpacks while the copy is alive."""
        if self.kept is not None:
            return self.kept
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


class _Tail:
    """The weights gathered since the forward's last one inside a repeated block, with the forward's
    copies; when the forward ends, their saved views keep those copies instead of gathering again.
    In a model without repeated blocks: the last weight autograd saved (a bias read after its
    weight is not what the backward needs), and those read after it, which may yet be saved."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, _Recipe, Tensor]] = []
        self.only_last_saved = False  # a model without repeated blocks

    def add(self, key: int, recipe: _Recipe, weight: Tensor, tail: str) -> None:
        if tail == "in_block":
            self.entries.clear()
            return
        if tail == "last":
            self.only_last_saved = True
            self.entries = self.entries[self._last_saved() :]
        self.entries.append((key, recipe, weight))

    def _last_saved(self) -> int:
        """The index of the last entry autograd saved, else of the last entry (the latest read,
        whose use may not have run yet)."""
        saved = [i for i, (_, recipe, _) in enumerate(self.entries) if recipe.saved]
        return saved[-1] if saved else max(len(self.entries) - 1, 0)

    def keep(self) -> None:
        first = self._last_saved()
        kept = self.entries[first : first + 1] if self.only_last_saved else self.entries
        for key, recipe, weight in kept:
            recipe.kept = weight
            if _GATHERED.get(key) is recipe:  # the forward is over: no view of it is saved any more
                del _GATHERED[key]
        self.entries.clear()


_TAIL: Optional[_Tail] = None  # the running outermost eager forward's


def remember(weight: Tensor, gather: Callable[[], Tensor], tail: Optional[str] = None) -> None:
    """Mark `weight`, just gathered eagerly, as one the backward may gather again with `gather`.
    `tail` (Config.keep_last_weights_gathered): "in_block" for a weight of a repeated block,
    "outside_blocks" for one outside them, "last" in a model without repeated blocks (only the
    last weight autograd saves is kept); None: always gathered again."""
    key = weight.untyped_storage().data_ptr()
    if key == 0:  # an empty weight: nothing to save, and every empty storage has this address
        return

    recipe = _Recipe(gather, None)  # type: ignore[arg-type]
    # The callback must not hold the recipe: a cycle would keep a kept weight alive after its
    # backward, until the garbage collector happens to run.
    recipe_ref = weakref.ref(recipe)

    def forget(_ref, key=key) -> None:
        if recipe_ref() is not None and _GATHERED.get(key) is recipe_ref():
            del _GATHERED[key]

    recipe.weight = weakref.ref(weight, forget)
    _GATHERED[key] = recipe
    if tail is not None and _TAIL is not None:
        _TAIL.add(key, recipe, weight, tail)


def _pack(saved: Tensor):
    key = saved.untyped_storage().data_ptr() if saved.device.type != "meta" else 0
    recipe = _GATHERED.get(key) if key != 0 else None  # 0: every empty storage
    weight = recipe.weight() if recipe is not None else None
    if weight is None or weight.dtype != saved.dtype:
        return saved
    recipe.saved = True
    return _SavedView(recipe, tuple(saved.size()), tuple(saved.stride()), saved.storage_offset())


def _unpack(packed):
    return packed.unpack() if isinstance(packed, _SavedView) else packed


def saving_recipes():
    """The context a sharded model's eager forward runs in. A no-op (None) where other saved-tensor
    hooks are active already (activation offloading, checkpointing): theirs stay in charge."""
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return None
    return _saving_recipes()


@contextlib.contextmanager
def _saving_recipes():
    global _TAIL
    _TAIL = tail = _Tail()
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
        tail.keep()
    finally:
        _TAIL = None
