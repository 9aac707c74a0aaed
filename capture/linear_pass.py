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

Around the matmuls, the elementwise work of a decoder layer joins the launches (each
found in the forms a traced model's graph holds; a form not recognised stays as it was):
- at one row, a matmul whose input is a gated product ``act(g) * u`` (the MLP's down
  projection; act silu as in SwiGLU, or gelu's tanh form as in Gemma's GeGLU) takes g and
  u, the product formed as the kernel loads its input;
- at one row, a matmul (or group) whose input is an RMSNorm of h (``w * (h / rms(h))`` in
  h's dtype, Llama's form, or ``h / rms(h) * (1 + w)``, Gemma's) takes h and the norm's weight;
- a one-weight launch whose output is added to a residual (``h + o``, the residual stream)
  adds it in its epilogue (at one row: past it o stays with cuBLAS, and its add is fused
  with the norm after it by Inductor, which takes one kernel either way).
Measured on an H100 (benchmarks/probes/probe_linear_fusions.py at 08e33d9: bf16, Llama-1B's
shapes, 50 launches a graph, µs a launch): at one
row the norm costs q/k/v 3.7 -> 4.3 and gate/up 23.2 -> 25.9, the gate costs down 7.4 -> 9.3,
the residual o 3.6 -> 3.9, each saving an Inductor kernel (48 kernels and 78 µs of a
Llama-1B decode step at batch 1: benchmarks/probes/probe_model_step.py); at 8 rows
(``tl.dot`` tiles) the prologues cost far more (q/k/v 6.1 -> 14.4, gate/up 25.8 -> 35.4,
down 14.7 -> 130 against cuBLAS's 8.9). Past one row the pass therefore groups only.
At one row a Llama layer's decode step then makes six launches where it made nine: the
residual add with the norm after it (one Inductor kernel), twice, and the SwiGLU product.
"""

from __future__ import annotations

import operator

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

aten = torch.ops.aten
MAX_ROWS = 32                 # the rows measured (probe_linear: 1, 8, 32); more go to cuBLAS
WIDE_OUTPUT = 32768
FUSED_ROWS = 1                # the rows at which prologues and epilogues join a launch (the docstring's figures)
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


def _whole_slice(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a slice that keeps all of its input (``h[:, -0:]``, say)."""
    if node.target is not aten.slice.Tensor or node.kwargs:
        return False
    args = node.args
    t, dim = args[0], args[1] if len(args) > 1 else 0
    start, end = args[2] if len(args) > 2 else None, args[3] if len(args) > 3 else None
    step = args[4] if len(args) > 4 else 1
    tv = _val(t)
    return tv is not None and start in (None, 0) and step == 1 and (end is None or end >= tv.shape[dim])


def _through_views(node: object) -> object:
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and (
            node.target in _VIEWS or node.target is aten.alias.default or _whole_slice(node)):
        node = node.args[0]
    return node


def _gate_of(node: object, dtype: torch.dtype):
    """(g, activation) where ``node`` is act(g) rounded to ``dtype`` as a traced model computes
    it, act "silu" (``aten.silu``, or its decompositions g / (1 + exp(-g)) and g * sigmoid(g))
    or "gelu_tanh" (``aten.gelu`` with approximate="tanh", or its decomposition
    0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))), on g or on g converted to fp32; else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node.target is _CONVERT:
        if node.args[1] != dtype:
            return None
        node = node.args[0]
    elif _val(node) is None or _val(node).dtype != dtype:
        return None
    c, act = None, "silu"
    if _call(node, aten.silu.default):
        c = node.args[0]
    elif _is_gelu_tanh(node):
        c, act = node.args[0], "gelu_tanh"
    elif _call(node, aten.div.Tensor):
        c, den = node.args
        one_plus = _call(den, aten.add.Tensor) and (
            (den.args[1] == 1 and _call(den.args[0], aten.exp.default)) or
            (den.args[0] == 1 and _call(den.args[1], aten.exp.default)))
        if not one_plus:
            return None
        e = den.args[0] if den.args[1] == 1 else den.args[1]
        if not (_call(e.args[0], aten.neg.default) and e.args[0].args[0] is c):
            return None
    elif _call(node, aten.mul.Tensor):
        a, b = node.args
        if _call(b, aten.sigmoid.default) and b.args[0] is a:
            c = a
        elif _call(a, aten.sigmoid.default) and a.args[0] is b:
            c = b
        else:
            c, act = _gelu_tanh_decomposed(node), "gelu_tanh"
    if not isinstance(c, torch.fx.Node):
        return None
    if _call(c, _CONVERT) and c.args[1] == torch.float32:
        c = c.args[0]
    cv = _val(c)
    return (c, act) if cv is not None and cv.dtype == dtype else None


def _is_gelu_tanh(node: torch.fx.Node) -> bool:
    """Whether ``node`` is ``aten.gelu(g, approximate="tanh")`` (the argument positional or named)."""
    if node.op != "call_function" or node.target is not aten.gelu.default or not node.args:
        return False
    approximate = node.args[1] if len(node.args) > 1 else node.kwargs.get("approximate", "none")
    return approximate == "tanh" and set(node.kwargs) <= {"approximate"}


def _scaled(node: object, factor: float):
    """t where ``node`` is t * factor (either order, factor to fp32's precision); else None."""
    if not _call(node, aten.mul.Tensor):
        return None
    for t, f in (node.args, node.args[::-1]):
        if isinstance(t, torch.fx.Node) and isinstance(f, float) and abs(f - factor) <= 1e-7 * factor:
            return t
    return None


def _gelu_tanh_decomposed(node: torch.fx.Node):
    """g where ``node`` is (g * 0.5) * (tanh(sqrt(2 / pi) * (g + g * g * g * 0.044715)) + 1),
    the form of gelu(g, approximate="tanh") after Inductor's decompositions (factors in
    either order); else None."""
    for half, plus in (node.args, node.args[::-1]):
        g = _scaled(half, 0.5)
        if g is None or not _call(plus, aten.add.Tensor) or 1 not in plus.args:
            continue
        th = plus.args[0] if plus.args[1] == 1 else plus.args[1]
        if not _call(th, aten.tanh.default):
            continue
        inner = _scaled(th.args[0], 0.7978845608028654)
        if not _call(inner, aten.add.Tensor) or g not in inner.args:
            continue
        cube = _scaled(inner.args[1] if inner.args[0] is g else inner.args[0], 0.044715)
        if _call(cube, aten.mul.Tensor) and g in cube.args:
            sq = cube.args[1] if cube.args[0] is g else cube.args[0]
            if _call(sq, aten.mul.Tensor) and sq.args[0] is g and sq.args[1] is g:
                return g
    return None


def _call(n: object, *targets) -> bool:
    """Whether ``n`` is a call of one of ``targets`` with positional arguments only."""
    return isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target in targets and not n.kwargs


def _unwritten(n: torch.fx.Node) -> bool:
    """Whether no node of the graph writes ``n`` in place (so a launch may read it later
    than the node that read it did)."""
    return not any(_mutates(u) for u in n.users)


def _rms(node: object):
    """(h, eps) where ``node`` is h / sqrt(mean(h**2, last dim) + eps) in fp32 (h converted
    to fp32, or fp32 already); else None."""
    if not _call(node, aten.mul.Tensor):
        return None
    for cf, rs in (node.args, node.args[::-1]):
        if not _call(rs, aten.rsqrt.default) or not _call(rs.args[0], aten.add.Tensor):
            continue
        mean, eps = rs.args[0].args
        if not isinstance(eps, float) or not 0 < eps < 1 or not _call(mean, aten.mean.dim):
            continue
        sq, dims, keep = (*mean.args, False)[:3]
        cv = _val(cf)
        if cv is None or cv.dtype != torch.float32 or keep is not True or list(dims) not in ([-1], [cv.dim() - 1]):
            continue
        if not (_call(sq, aten.pow.Tensor_Scalar) and sq.args[0] is cf and sq.args[1] == 2):
            continue
        h = cf.args[0] if _call(cf, _CONVERT) else cf
        return h, eps
    return None


def _rms_norm(x: torch.fx.Node):
    """(h, w, eps, offset) where ``x`` is (a view of) an RMSNorm of h in x's dtype: Llama's
    ``w * (h / rms(h)).to(dtype)`` (offset False) or Gemma's ``(h / rms(h) * (1 + w.float())).to(dtype)``
    (offset True), h of x's dtype and contiguous, w a [K] vector; else None."""
    xv = _val(x)
    node = _through_views(x)
    found = None
    if _call(node, aten.mul.Tensor) and all(isinstance(a, torch.fx.Node) for a in node.args):
        for w, c in (node.args, node.args[::-1]):        # Llama: w * convert(h / rms(h), dtype)
            if _call(c, _CONVERT) and c.args[1] == xv.dtype and (rms := _rms(c.args[0])) is not None:
                found = (*rms, w, False)
                break
    elif _call(node, _CONVERT) and node.args[1] == xv.dtype and _call(node.args[0], aten.mul.Tensor):
        for t, plus in (node.args[0].args, node.args[0].args[::-1]):   # Gemma: convert(h / rms(h) * (1 + w), dtype)
            if (rms := _rms(t)) is not None and _call(plus, aten.add.Tensor) and 1 in plus.args:
                w = plus.args[0] if plus.args[1] == 1 else plus.args[1]
                w = w.args[0] if _call(w, _CONVERT) and w.args[1] == torch.float32 else w
                found = (*rms, w, True)
                break
    if found is None:
        return None
    h, eps, w, offset = found
    hv, wv = _val(h), _val(w)
    if hv is None or wv is None or not isinstance(w, torch.fx.Node) or not _unwritten(h) or hv.dtype != xv.dtype or \
            not hv.is_contiguous() or hv.numel() != xv.numel() or hv.shape[-1] != xv.shape[-1] or \
            wv.dim() != 1 or wv.shape[0] != xv.shape[-1] or wv.dtype not in (xv.dtype, torch.float32) or \
            wv.device != xv.device or hv.device != xv.device:
        return None
    return h, w, eps, offset


def _prologue(x: torch.fx.Node):
    """What the kernel computes its input from, where not x itself: ("gate", u, g, activation)
    for a SwiGLU / GeGLU product (``_swiglu``), ("norm", h, w, eps, offset) for an RMSNorm
    (``_rms_norm``); else None."""
    found = _swiglu(x)
    if found is not None:
        return ("gate", *found)
    found = _rms_norm(x)
    return None if found is None else ("norm", *found)


def _rows(v: torch.Tensor) -> bool:
    """Whether ``v`` views as rows of its last dim without a copy, each row contiguous (any
    row stride: a half of a fused gate/up projection's output, as Phi-3 splits it)."""
    if v.shape[-1] > 1 and v.stride(-1) != 1:
        return False
    try:
        v.view(-1, v.shape[-1])
    except RuntimeError:
        return False
    return True


def _swiglu(x: torch.fx.Node):
    """(u, g, activation) where ``x`` is (a view of) act(g) * u (``_gate_of``), both of x's
    shape and dtype, each a view of rows (``_rows``: the model's tensors, or halves of one
    fused gate/up output; the caller views them as x); else None."""
    xv = _val(x)
    mul = _through_views(x)
    if not (isinstance(mul, torch.fx.Node) and mul.op == "call_function" and mul.target is aten.mul.Tensor
            and not mul.kwargs and all(isinstance(a, torch.fx.Node) for a in mul.args)):
        return None
    for s_node, u in (mul.args, mul.args[::-1]):
        found = _gate_of(s_node, xv.dtype)
        if found is None:
            continue
        g, act = found
        gv, uv, mv = _val(g), _val(u), _val(mul)
        if gv is None or uv is None or mv is None or tuple(gv.shape) != tuple(mv.shape) or \
                tuple(uv.shape) != tuple(mv.shape) or uv.dtype != xv.dtype or gv.device != xv.device or \
                uv.device != xv.device or not _rows(gv) or not _rows(uv) or \
                mv.numel() != xv.numel() or not _unwritten(g) or not _unwritten(u):
            return None
        return u, g, act
    return None


def _candidate(node: torch.fx.Node, devices: tuple[str, ...], fusions: bool):
    """(x, w, bias or None, prologue or None) where ``node`` is x @ w.T (+ bias) that
    small_linear can run; the last, what x is made of (``_prologue``), looked for with
    ``fusions`` at one row only (see the module's docstring)."""
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
    return x, w, bias, _prologue(x) if fusions and xv.shape[0] == FUSED_ROWS else None


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


def group_small_linears(graph: torch.fx.Graph, devices: tuple[str, ...] = ("cuda",), fusions: bool = True) -> int:
    """Rewrite ``graph`` in place (see the module's docstring); returns how many matmuls
    went to small_linear. ``fusions``: False leaves norms, residual adds and SwiGLU products
    out of the launches (the grouping alone)."""
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
        found = _candidate(node, devices, fusions)
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
            x, pro = first[1], first[4]       # the first matmul's input: defined before it
            rows = _val(x).shape[0]
            wide = sum(_val(m[2]).shape[0] for m in group) >= WIDE_OUTPUT
            if rows > 1 and len(group) == 1 and not wide:
                continue                      # one narrow weight over several rows: cuBLAS is faster
            with graph.inserting_before(first[0]):
                # the call's arguments: x, weights, biases, constant_weights, gate, norm_weight,
                # norm_eps, norm_offset, residual (set by _add_residuals), activation
                args = [x, [m[2] for m in group], [m[3] for m in group], all(_constant(m[2]) for m in group),
                        None, None, 1e-6, False, None, "silu"]
                if pro is not None and pro[0] == "gate":     # u and g viewed as x: (u, ..., gate=g), act
                    args[0], args[4] = (_view_as(graph, t, x) for t in pro[1:3])
                    args[9] = pro[3]
                elif pro is not None:                        # h viewed as x, the norm's weight, eps, offset
                    args[0], args[5:8] = _view_as(graph, pro[1], x), pro[2:]
                call = graph.call_function(torch.ops.graphrt.small_linear.default, tuple(args))
                call.meta["val"] = [_val(m[0]) for m in group]
                for i, (mm, *_rest) in enumerate(group):
                    item = graph.call_function(operator.getitem, (call, i))
                    item.meta["val"] = _val(mm)
                    mm.replace_all_uses_with(item)
            for mm, *_rest in group:
                inputs = mm.all_input_nodes
                graph.erase_node(mm)
                _drop_unused(graph, inputs)   # the transposed weight; a SwiGLU product, a norm now unread
                replaced += 1
    if fusions:
        _add_residuals(graph)
    return replaced


def _view_as(graph: torch.fx.Graph, t: torch.fx.Node, like: torch.fx.Node) -> torch.fx.Node:
    """A reshape of ``t`` to ``like``'s shape, inserted at the graph's insertion point."""
    node = graph.call_function(aten.reshape.default, (t, list(_val(like).shape)))
    node.meta["val"] = _val(t).reshape(_val(like).shape)
    return node


def _residual_add(y: torch.fx.Node, at: torch.fx.Node, order: dict):
    """(v, add, r) where ``y``, a [M, N] product, is read only through one view ``v`` (and a
    clone: an eval-mode dropout; then ``v`` is the clone) by ``add`` = r + v, r of v's shape
    and dtype, contiguous, unwritten and defined before node ``at``; else None."""
    view = next(iter(y.users)) if len(y.users) == 1 else None
    if not _call(view, *_VIEWS) or len(view.users) != 1:
        return None
    (add,) = view.users
    if _call(add, aten.clone.default) and len(add.users) == 1:   # an eval-mode dropout (Phi-3) in between
        view, (add,) = add, add.users
    if not _call(add, aten.add.Tensor) or view not in add.args or len(set(add.args)) != 2:
        return None
    r = add.args[0] if add.args[1] is view else add.args[1]
    rv, vv, av = _val(r), _val(view), _val(add)
    if not isinstance(r, torch.fx.Node) or rv is None or vv is None or av is None or \
            tuple(rv.shape) != tuple(vv.shape) or rv.dtype != vv.dtype or av.dtype != vv.dtype or \
            not rv.is_contiguous() or order.get(r, len(order)) >= order[at] or not _unwritten(r):
        return None
    return view, add, r


def _add_residuals(graph: torch.fx.Graph) -> None:
    """Each one-weight small_linear call of one row whose output is read only by a residual
    add (``_residual_add``) adds the residual in its epilogue: the add's readers read the view
    (the clone) of the call's output instead."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for call in [n for n in graph.nodes if n.target is torch.ops.graphrt.small_linear.default]:
        if len(call.args) < 9 or len(call.args[1]) != 1 or call.args[8] is not None or len(call.users) != 1 or \
                _val(call.args[0]).shape[0] != FUSED_ROWS:
            continue
        (item,) = call.users
        found = _residual_add(item, call, order)
        if found is None:
            continue
        view, add, r = found
        with graph.inserting_before(call):
            call.update_arg(8, _view_as(graph, r, item))
        add.replace_all_uses_with(view)
        graph.erase_node(add)


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

    def __init__(self, fusions: bool = True) -> None:
        self.fusions = fusions
        self.replaced = 0          # matmuls rewritten by the compiles this pass ran in

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.replaced += group_small_linears(graph, fusions=self.fusions)

    def uuid(self) -> bytes:
        from graphrt.kernels import linear

        return get_hash_for_files((__file__, linear.__file__)) + (b"+fusions" if self.fusions else b"")
