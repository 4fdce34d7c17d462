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

Dynamic shapes take part too: a tangent's symbolic sizes are rebuilt in the graph from the
backward's symbol-binding inputs, which AOTAutograd's partitioner saves for every symbol a
tangent names. A tangent with other strides than contiguous ones, or a size no such input
binds, is filled at run time (its geometry evaluated from the call's symbols), as autograd would
have done.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import operator
from typing import Any, Callable, Sequence, Union

import sympy
import torch
import torch.fx as fx
from torch._prims_common import make_contiguous_strides_for
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils import _pytree as pytree
from torch.utils._sympy.functions import FloorDiv, Max, Min, PowByNatural

from .passes.graph_utils import has_static_geometry

# (graph, example inputs) -> boxed callable: how the backend lowers a phase.
Lower = Callable[[fx.GraphModule, list[Any]], Callable]
# A symbol -> the position of the backward input that binds it (a SymInt placeholder).
SymbolInputs = dict[sympy.Symbol, int]


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
        self._symbols = symbol_inputs(self._values)
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
                variant = _Variant.lower(
                    self._gm, self._values, self._symbols, self._example_inputs, undefined, self._lower
                )
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

    def folded(self) -> list[tuple[int, ...]]:
        """Per compiled variant, the undefined tangents made as zeros inside its graph (the rest
        are filled at run time)."""
        return [tuple(sorted(v.folded)) for v in self._variants.values()]


class _Variant:
    """One lowering: `folded` positions are dropped from the call (zeros inside the graph),
    `filled` ones get zeros made at run time."""

    def __init__(
        self, compiled: Callable, folded: set[int], filled: dict[int, torch.Tensor], symbols: SymbolInputs
    ) -> None:
        self.compiled, self.folded, self.filled, self.symbols = compiled, folded, filled, symbols

    @classmethod
    def lower(
        cls,
        gm: fx.GraphModule,
        values: list[Any],
        symbols: SymbolInputs,
        example_inputs: list[Any],
        undefined: tuple[int, ...],
        lower: Lower,
    ) -> _Variant:
        """`values`: gm's placeholders' fake values; `symbols`: symbol_inputs(values)."""
        folded = {i for i in undefined if _foldable(values[i], symbols)}
        unsized = [i for i in undefined if not _sizable(values[i], symbols)]
        if unsized:  # AOTAutograd saves a binding input for every symbol a tangent names: not expected
            raise RuntimeError(
                f"zpp_compile: the backward got no gradient for tangent(s) {unsized}, whose symbolic "
                "sizes no input of the backward binds; their zeros cannot be made. Give every output "
                "of the compiled model a gradient, or compile it with dynamic=False."
            )
        filled = {i: values[i] for i in undefined if i not in folded}
        if not folded:
            return cls(lower(gm, example_inputs), folded, filled, symbols)
        kept = [v for i, v in enumerate(example_inputs) if i not in folded]
        return cls(lower(zero_filled(gm, folded, symbols), kept), folded, filled, symbols)

    def __call__(self, args: list[Any]) -> Any:
        env = {s: sympy.Integer(int(args[i])) for s, i in self.symbols.items()} if self.filled else {}
        for i, value in self.filled.items():
            shape, stride = (_evaluated(dims, env) for dims in (value.shape, value.stride()))
            args[i] = torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device).zero_()
        if self.folded:
            kept = [a for i, a in enumerate(args) if i not in self.folded]
            args.clear()  # the boxed convention: the callee owns (and frees) its inputs
            args = kept
        return self.compiled(args)


def symbol_inputs(values: Sequence[Any]) -> SymbolInputs:
    """The backward's symbol-binding inputs: SymInt placeholders whose value is a bare symbol."""
    bound: SymbolInputs = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.SymInt) and isinstance(v.node.expr, sympy.Symbol):
            bound.setdefault(v.node.expr, i)
    return bound


def _expr(dim: Union[int, torch.SymInt]) -> sympy.Expr:
    return dim.node.expr if isinstance(dim, torch.SymInt) else sympy.Integer(dim)


def _sizable(value: Any, symbols: SymbolInputs) -> bool:
    """Whether the call's symbol inputs determine `value`'s sizes and strides."""
    dims = (*value.shape, *value.stride()) if isinstance(value, torch.Tensor) else ()
    return all(_expr(d).free_symbols <= symbols.keys() for d in dims)


def _foldable(value: Any, symbols: SymbolInputs) -> bool:
    """Whether zeros of `value`'s geometry can be made inside the graph: contiguous, and each
    size an expression the graph can compute from its symbol inputs."""
    if not isinstance(value, torch.Tensor):
        return False
    if has_static_geometry(value):
        return value.is_contiguous()
    # Stride by stride, statically: torch's contiguity checks would add guards on the symbols.
    contiguous = all(
        statically_known_true(s == c)
        for n, s, c in zip(value.shape, value.stride(), make_contiguous_strides_for(value.shape))
        if not statically_known_true(n == 1)
    )
    return contiguous and all(_buildable(_expr(d), symbols) for d in value.shape)


# Size arithmetic _size_node rebuilds from the symbol inputs, by the Python operation on SymInts
# that gives it. FloorDiv: Dynamo's duck sizing gives equal sizes one symbol, and a view of their
# product then reads ((s0**2)//s0) (a square batch of tokens, HF models' logits).
_COMBINE: dict[type, Callable] = {
    sympy.Add: operator.add,
    sympy.Mul: operator.mul,
    FloorDiv: operator.floordiv,
    Max: torch.sym_max,
    Min: torch.sym_min,
}
_POWERS = (sympy.Pow, PowByNatural)


def _buildable(expr: sympy.Expr, symbols: SymbolInputs) -> bool:
    """Integers, bound symbols, and sums, products, whole powers, floor divisions, maxima and
    minima of them (what _size_node makes)."""
    if expr.is_Integer or expr in symbols:
        return True
    if isinstance(expr, _POWERS):
        base, exponent = expr.args
        return exponent.is_Integer and exponent > 0 and _buildable(base, symbols)
    return type(expr) in _COMBINE and all(_buildable(a, symbols) for a in expr.args)


def _evaluated(dims: Sequence[Union[int, torch.SymInt]], env: dict[sympy.Symbol, sympy.Integer]) -> list[int]:
    """`dims` at this call: its symbols replaced by their values in `env` (those of the inputs that
    bind them)."""
    return [d if type(d) is int else int(_expr(d).xreplace(env)) for d in dims]


def _size_node(graph: fx.Graph, expr: sympy.Expr, symbol_nodes: dict[sympy.Symbol, fx.Node]) -> Union[int, fx.Node]:
    """`expr` (a _buildable size) computed by nodes of `graph` from its symbol placeholders."""
    if expr.is_Integer:
        return int(expr)
    if expr in symbol_nodes:
        return symbol_nodes[expr]
    if isinstance(expr, _POWERS):
        base, exponent = expr.args
        terms, combine = [base] * int(exponent), operator.mul
    else:  # in argument order: a floor division's are (dividend, divisor)
        terms, combine = list(expr.args), _COMBINE[type(expr)]
    result = _size_node(graph, terms[0], symbol_nodes)
    for term in terms[1:]:
        result = _symbolic_call(graph, combine, result, _size_node(graph, term, symbol_nodes))
    return result


def _symbolic_call(graph: fx.Graph, fn: Callable, a: Union[int, fx.Node], b: Union[int, fx.Node]) -> fx.Node:
    node = graph.call_function(fn, (a, b))
    node.meta["val"] = fn(*(x.meta["val"] if isinstance(x, fx.Node) else x for x in (a, b)))
    return node


def zero_filled(gm: fx.GraphModule, positions: set[int], symbols: SymbolInputs) -> fx.GraphModule:
    """A copy of a backward graph whose placeholders at `positions` (contiguous tangents) are
    replaced by zero-filled tensors made inside the graph; symbolic sizes are computed from the
    graph's symbol placeholders (`symbols`: symbol_inputs of gm's placeholders' values).

    Before: tangents_2: f32[2, 128, 50257] = placeholder; add = aten.add(view_3, tangents_2)
    After:  full: f32[2, 128, 50257] = aten.full([2, 128, 50257], 0, ...); add = aten.add(view_3, full)
    Dynamic (s0, s1 bound by the placeholders primals_1, primals_2):
    Before: tangents_2: f32[s0, s1 + 1, 50257] = placeholder
    After:  add_1 = primals_2 + 1; full = aten.full([primals_1, add_1, 50257], 0, ...)
    """
    graph = copy.deepcopy(gm.graph)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    symbol_nodes = {s: placeholders[i] for s, i in symbols.items()}
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    for i in sorted(positions):
        tangent = placeholders[i]
        value = tangent.meta["val"]
        with graph.inserting_before(first_op):
            shape = [_size_node(graph, _expr(d), symbol_nodes) for d in value.shape]
            zeros = graph.call_function(
                torch.ops.aten.full.default,  # what Inductor lowers (aten.zeros decomposes to it)
                (shape, 0),
                {"dtype": value.dtype, "device": value.device, "pin_memory": False},
            )
        zeros.meta.update(tangent.meta)
        tangent.replace_all_uses_with(zeros)
        graph.erase_node(tangent)
    return fx.GraphModule(gm, graph)
