"""An Inductor graph pass: a compiled decode step's rotary embedding of q and k moved into
graphrt's attention launch.

A transformers decoder rotates each layer's q and k (``q * cos + rotate_half(q) * sin``,
rotate_half(x) = cat(-x2, x1) over the halves of the rotated columns) just before its
attention. Compiled, that is one or two Inductor kernels a layer, each a launch (and a gap)
for a few kilobytes at decode sizes: on an H100, two kernels of about 1.4 µs a layer of a
Llama-1B decode step at batch 1 (benchmarks/probes/probe_model_step.py at 4e5458e). The
decode launch of ``paged_attention_new_kv`` already loads q and writes the new k itself, so
this pass hands it the unrotated q and k and the step's cos/sin rows (``rope_cos``,
``rope_sin``), and the launch rotates them as it loads them (``paged_attention``'s
``rope``): in fp32, rounded once to q's dtype, as Inductor's fused kernel of the
expression computes it.

What it recognises, in the forward graph AOTAutograd makes (post-grad, before Inductor's
own passes), for each ``paged_attention_new_kv`` with ``max_query_len=1``:
- q (and k) reached from the rotation through layout ops only (select, permute, views,
  unsqueeze/squeeze, clone), which together take [1, H, T, D] to [T, H, D] as
  ``x[0].transpose(0, 1)`` does (checked by running them on an index tensor);
- the rotation ``add(mul(x, C), mul(cat([neg(x[..., R/2:]), x[..., :R/2]], -1), S))`` (any
  operand order), or with partial rotary ``cat([that on x[..., :R], x[..., R:]], -1)``;
- C and S broadcast as [1, 1, T, R] (or [1, T, R]) from one table each, shared by q and k,
  in q's dtype or float32, and x in q's dtype.
Anything else stays as it was.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

aten = torch.ops.aten
_LAYOUT = {aten.select.int, aten.permute.default, aten.view.default, aten._unsafe_view.default,
           aten.reshape.default, aten.unsqueeze.default, aten.squeeze.dim, aten.clone.default,
           aten.transpose.int, aten.expand.default}


def _val(node: object):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _call(node: object, *targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _slice_of(node: object) -> tuple[torch.fx.Node, int, int] | None:
    """(x, start, end) where ``node`` is x sliced along its last dim (end clipped to it)."""
    if not _call(node, aten.slice.Tensor) or node.kwargs:
        return None
    x, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
    start = node.args[2] if len(node.args) > 2 else None
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    xv = _val(x)
    if xv is None or step != 1 or dim not in (-1, xv.dim() - 1):
        return None
    width = xv.shape[-1]
    start, end = start or 0, width if end is None else end
    start, end = (min(max(i + width if i < 0 else i, 0), width) for i in (start, end))   # as Python clips them
    return x, start, end


def _rotate_half_of(node: object, half: int) -> torch.fx.Node | None:
    """x where ``node`` is ``cat([neg(x[..., half:]), x[..., :half]], -1)`` over x of 2 * half columns."""
    if not _call(node, aten.cat.default):
        return None
    parts, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
    xv = _val(node)
    if len(parts) != 2 or xv is None or dim not in (-1, xv.dim() - 1) or not _call(parts[0], aten.neg.default):
        return None
    hi, lo = _slice_of(parts[0].args[0]), _slice_of(parts[1])
    if hi is None or lo is None or hi[0] is not lo[0] or hi[1:] != (half, 2 * half) or lo[1:] != (0, half):
        return None
    return hi[0]


def _same(a: object, b: torch.fx.Node) -> bool:
    """Whether a and b are one value: one node, or two slices of one node alike (a graph
    not yet deduplicated holds ``x[..., :r]`` written twice as two nodes)."""
    if a is b:
        return True
    sa, sb = _slice_of(a), _slice_of(b)
    return sa is not None and sa == sb


def _rotation_of(node: object) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(x, C, S) where ``node`` is ``x * C + rotate_half(x) * S`` (operands in any order)."""
    if not _call(node, aten.add.Tensor) or len(node.args) != 2 or node.kwargs:
        return None
    xv = _val(node)
    if xv is None or xv.shape[-1] % 2:
        return None
    half = xv.shape[-1] // 2
    for plain, turned in (node.args, node.args[::-1]):
        if not (_call(plain, aten.mul.Tensor) and _call(turned, aten.mul.Tensor)):
            continue
        for x, c in (plain.args, plain.args[::-1]):
            for r, s in (turned.args, turned.args[::-1]):
                if isinstance(x, torch.fx.Node) and _same(_rotate_half_of(r, half), x):
                    return x, c, s
    return None


def _rotated(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node, int] | None:
    """(x, C, S, R) where ``node`` is x ([..., D]) with its first R columns rotated: the whole
    rotation, or ``cat([rotation of x[..., :R], x[..., R:]], -1)``."""
    found = _rotation_of(node)
    if found is not None:
        return (*found, _val(node).shape[-1])
    if not _call(node, aten.cat.default) or len(node.args[0]) != 2:
        return None
    rot, rest = node.args[0]
    found, tail = _rotation_of(rot), _slice_of(rest)
    if found is None or tail is None:
        return None
    x_r, c, s = found
    head = _slice_of(x_r)
    width = _val(rot).shape[-1]
    if head is None or head[0] is not tail[0] or head[1:] != (0, width) or tail[1:] != (width, _val(tail[0]).shape[-1]):
        return None
    return tail[0], c, s, width


def _layout_chain(arg: torch.fx.Node) -> tuple[list[torch.fx.Node], torch.fx.Node]:
    """The layout ops from ``arg`` back to the first node that is not one (innermost last), and that node."""
    chain = []
    node = arg
    while _call(node, *_LAYOUT):
        chain.append(node)
        node = node.args[0]
    return chain, node


def _is_head_transpose(chain: list[torch.fx.Node], shape: tuple[int, ...]) -> bool:
    """Whether the layout ops ``chain`` (outermost first) take a [1, H, T, D] tensor to its
    [T, H, D] transpose, ``x[0].transpose(0, 1)``: run on an index tensor."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if len(shape) != 4 or shape[0] != 1 or not all(isinstance(n, int) for n in shape):
        return False
    with unset_fake_temporarily():          # (a compiler's pass runs under the fake mode)
        x = torch.arange(shape[1] * shape[2] * shape[3]).view(shape)
        out = x
        try:
            for node in reversed(chain):
                out = node.target(out, *node.args[1:], **node.kwargs)
        except Exception:   # noqa: BLE001 (a layout op this check cannot replay: not recognised)
            return False
        return tuple(out.shape) == (shape[2], shape[1], shape[3]) and torch.equal(out, x[0].transpose(0, 1))


def _table(c: object, tokens: int, width: int) -> tuple[torch.fx.Node, int] | None:
    """(the [1, 1, T, R] or [1, T, R] broadcast's source, its leading ones) for a cos/sin operand."""
    cv = _val(c)
    if cv is None or tuple(cv.shape[-2:]) != (tokens, width) or cv.dim() not in (3, 4) \
            or any(n != 1 for n in cv.shape[:-2]):
        return None
    return c, cv.dim() - 2


def _unrotated(arg: object, dtype: torch.dtype):
    """(x, C, S, R, ones) where the op's q/k argument ``arg`` is x rotated and transposed as
    the module doc says; None where it is not."""
    if not isinstance(arg, torch.fx.Node):
        return None
    chain, root = _layout_chain(arg)
    found = _rotated(root)
    if found is None:
        return None
    x, c, s, width = found
    xv = _val(x)
    if xv is None or xv.dtype != dtype or _val(root).dtype != dtype or not _is_head_transpose(chain, tuple(xv.shape)):
        return None
    tables = [_table(t, xv.shape[2], width) for t in (c, s)]
    if None in tables or any(_val(t).dtype not in (dtype, torch.float32) for t in (c, s)):
        return None
    return x, c, s, width, tables[0][1]


def _source(node: torch.fx.Node) -> torch.fx.Node:
    """``node`` without the unsqueezes around it (two layers' broadcasts of one table)."""
    while _call(node, aten.unsqueeze.default):
        node = node.args[0]
    return node


def _attention_new_kv(node: torch.fx.Node) -> bool:
    from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2

    return (node.op == "call_function" and node.target in (auto_functionalized, auto_functionalized_v2)
            and node.args and node.args[0] is torch.ops.graphrt.paged_attention_new_kv.default)


def fuse_rope(graph: torch.fx.Graph) -> int:
    """Rewrite ``graph``'s decode attention launches to rotate q and k themselves (module
    doc); returns how many it rewrote. The rotation's own nodes are left to dead-code
    elimination where nothing else reads them."""
    count = 0
    for node in list(graph.nodes):
        if not _attention_new_kv(node):
            continue
        kw = node.kwargs
        if kw.get("max_query_len") != 1 or kw.get("rope_cos") is not None or kw.get("rope_sin") is not None:
            continue
        qv = _val(kw.get("q"))
        if qv is None:
            continue
        q, k = _unrotated(kw["q"], qv.dtype), _unrotated(kw["k"], qv.dtype)
        if q is None or k is None or q[3] != k[3] or any(_source(a) is not _source(b) for a, b in zip(q[1:3], k[1:3])):
            continue
        with graph.inserting_before(node):
            def transposed(x: torch.fx.Node) -> torch.fx.Node:
                picked = graph.call_function(aten.select.int, (x, 0, 0))
                return graph.call_function(aten.permute.default, (picked, [1, 0, 2]))

            def rows(t: torch.fx.Node, ones: int) -> torch.fx.Node:
                for _ in range(ones):
                    t = graph.call_function(aten.select.int, (t, 0, 0))
                return t

            new = dict(kw, q=transposed(q[0]), k=transposed(k[0]), rope_cos=rows(q[1], q[4]),
                       rope_sin=rows(q[2], q[4]))
        changed = ("q", "k", "rope_cos", "rope_sin")
        for name in changed:
            _set_val(new[name])
        node.kwargs = new
        if "eager_input_vals" in node.meta:
            # the values Inductor re-traces the op's call with (its decomposition of
            # auto_functionalized): an argument missing there would be dropped as None
            args, kwargs = node.meta["eager_input_vals"]
            node.meta["eager_input_vals"] = (args, {**kwargs, **{name: new[name].meta["val"] for name in changed}})
        count += 1
    return count


def _set_val(node: torch.fx.Node) -> None:
    """The fake value of a node this pass made (Inductor's lowering reads ``meta['val']``)."""
    if not _call(node, aten.select.int, aten.permute.default):
        return
    src = node.args[0]
    if "val" not in src.meta:
        _set_val(src)
    node.meta["val"] = node.target(src.meta["val"], *node.args[1:])


class RopePass(CustomGraphPass):
    """``fuse_rope`` as one of Inductor's ``post_grad_custom_pre_pass`` steps (its uuid,
    from this file and the attention kernel's, keys Inductor's on-disk cache)."""

    def __init__(self) -> None:
        self.replaced = 0          # attention launches rewritten by the compiles this pass ran in

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.replaced += fuse_rope(graph)

    def uuid(self) -> bytes:
        from graphrt.kernels import _attention_jit

        return get_hash_for_files((__file__, _attention_jit.__file__))
