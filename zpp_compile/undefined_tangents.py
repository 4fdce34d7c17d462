"""Outputs no gradient reaches cost the compiled backward nothing.

A Hugging Face causal LM returns its logits beside its loss, and the step calls
`loss.backward()`. torch.autograd hands an autograd.Function a zero-filled gradient for each
output that got none, unless the function's node turns that off (`materialize_grads`), and
AOTAutograd's node does not (pytorch/pytorch#131794). So every compiled backward of such a
model began by allocating a zero tensor of the logits' size (batch x sequence x vocabulary;
49 MB for GPT-2 small at 2 x 128 tokens, gigabytes for a 128K vocabulary) and adding it in.

Here the compiled forward's wrapper turns materialization off on the graph's node
(`leave_undefined`): the backward gets None for those tangents. The backward is lowered per
set of tangents a call leaves undefined (`TangentVariants`): each undefined one becomes a
zero-filled constant in the graph, which Inductor folds into the kernels that read it instead
of allocating it. A variant is compiled the first time a backward needs it; the graph that
compiled_graphs() shows is the one with every tangent.

Only graphs whose outputs have static shapes take part: a tangent with symbolic sizes has
nothing in the backward graph to size its zeros from. A tangent with static sizes but other
strides than contiguous ones is filled at run time, as autograd would have done.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .passes.graph_utils import has_static_geometry

# (graph, example inputs) -> boxed callable: how the backend lowers a phase.
Lower = Callable[[fx.GraphModule, list[Any]], Callable]


def static_outputs(gm: fx.GraphModule) -> bool:
    """Whether every tensor a Dynamo graph returns, hence every tangent of its backward, has
    static sizes and strides."""
    returned = [n for n in pytree.tree_leaves(gm.graph.output_node().args) if isinstance(n, fx.Node)]
    values = [n.meta.get("example_value", n.meta.get("val")) for n in returned]
    return all(v is not None and (not isinstance(v, torch.Tensor) or _static(v)) for v in values)


def leaving_undefined(compiled: Callable) -> Callable:
    """A compiled Dynamo graph whose backward gets None for the outputs no gradient reaches."""

    @functools.wraps(compiled)
    def call(*args: Any) -> Any:
        outputs = compiled(*args)
        leave_undefined(outputs, args)
        return outputs

    return call


def leave_undefined(outputs: Any, inputs: Sequence[Any]) -> None:
    """After a compiled forward: its backward gets None, not zeros, for outputs no gradient reaches.

    The outputs of one call share one AOTAutograd node: the first found is the one to set. Only a
    node whose tangents are plain tensors is touched (a subclass tangent flattens into several,
    which None cannot stand for). An output that is one of the inputs is another graph's, whose
    backward may not take None.
    """
    for out in pytree.tree_leaves(outputs):
        if not isinstance(out, torch.Tensor) or out.grad_fn is None:
            continue
        if _plain_tangents(getattr(type(out.grad_fn), "_forward_cls", None)) and not any(out is v for v in inputs):
            out.grad_fn.materialize_grads = False
            return


def _plain_tangents(function: Any) -> bool:
    from torch._functorch._aot_autograd.schemas import PlainTensorMeta

    metadata = getattr(function, "metadata", None)
    if metadata is None or not hasattr(function, "compiled_bw"):
        return False  # not an AOTAutograd compiled function
    return all(isinstance(m, PlainTensorMeta) for m in metadata.subclass_tangent_meta)


class TangentVariants:
    """A boxed backward lowered once per set of tangents its calls leave undefined (None)."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], lower: Lower) -> None:
        self._gm, self._example_inputs, self._lower = gm, list(example_inputs), lower
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self._tangents = [i for i, n in enumerate(placeholders) if n.name.startswith("tangents")]
        self._values = [n.meta.get("val") for n in placeholders]
        self._variants: dict[tuple[int, ...], _Variant] = {}
        self._boxed_call = True
        # Lowered later, as AOTAutograd lowers a backward lazily: inside the compile's contexts.
        self._tracing = torch._guards.TracingContext.try_get()
        self._compile = torch._guards.CompileContext.try_get()

    def __call__(self, args: list[Any]) -> Any:
        undefined = tuple(i for i in self._tangents if args[i] is None)
        variant = self._variants.get(undefined)
        if variant is None:
            with self._compiling():
                variant = _Variant.lower(self._gm, self._values, self._example_inputs, undefined, self._lower)
            self._variants[undefined] = variant
        return variant(args)

    def _compiling(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch._guards.tracing(self._tracing))
        stack.enter_context(torch._guards.compile_context(self._compile))
        stack.enter_context(torch._C._DisableAutocast())
        return stack

    def variants(self) -> list[tuple[int, ...]]:
        """The sets of undefined tangent positions compiled so far (for tests and inspection)."""
        return list(self._variants)


class _Variant:
    """One lowering: `folded` positions are dropped from the call (zeros inside the graph),
    `filled` ones get zeros made at run time."""

    def __init__(self, compiled: Callable, folded: set[int], filled: dict[int, torch.Tensor]) -> None:
        self.compiled, self.folded, self.filled = compiled, folded, filled

    @classmethod
    def lower(
        cls, gm: fx.GraphModule, values: list[Any], example_inputs: list[Any], undefined: tuple[int, ...], lower: Lower
    ) -> _Variant:
        """`values`: gm's placeholders' fake values."""
        folded = {i for i in undefined if _foldable(values[i])}
        unsized = [i for i in undefined if i not in folded and not _static(values[i])]
        if unsized:  # static_outputs() keeps such graphs out: not expected
            raise RuntimeError(
                f"zpp_compile: the backward got no gradient for tangent(s) {unsized} of symbolic size; "
                "their zeros cannot be made. Give every output of the compiled model a gradient, "
                "or compile it with dynamic=False."
            )
        filled = {i: values[i] for i in undefined if i not in folded}
        if not folded:
            return cls(lower(gm, example_inputs), folded, filled)
        kept = [v for i, v in enumerate(example_inputs) if i not in folded]
        return cls(lower(zero_filled(gm, folded), kept), folded, filled)

    def __call__(self, args: list[Any]) -> Any:
        for i, value in self.filled.items():
            args[i] = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device).zero_()
        if self.folded:
            kept = [a for i, a in enumerate(args) if i not in self.folded]
            args.clear()  # the boxed convention: the callee owns (and frees) its inputs
            args = kept
        return self.compiled(args)


def _static(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and has_static_geometry(value)


def _foldable(value: Any) -> bool:
    return _static(value) and value.is_contiguous()


def zero_filled(gm: fx.GraphModule, positions: set[int]) -> fx.GraphModule:
    """A copy of a backward graph whose placeholders at `positions` (contiguous, static tangents)
    are replaced by zero-filled tensors made inside the graph.

    Before: tangents_2: f32[2, 128, 50257] = placeholder; add = aten.add(view_3, tangents_2)
    After:  full: f32[2, 128, 50257] = aten.full([2, 128, 50257], 0, ...); add = aten.add(view_3, full)
    """
    graph = copy.deepcopy(gm.graph)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    for i in sorted(positions):
        tangent = placeholders[i]
        value = tangent.meta["val"]
        with graph.inserting_before(first_op):
            zeros = graph.call_function(
                torch.ops.aten.full.default,  # what Inductor lowers (aten.zeros decomposes to it)
                (list(value.shape), 0),
                {"dtype": value.dtype, "device": value.device, "pin_memory": False},
            )
        zeros.meta.update(tangent.meta)
        tangent.replace_all_uses_with(zeros)
        graph.erase_node(tangent)
    return fx.GraphModule(gm, graph)
