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


def _candidate(node: torch.fx.Node, devices: tuple[str, ...]):
    """(x, w, bias or None) where ``node`` is x @ w.T (+ bias) that small_linear can run."""
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
    return x, w, bias


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


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
            by_input.setdefault(_input_key(found[0]), []).append((node, *found))
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
            x = first[1]                      # the first matmul's input: defined before it
            rows = _val(x).shape[0]
            wide = sum(_val(m[2]).shape[0] for m in group) >= WIDE_OUTPUT
            if rows > 1 and len(group) == 1 and not wide:
                continue                      # one narrow weight over several rows: cuBLAS is faster
            with graph.inserting_before(first[0]):
                call = graph.call_function(torch.ops.graphrt.small_linear.default,
                                           (x, [m[2] for m in group], [m[3] for m in group],
                                            all(_constant(m[2]) for m in group)))
                call.meta["val"] = [_val(m[0]) for m in group]
                for i, (mm, *_rest) in enumerate(group):
                    item = graph.call_function(operator.getitem, (call, i))
                    item.meta["val"] = _val(mm)
                    mm.replace_all_uses_with(item)
            for mm, *_rest in group:
                transposed = mm.args[-1]
                graph.erase_node(mm)
                if not transposed.users:
                    graph.erase_node(transposed)
                replaced += 1
    return replaced


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
