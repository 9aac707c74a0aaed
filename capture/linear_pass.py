"""An Inductor graph pass: a compiled step's matmuls of a few rows through graphrt's
``small_linear``, the ones that share an input in one launch.

A decode step's linear layers read their weights once for one to a few dozen rows of
activations; cuBLAS runs each as its own kernel, and a Llama layer's q, k and v (gate and
up) projections as three (two) launches over the same input. After AOTAutograd each is an
``aten.mm`` (``aten.addmm`` with a bias) of a [M, K] activation and a transposed [N, K]
weight. This pass, run by Inductor before its own post-grad passes (``CompileOptions``'
``small_linear``), replaces them where graphrt's kernel measured faster on an H100
(benchmarks/probes/probe_linear.py at d481a37, a whole step's linear layers as one graph):
one row always (Llama-1B 960 µs a step against cuBLAS' 1250; 8B 5.07 ms against 5.90),
and at 2 to 32 rows a group that shares its input (q/k/v: 7.6 µs against three cuBLAS
launches' 17.8) or an output of 32768 rows or more (the LM head), where single narrow
projections stay with cuBLAS (o: 6.4 µs against graphrt's 6.9).

A matmul whose input is a SwiGLU product ``silu(g) * u`` (the MLP's down projection) takes g
and u instead: the kernel forms the product as it loads its input, and the elementwise
kernel that made it goes (at any number of rows up to 32: that launch is saved too).
"""

from __future__ import annotations

import operator

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

aten = torch.ops.aten
MAX_ROWS = 32                 # the rows measured (probe_linear: 1, 8, 32); more go to cuBLAS
WIDE_OUTPUT = 32768
DTYPES = (torch.float16, torch.bfloat16)


def _weight_of(node: torch.fx.Node) -> torch.fx.Node | None:
    """The [N, K] weight w where ``node`` is w transposed (``aten.t`` or ``permute(w, [1, 0])``)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node.target is aten.t.default or (node.target is aten.permute.default and list(node.args[1]) == [1, 0]):
        return node.args[0]
    return None


def _val(node: object):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_CONVERT = torch.ops.prims.convert_element_type.default


def _through_views(node: object) -> object:
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return node


def _silu_of(node: object, dtype: torch.dtype):
    """g where ``node`` is silu(g) rounded to ``dtype`` as a traced model computes it
    (``aten.silu``, or its decompositions g / (1 + exp(-g)) and g * sigmoid(g), on g or on g
    converted to fp32); else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node.target is _CONVERT:
        if node.args[1] != dtype:
            return None
        node = node.args[0]
    elif _val(node) is None or _val(node).dtype != dtype:
        return None

    def call(n, *targets):
        return isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target in targets and not n.kwargs

    c = None
    if call(node, aten.silu.default):
        c = node.args[0]
    elif call(node, aten.div.Tensor):
        c, den = node.args
        one_plus = call(den, aten.add.Tensor) and (
            (den.args[1] == 1 and call(den.args[0], aten.exp.default)) or
            (den.args[0] == 1 and call(den.args[1], aten.exp.default)))
        if not one_plus:
            return None
        e = den.args[0] if den.args[1] == 1 else den.args[1]
        if not (call(e.args[0], aten.neg.default) and e.args[0].args[0] is c):
            return None
    elif call(node, aten.mul.Tensor):
        a, b = node.args
        if call(b, aten.sigmoid.default) and b.args[0] is a:
            c = a
        elif call(a, aten.sigmoid.default) and a.args[0] is b:
            c = b
    if not isinstance(c, torch.fx.Node):
        return None
    if call(c, _CONVERT) and c.args[1] == torch.float32:
        c = c.args[0]
    cv = _val(c)
    return c if cv is not None and cv.dtype == dtype else None


def _swiglu(x: torch.fx.Node):
    """(u, g) where ``x`` is (a view of) silu(g) * u, both of x's shape, dtype and
    contiguous, as the model's tensors (the caller views them as x); else None."""
    xv = _val(x)
    mul = _through_views(x)
    if not (isinstance(mul, torch.fx.Node) and mul.op == "call_function" and mul.target is aten.mul.Tensor
            and not mul.kwargs and all(isinstance(a, torch.fx.Node) for a in mul.args)):
        return None
    for s_node, u in (mul.args, mul.args[::-1]):
        g = _silu_of(s_node, xv.dtype)
        if g is None:
            continue
        gv, uv, mv = _val(g), _val(u), _val(mul)
        if gv is None or uv is None or mv is None or tuple(gv.shape) != tuple(mv.shape) or \
                tuple(uv.shape) != tuple(mv.shape) or uv.dtype != xv.dtype or gv.device != xv.device or \
                uv.device != xv.device or not gv.is_contiguous() or not uv.is_contiguous() or \
                mv.numel() != xv.numel():
            return None
        return u, g
    return None


def _candidate(node: torch.fx.Node, devices: tuple[str, ...]):
    """(x, w, bias or None, (u, g) or None) where ``node`` is x @ w.T (+ bias) that
    small_linear can run; the last, where x is silu(g) * u (``_swiglu``)."""
    if node.op != "call_function" or node.kwargs:
        return None
    if node.target is aten.mm.default:
        x, wt, bias = *node.args, None
    elif node.target is aten.addmm.default and len(node.args) == 3:
        bias, x, wt = node.args
    else:
        return None
    w = _weight_of(wt)
    xv, wv, bv = _val(x), _val(w), _val(bias)
    if xv is None or wv is None or (bias is not None and bv is None):
        return None
    if xv.dim() != 2 or wv.dim() != 2 or xv.dtype not in DTYPES or wv.dtype != xv.dtype:
        return None
    if xv.device.type not in devices or wv.device != xv.device or not 1 <= xv.shape[0] <= MAX_ROWS:
        return None
    if xv.shape[1] != wv.shape[1] or wv.shape[0] < 1 or (xv.shape[1] > 1 and xv.stride(1) != 1):
        return None
    if wv.shape[1] > 1 and wv.stride(1) != 1:
        return None
    if bias is not None and (bv.dim() != 1 or bv.shape[0] != wv.shape[0] or bv.dtype != xv.dtype):
        return None
    return x, w, bias, _swiglu(x)


def _input_key(x: torch.fx.Node):
    """Matmuls whose inputs are the same view of one tensor share an input (each F.linear
    of a 3-D activation makes a view of its own unless the graph was CSE'd)."""
    if x.op == "call_function" and x.target in _VIEWS and not x.kwargs:
        return (x.target, x.args[0], tuple(x.args[1]))
    return x


def _mutates(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return bool(schema is not None and schema.is_mutable)


def _constant(w: torch.fx.Node) -> bool:
    """Whether weight ``w`` is an input of the graph (a parameter) that no node of it
    writes: what no kernel of the step changes, so a launch may read it early."""
    return w.op in ("placeholder", "get_attr") and not any(_mutates(u) for u in w.users)


def group_small_linears(graph: torch.fx.Graph, devices: tuple[str, ...] = ("cuda",)) -> int:
    """Rewrite ``graph`` in place (see the module's docstring); returns how many matmuls
    went to small_linear."""
    import graphrt.kernels.ops  # noqa: F401  (registers torch.ops.graphrt.small_linear)

    order = {n: i for i, n in enumerate(graph.nodes)}
    # mutations seen before each node: a group never spans one (a later matmul moved before
    # an in-place write would read what the write had not yet written)
    mutations, seen = {}, 0
    for n in graph.nodes:
        mutations[n] = seen
        seen += _mutates(n)
    by_input: dict[torch.fx.Node, list] = {}
    for node in graph.nodes:
        found = _candidate(node, devices)
        if found is not None:
            by_input.setdefault((_input_key(found[0]), found[3]), []).append((node, *found))
    replaced = 0
    for members in by_input.values():
        while members:
            first, rest = members[0], members[1:]
            # one launch: up to three weights (all with biases or none), each defined before
            # the first matmul, where the launch goes
            group = [first] + [m for m in rest if (m[3] is None) == (first[3] is None)
                               and mutations[m[0]] == mutations[first[0]]
                               and order[m[2]] < order[first[0]]
                               and (m[3] is None or order[m[3]] < order[first[0]])][:2]
            members = [m for m in members if m not in group]
            x, swiglu = first[1], first[4]    # the first matmul's input: defined before it
            rows = _val(x).shape[0]
            wide = sum(_val(m[2]).shape[0] for m in group) >= WIDE_OUTPUT
            if rows > 1 and len(group) == 1 and not wide and swiglu is None:
                continue                      # one narrow weight over several rows: cuBLAS is faster
            with graph.inserting_before(first[0]):
                args = (x, [m[2] for m in group], [m[3] for m in group], all(_constant(m[2]) for m in group))
                if swiglu is not None:        # u and g viewed as x: the call takes (u, ..., gate=g)
                    u, g = (graph.call_function(aten.reshape.default, (t, list(_val(x).shape))) for t in swiglu)
                    u.meta["val"], g.meta["val"] = (_val(t).reshape(_val(x).shape) for t in swiglu)
                    args = (u, *args[1:], g)
                call = graph.call_function(torch.ops.graphrt.small_linear.default, args)
                call.meta["val"] = [_val(m[0]) for m in group]
                for i, (mm, *_rest) in enumerate(group):
                    item = graph.call_function(operator.getitem, (call, i))
                    item.meta["val"] = _val(mm)
                    mm.replace_all_uses_with(item)
            for mm, *_rest in group:
                inputs = mm.all_input_nodes
                graph.erase_node(mm)
                _drop_unused(graph, inputs)   # the transposed weight; a SwiGLU product now unread
                replaced += 1
    return replaced


def _drop_unused(graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> None:
    """Erase each of ``nodes`` that nothing reads and that writes nothing, then the same for
    the nodes those read (graph inputs stay)."""
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n.op == "call_function" and not n.users and not _mutates(n) and not getattr(n, "_erased", False):
            stack.extend(n.all_input_nodes)
            graph.erase_node(n)


class SmallLinearPass(CustomGraphPass):
    """``group_small_linears`` as Inductor's ``post_grad_custom_pre_pass`` (its uuid, from
    this file and the kernel's, keys Inductor's on-disk cache)."""

    def __init__(self) -> None:
        self.replaced = 0          # matmuls rewritten by the compiles this pass ran in

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.replaced += group_small_linears(graph)

    def uuid(self) -> bytes:
        from graphrt.kernels import linear

        return get_hash_for_files((__file__, linear.__file__))
