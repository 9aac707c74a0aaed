"""A pytest plugin that notes every Triton launch the CPU tests make under the interpreter
(kernel, argument types, constexpr values) and keeps a covering few of them for
``_compile_for_gpu.py --launches`` to compile for an sm_90 GPU: per kernel, launches
chosen greedily until every switch value (bool constexpr, or an int one in MODES) and pointer type the tests
used, and every pair of them that occurred together, is in one of the chosen:

    TRITON_INTERPRET=1 GRAPHRT_LAUNCHES=/tmp/launches.json PYTHONPATH=tests \\
        python -m pytest -p _record_launches tests/test_paged_attention.py ...

An int argument is noted with its type and whether it is 1 (which a launch specialises
to a constant unless the kernel says not to); a tensor descriptor with its block shape.
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
from collections import defaultdict

import pytest

_SEEN: dict[str, dict] = {}


def _value(v):
    """A constexpr value as JSON (a Triton dtype by name)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    import triton.language as tl

    if isinstance(v, tl.dtype):
        return {"dtype": str(v)}
    if isinstance(v, tl.constexpr):
        return _value(v.value)
    return {"repr": repr(v)}


def _note(fn, args, kwargs) -> None:
    from triton.runtime.jit import mangle_type

    sig = inspect.signature(fn)
    bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
    bound.apply_defaults()
    params, constexprs = {}, {}
    for name, p in sig.parameters.items():
        value = bound.arguments.get(name)
        if "constexpr" in str(p.annotation):
            constexprs[name] = _value(value)
        elif value is None:
            constexprs[name] = None
        elif isinstance(value, bool):
            params[name] = ["u1", False]
        else:
            params[name] = [mangle_type(value), isinstance(value, int) and value == 1]
    entry = dict(module=fn.__module__, name=fn.__name__, params=params, constexprs=constexprs)
    _SEEN.setdefault(json.dumps(entry, sort_keys=True), entry)


def pytest_configure(config):
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise pytest.UsageError("_record_launches records interpreted launches: set TRITON_INTERPRET=1")
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def noting(self, *args, grid, warmup, **kwargs):
        _note(self.fn, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = noting


def pytest_unconfigure(config):
    """Each xdist worker writes its own file; the controller (or a run without workers)
    merges them into GRAPHRT_LAUNCHES."""
    path = os.environ.get("GRAPHRT_LAUNCHES")
    if not path:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        with open(f"{path}.{worker}", "w") as f:
            json.dump(list(_SEEN.values()), f)
        return
    import glob

    for part in glob.glob(f"{glob.escape(path)}.gw*"):
        for entry in json.load(open(part)):
            _SEEN.setdefault(json.dumps(entry, sort_keys=True), entry)
        os.remove(part)
    entries = sorted(_SEEN.values(), key=lambda e: json.dumps(e, sort_keys=True))
    if os.environ.get("GRAPHRT_LAUNCHES_ALL"):          # every distinct launch, before the cover
        with open(os.environ["GRAPHRT_LAUNCHES_ALL"], "w") as f:
            json.dump(entries, f)
    with open(path, "w") as f:
        json.dump(cover(entries), f, indent=0)


MODES = {"GATED", "NORM"}     # int constexprs that pick a code path (small_linear's), switches as bools are
SWITCHES = {"ROPE_DIM"}       # int constexprs that turn a code path on when not 0 (the attention's rotary embedding)


def _features(entry: dict) -> set:
    """A launch's switch values (bool constexprs and ``MODES``) and pointer types, alone and
    in pairs."""
    items = sorted((k, v if k not in SWITCHES else v != 0) for k, v in entry["constexprs"].items()
                   if isinstance(v, bool) or k in MODES or k in SWITCHES)
    items += [(f"*{name}", t) for name, (t, _) in entry["params"].items() if t.startswith(("*", "tensordesc"))]
    return {(x,) for x in items} | set(itertools.combinations(items, 2))


def cost(entry: dict) -> int:
    """A launch's compile cost, roughly: its tiles' size (the product of its BLOCK* and
    HEAD_DIM_PAD constants; fp32 dots with large tiles took minutes for sm_90)."""
    size = 1
    for name, value in entry["constexprs"].items():
        if (name.startswith("BLOCK") or name == "HEAD_DIM_PAD") and isinstance(value, int) and value > 0:
            size *= value
    return size


def cover(entries: list[dict]) -> list[dict]:
    """Per kernel, the launches a greedy weighted set cover of their features picks (most
    new features per ``cost``, the first of equals in ``entries``' order): every single and
    pair that occurred is in one."""
    by_kernel = defaultdict(list)
    for e in entries:
        by_kernel[(e["module"], e["name"])].append(e)
    chosen = []
    for key in sorted(by_kernel):
        es = by_kernel[key]
        feats = [_features(e) for e in es]
        need = set().union(*feats)
        while need:
            i = max(range(len(es)), key=lambda j: len(feats[j] & need) / cost(es[j]))
            need -= feats[i]
            chosen.append(es[i])
    return chosen
