"""Where the host time of ``rt.step`` goes inside a running loop: each piece timed in place.

    python benchmarks/probes/probe_step_host.py [--out DIR]

``graphrt bench host`` times each piece alone; this wraps the pieces of the real call
(``Step.validate``, ``GraphSet.pick``, ``GraphSet.check_guard``, ``StepBuffers.pack``
with its ring wait counted apart, ``StepBuffers.copy``, ``GraphSet.replay``) with clocks
and runs ``Step.from_arrays`` + ``rt.step`` in a loop, for the toy model at 1 and 32
layers, batch 1 and 256, in two regimes: back to back (the GPU-bound loop of ``bench
runtime``) and with the GPU idle before each step (synchronised, untimed). Prints the
median µs of each piece and of the rest of the call; the wrappers add ~0.3 µs each.
Writes ``probe_step_host.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from graphrt.bench.common import captured_decode, env

PIECES = ("validate", "pick", "check_guard", "pack", "ring_wait", "copy", "replay")


def timed(owner, name: str, sink: dict, key: str | None = None):
    """Wrap owner.name so that each call's seconds go to sink[key or name] (a list)."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sink.setdefault(key or name, []).append(time.perf_counter() - t0)

    setattr(owner, name, wrapper)
    return original


def probe(layers: int, batch: int, steps: int, idle: bool, cuda: bool) -> dict:
    from graphrt import Step

    context = 1024 if cuda else 48
    rt, arrays, ids = captured_decode(layers, batch, context, small=not cuda)
    cfg = rt.cfg
    sink: dict[str, list[float]] = {}
    validate = timed(Step, "validate", sink)              # on the class: every Step of the loop
    timed(rt.buffers, "pack", sink)
    timed(rt.buffers, "copy", sink)
    if rt.graphs is not None:
        for name in ("pick", "check_guard", "replay"):
            timed(rt.graphs, name, sink)
    try:
        totals, builds = [], []
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        for i in range(steps + 5):
            if idle:
                sync()
            waited = rt.buffers.wait_seconds
            t0 = time.perf_counter()
            step = Step.from_arrays(**arrays)
            t1 = time.perf_counter()
            rt.step(step, ids)
            t2 = time.perf_counter()
            sink.setdefault("ring_wait", []).append(rt.buffers.wait_seconds - waited)
            if i >= 5:
                builds.append(t1 - t0)
                totals.append(t2 - t0)
        sync()
    finally:
        Step.validate = validate
    row = dict(layers=layers, batch=batch, regime="idle GPU" if idle else "back to back", mode=rt.last.mode,
               from_arrays_us=1e6 * statistics.median(builds), total_us=1e6 * statistics.median(totals))
    named = 0.0
    for piece in PIECES:
        values = sink.get(piece, [])[-steps:]
        if values:
            us = 1e6 * statistics.median(values)
            if piece == "pack":         # the ring wait happens inside pack: report it apart
                us -= 1e6 * statistics.median(sink["ring_wait"][-steps:])
            row[f"{piece}_us"] = us
            named += us
    row["rest_us"] = row["total_us"] - row["from_arrays_us"] - named
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    cells = [(1, 1), (1, 256), (32, 1), (32, 256)] if cuda else [(1, 1), (1, 4)]
    rows = []
    for layers, batch in cells:
        for idle in (False, True):
            row = probe(layers, batch, 300 if cuda else 3, idle, cuda)
            rows.append(row)
            print("  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe_step_host.json").write_text(json.dumps(dict(env=env(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
