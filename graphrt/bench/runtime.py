"""Host and wall time of a graphrt step (stage -> one pinned copy -> replay), and what NVTX adds.

host_us: host time of rt.step minus any wait for a free staging slot (the host's own work
per step; in a GPU-bound loop the ring makes the host wait, which is not its cost), the
median of five rounds' medians of 200 steps each, each round's kept (host_us_rounds): the
spread says how far one run's figure can be trusted;
gpu_us: GPU time of the step alone (its graph replayed back to back, timed with events;
CUDA only); wall_us: steady-state time per step over a run of steps, GPU included;
host_idle_us: host time of one rt.step started on an idle GPU (synchronised before each,
untimed; CUDA only): the host's own cost with no queued work that a launch could wait
behind; host_bound: host_us > gpu_us, the cells where the host sets the pace; h2d_bytes:
the step's one host-to-device copy; nvtx_extra_us: host µs NVTX ranges add to a step,
the same runtime's tracer switched off and on in alternating runs of steps (the median of
on minus off over the pairs; None without the nvtx package): separate runtimes differed
by more than that between cells. The Step is built inside the timed call (from_arrays).
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from graphrt.bench.common import decode_arrays, progress, quick_out_main, summarize_rounds, toy_runtime, write

ROUNDS = 5


def run(*, quick: bool, out: Path, quiet: bool = False) -> list[dict]:
    from graphrt import Step

    cuda = torch.cuda.is_available()
    small = quick or not cuda
    layers_list, batches, context, steps = ([1, 2], [1, 4], 48, 3) if small else ([1, 8, 32], [1, 8, 64, 256], 1024,
                                                                                    200)
    rounds = 2 if small else ROUNDS
    rows = []
    rt = None
    for layers in layers_list:
        # the previous runtime goes first (it holds a reference cycle: without a
        # collection its graphs and caches would stay alive beside this one)
        del rt
        gc.collect()
        rt = toy_runtime(layers, max(batches), context, small=small)
        cfg = rt.cfg
        rt.capture(decode_buckets=batches, mixed_buckets=[cfg.max_num_tokens], quiet=True)
        for batch in progress(batches, f"runtime L={layers}", quiet):
            arrays = decode_arrays(batch, context, cfg.block_size)
            ids = np.arange(batch) % 1000

            def one_step():
                step = Step.from_arrays(**arrays)
                return rt.step(step, ids)

            def host_us(n: int) -> float:
                """Median host µs of n back-to-back steps, ring waits taken out."""
                host = []
                for _ in range(n):
                    waited = rt.buffers.wait_seconds
                    t0 = time.perf_counter()
                    one_step()
                    host.append(time.perf_counter() - t0 - (rt.buffers.wait_seconds - waited))
                return 1e6 * statistics.median(host)

            for _ in range(3):
                one_step()
            if cuda:
                torch.cuda.synchronize()
            t_start = time.perf_counter()
            host_rounds = [host_us(steps)]
            if cuda:
                torch.cuda.synchronize()
            wall_us = 1e6 * (time.perf_counter() - t_start) / steps
            host_rounds += [host_us(steps) for _ in range(rounds - 1)]
            host_idle_us = None
            if cuda:
                idle = []
                for _ in range(min(steps, 100)):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    one_step()
                    idle.append(time.perf_counter() - t0)
                host_idle_us = 1e6 * statistics.median(idle)
            nvtx_extra = _nvtx_extra_us(rt, host_us, pairs=3 if small else 10, n=3 if small else 20)
            gpu_us = _replay_us(rt, steps) if cuda and rt.last.mode == "replay" else None
            row = dict(bench="runtime", impl="graphrt_graph" if rt.last.mode == "replay" else "graphrt_eager",
                       layers=layers, batch=batch, context=context, rounds=rounds)
            summarize_rounds(row, "host_us", host_rounds)
            row.update(host_idle_us=host_idle_us, nvtx_extra_us=nvtx_extra, gpu_us=gpu_us, wall_us=wall_us,
                       host_bound=None if gpu_us is None else row["host_us"] > gpu_us, h2d_bytes=rt.last.copy_bytes)
            rows.append(row)
    for r in rows:
        gpu = "      -" if r["gpu_us"] is None else f"{r['gpu_us']:7.1f}"
        idle = "" if r["host_idle_us"] is None else f" (idle GPU {r['host_idle_us']:6.1f})"
        nvtx = "" if r["nvtx_extra_us"] is None else f"  NVTX {r['nvtx_extra_us']:+.1f} us"
        spread = f" [{min(r['host_us_rounds']):.1f}-{max(r['host_us_rounds']):.1f}]"
        print(f"L={r['layers']:3d} batch={r['batch']:4d} {r['impl']}: host {r['host_us']:7.1f}{spread}{idle} us{nvtx}  "
              f"gpu {gpu} us  wall {r['wall_us']:8.1f} us  copy {r['h2d_bytes']} B"
              f"{'  host-bound' if r['host_bound'] else ''}")
    path = write(out, "runtime" if not small else "runtime_quick", rows)
    if not quiet:
        print(f"wrote {path}")
    return rows


def _nvtx_extra_us(rt, host_us, *, pairs: int, n: int) -> float | None:
    """Median over ``pairs`` of (host µs with the runtime's NVTX ranges on - off), each
    side ``host_us(n)``; the runtime's tracer is put back as it was."""
    from graphrt.tracing import Tracer

    try:
        on = Tracer(True)
    except ImportError:
        return None
    off, diffs = rt.tracer, []
    try:
        for _ in range(pairs):
            rt.tracer = off
            a = host_us(n)
            rt.tracer = on
            diffs.append(host_us(n) - a)
    finally:
        rt.tracer = off
    return statistics.median(diffs)


def _replay_us(rt, steps: int) -> float:
    """GPU µs of the last step's graph alone: ``steps`` replays queued back to back (the
    host launches far faster than they run), timed with events."""
    graph = rt.graphs.graphs[rt.last.bucket]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rt.graphs.replay(graph)
    start.record()
    for _ in range(steps):
        rt.graphs.replay(graph)
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / steps


def main(argv: list[str] | None = None) -> None:
    quick_out_main(run, __doc__, argv)
