"""What the host's elementary operations cost on this machine, and where ``rt.step``'s
host time goes (a profile of the whole call): the facts behind the host-path work.

    python benchmarks/probes/probe_host_ops.py [--out DIR]

Prints the median µs of single numpy / torch / CUDA-runtime operations of the kinds the
step path uses (each timed alone, many times), then ``cProfile``'s per-function totals over
2000 ``rt.step`` calls of a one-layer toy model at batch 1 and 256 (profiling inflates
small calls; read the shares, not the absolute figures). Writes ``probe_host_ops.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
from pathlib import Path

import numpy as np
import torch

from graphrt.bench.common import captured_decode, env, host_median_us


def elementary(reps: int) -> dict:
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    a = np.arange(256, dtype=np.int64)
    b = np.zeros(256, np.int64)
    pinned = torch.zeros(1 << 16, dtype=torch.uint8, pin_memory=cuda)
    arena = torch.zeros(1 << 16, dtype=torch.uint8, device=dev)
    ops = {
        "python_call": lambda: None,
        "np_asarray": lambda: np.asarray(a),
        "np_astype_copy_false": lambda: a.astype(np.int64, copy=False),
        "np_sum": lambda: a.sum(),
        "np_slice_assign": lambda: b.__setitem__(slice(0, 256), a),
        "np_cumsum": lambda: np.cumsum(a),
        "np_tolist_256": lambda: a.tolist(),
        "torch_slice": lambda: arena[:4096],
        "torch_data_ptr": lambda: arena.data_ptr(),
        "torch_copy_h2d_4k": lambda: arena[:4096].copy_(pinned[:4096], non_blocking=True),
    }
    if cuda:
        event = torch.cuda.Event()
        stream = torch.cuda.current_stream()
        ops["cuda_current_stream"] = torch.cuda.current_stream
        ops["cuda_event_record"] = event.record
        ops["cuda_event_record_stream"] = lambda: event.record(stream)
        ops["cuda_event_query"] = event.query
        g = torch.cuda.CUDAGraph()
        x = torch.zeros(16, device=dev)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            x.add_(1)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            x.add_(1)
        ops["cuda_graph_replay_1node"] = g.replay
        try:
            from graphrt._fast import copy_h2d
        except ImportError:
            copy_h2d = None
        if copy_h2d is not None:          # the step's copy + event through the driver (StepBuffers.copy)
            event.record(stream)
            args = (arena.data_ptr(), pinned.data_ptr(), 4096, stream.cuda_stream, event.cuda_event)
            ops["driver_copy_h2d_4k_and_record"] = lambda: copy_h2d(*args)
            ops["torch_copy_h2d_4k_and_record"] = lambda: (arena[:4096].copy_(pinned[:4096], non_blocking=True),
                                                           event.record(stream))
    try:
        import nvtx

        def nvtx_range():
            with nvtx.annotate("stage decode[seqs=8,tokens=8] seqs=5 tokens=5", domain="graphrt"):
                pass

        ops["nvtx_annotate_range"] = nvtx_range
    except ImportError:
        pass
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    return {name: host_median_us(fn, reps, sync) for name, fn in ops.items()}


def profile_steps(layers: int, batch: int, calls: int) -> str:
    from graphrt import Step

    cuda = torch.cuda.is_available()
    rt, arrays, ids = captured_decode(layers, batch, 1024 if cuda else 48, small=not cuda)
    for _ in range(20):
        rt.step(Step.from_arrays(**arrays), ids)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(calls):
        rt.step(Step.from_arrays(**arrays), ids)
        if cuda and i % 50 == 49:
            torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(28)
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    ops = elementary(2000)
    for name, us in ops.items():
        print(f"{name:28s} {us:7.2f} us")
    # an NVTX injection library (a profiler's) makes every range call into it
    injection = {k: v for k, v in os.environ.items() if k.startswith("NVTX_INJECTION")}
    print(f"NVTX injection variables: {injection or 'none'}")
    profiles = {}
    cuda = torch.cuda.is_available()
    if not cuda:
        print("no CUDA device: steps would run eagerly through the interpreter, so no step profile")
    for layers, batch in ((1, 1), (1, 256)) if cuda else ():
        text = profile_steps(layers, batch, 2000)
        profiles[f"L{layers}_b{batch}"] = text
        print(f"--- cProfile, {layers} layer(s), batch {batch}, tottime order\n{text}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe_host_ops.json").write_text(json.dumps(dict(env=env(), ops_us=ops, nvtx_injection=injection,
                                                                  profiles=profiles), indent=1))


if __name__ == "__main__":
    main()
