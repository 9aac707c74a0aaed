"""Shared by the benchmarks: run facts, timing, profiler counts, JSON and plots."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from graphrt.profiling import RING_WAIT, SYNC_CALLS


def card_name() -> str:
    """The GPU as a short lowercase name ("h200", "h100"; the whole device name, slugged,
    for a card without a model number of that form), or "cpu"."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    model = re.search(r"\b([a-z]{1,2}\d{2,4}[a-z]?)\b", name.replace("nvidia", ""))
    return model.group(1) if model else re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def default_out() -> Path:
    """benchmarks/results/<card> (``card_name``): an H100's run never lands among the H200's."""
    return Path("benchmarks") / "results" / card_name()


def env() -> dict:
    """Run facts. The commit comes from GRAPHRT_COMMIT when set (a copied tree without
    git metadata), else from git."""
    import triton

    commit = os.environ.get("GRAPHRT_COMMIT")
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                          cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        pass
    from graphrt.info import fast_helper

    cuda = torch.cuda.is_available()
    # the C helper packs and copies steps; host-time figures without it are numpy's
    return dict(commit=commit, gpu=torch.cuda.get_device_name() if cuda else None, torch=torch.__version__,
                triton=triton.__version__, cuda=torch.version.cuda, python=platform.python_version(),
                fast_helper=fast_helper())


def write(out: Path, name: str, rows: list[dict], extra_env: dict | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(dict(env={**env(), **(extra_env or {})}, rows=rows), indent=1))
    return path


def decode_arrays(batch: int, context: int, block_size: int = 16) -> dict:
    """``Step.from_arrays`` keywords of the benchmarks' decode step: ``batch`` sequences of
    ``context`` cached tokens plus one new one, blocks 0, 1, ... in order (``batch *
    blocks_per_seq(context)`` in all), one image of min(256, context // 2) tokens from
    position 5."""
    per = blocks_per_seq(context, block_size)
    return dict(q_lens=np.ones(batch, np.int64), context_lens=np.full(batch, context),
                block_table=np.arange(batch * per).reshape(batch, per),
                prefix_ranges=np.tile([[[5, 5 + min(256, context // 2)]]], (batch, 1, 1)))


def toy_runtime(layers: int, max_seqs: int, context: int, *, small: bool, nvtx: bool = False):
    """The benchmarks' toy model (``graphrt.toy.ToyModel``) under a ``Runtime`` sized for
    decode steps of up to ``max_seqs`` sequences at ``context`` tokens (``decode_arrays``):
    32/8 heads, head_dim 128, hidden 1024, bf16 (4/2 heads, head_dim 32, hidden 64, fp32
    when ``small``); KV blocks of 16, 72 per sequence; one random KV cache shared by every
    layer (the same bytes read, one layer's memory). On CUDA when there is one; not captured."""
    from graphrt import Runtime, RuntimeConfig
    from graphrt.toy import ToyModel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = RuntimeConfig(num_q_heads=4 if small else 32, num_kv_heads=2 if small else 8, head_dim=32 if small else 128,
                        block_size=16, num_blocks=max_seqs * 72, max_num_seqs=max_seqs, max_num_tokens=max_seqs * 2,
                        max_model_len=context + 64, max_prefix_ranges=8,
                        dtype=torch.float32 if small else torch.bfloat16)
    model = ToyModel(cfg, num_layers=layers, hidden=64 if small else 1024, vocab=1024, device=device)
    cache = torch.randn(cfg.num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim, device=device).to(cfg.dtype)
    return Runtime(cfg, model, num_layers=layers, device=device, nvtx=nvtx,
                   kv_caches=([cache] * layers, [cache] * layers))


def captured_decode(layers: int, batch: int, context: int, *, small: bool):
    """``toy_runtime`` with the decode bucket of ``batch`` sequences (and one mixed bucket)
    captured, and its decode step's arguments: (runtime, ``Step.from_arrays`` keywords,
    input ids)."""
    rt = toy_runtime(layers, batch, context, small=small)
    rt.capture(decode_buckets=[batch], mixed_buckets=[rt.cfg.max_num_tokens], quiet=True)
    return rt, decode_arrays(batch, context, rt.cfg.block_size), np.arange(batch) % 1000


def sync(device) -> None:
    """Wait for ``device``'s queued work (a CUDA device; nothing on the CPU): a benchmark's
    timing boundary, never inside a timed step."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def blocks_per_seq(context: int, block_size: int = 16) -> int:
    return -(-(context + 1) // block_size)


def quick_out_main(run, doc: str, argv: list[str] | None = None) -> None:
    """Command line of a benchmark that takes only --quick and --out."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (what the CPU test runs)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    run(quick=args.quick, out=args.out or default_out())


def progress(items, desc: str, quiet: bool = False):
    from tqdm import tqdm

    return tqdm(items, desc=desc, disable=quiet, leave=False, dynamic_ncols=True)


def host_median_us(fn, reps: int, sync, waited=None) -> float:
    """Median host µs of one call of ``fn`` over ``reps`` calls after 20 warm-up calls;
    ``sync()`` (the GPU's synchronize, or nothing) every 50 calls keeps queued GPU work
    from making the host wait inside ``fn``. ``waited()``, where given, is a running total
    of seconds spent waiting for the GPU (a runtime's ring waits): what a call adds to it
    is taken out of that call's time."""
    for _ in range(20):
        fn()
    sync()
    times = []
    for i in range(reps):
        w0 = waited() if waited is not None else 0.0
        t0 = time.perf_counter()
        fn()
        t = time.perf_counter() - t0
        times.append(t - (waited() - w0 if waited is not None else 0.0))
        if i % 50 == 49:
            sync()
    sync()
    return 1e6 * statistics.median(times)


def summarize_rounds(row: dict, key: str, values: list[float]) -> None:
    """``row[key]``: the median of per-round medians; ``row[key + "_rounds"]``: each round's."""
    row[key] = statistics.median(values)
    row[key + "_rounds"] = [round(v, 3) for v in values]


def sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> dict:
    """Which torch SDPA implementation ``F.scaled_dot_product_attention(q, k, v, **kwargs)``
    runs: torch's own choice (``sdpa_backend``: the name of a ``SDPBackend``, from
    ``torch._fused_sdp_choice``) and, on CUDA, the kernels one call launched
    (``sdpa_kernels``, from the profiler), so that a JSON says what it was compared with."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    out: dict = {}
    try:
        out["sdpa_backend"] = SDPBackend(torch._fused_sdp_choice(q, k, v, **kwargs)).name
    except Exception as exc:             # a private helper: another torch may lack or change it
        out["sdpa_backend"] = f"unknown ({type(exc).__name__})"
    if q.is_cuda:
        from torch.profiler import ProfilerActivity, profile

        try:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                F.scaled_dot_product_attention(q, k, v, **kwargs)
                torch.cuda.synchronize()
            names = {e.key for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA}
            out["sdpa_kernels"] = sorted(n[:160] for n in names)
        except Exception as exc:         # the record is worth less than the run it sits in
            out["sdpa_kernels"] = [f"unknown ({type(exc).__name__}: {exc})"[:160]]
    return out


def time_ms(fn, *, iters: int = 50, graph: bool = True) -> float:
    """Median ms of one call of ``fn``: as a CUDA graph replay (warm-up, capture, replay)
    timed with events, or without CUDA eagerly with the host clock."""
    if not torch.cuda.is_available():
        fn()
        times = []
        for _ in range(min(iters, 3)):        # interpreter timings only show the code runs
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return sorted(times)[len(times) // 2]
    run = captured(fn) if graph else _warmed(fn)
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _warmed(fn):
    """``fn`` after two warm-up calls on a side stream (Triton's compiles, the allocator)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    return fn


def captured(fn):
    """``fn`` warmed up, then captured once in a CUDA graph; returns the graph's replay."""
    _warmed(fn)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def kernel_us(run, reps: int = 20) -> dict:
    """Device µs per call of ``run`` by kernel name (the profiler's self device time over
    ``reps`` calls; copies and memsets left out), largest first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    out = {e.key: round(e.self_device_time_total / reps, 2) for e in prof.key_averages()
           if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.key and "Memset" not in e.key}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def profile_steps(run_step, steps: int) -> dict:
    """Profile ``steps`` calls of ``run_step`` (CUDA): GPU busy fraction (union of GPU
    activity over the wall time, ``gpu_busy``; and over the span from the first GPU
    activity to the last, ``gpu_busy_span``, which leaves out the host's lead-in before the
    first step reaches the GPU), GPU µs per step, HtoD copies and bytes per step,
    synchronising calls made while stepping (the closing synchronize excluded) and ring
    back-pressure waits."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        with record_function("bench_steps"):
            for _ in range(steps):
                run_step()
        torch.cuda.synchronize()
        wall_us = 1e6 * (time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        trace = json.loads(Path(path).read_text())
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                 if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    busy, end = 0.0, float("-inf")
    for start, stop in gpu:                       # union of intervals
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    h2d = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    (window,) = [(e["ts"], e["ts"] + e["dur"]) for e in events
                 if e.get("name") == "bench_steps" and e.get("cat") == "user_annotation"]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime" and window[0] <= e["ts"] <= window[1]]
    span = (gpu[-1][1] - gpu[0][0]) if gpu else 0.0
    return dict(gpu_busy=min(1.0, busy / wall_us), gpu_busy_span=min(1.0, busy / span) if span else 0.0,
                gpu_us=busy / steps, h2d_copies=len(h2d) / steps,
                h2d_bytes=sum(e.get("args", {}).get("bytes", 0) for e in h2d) / steps,
                h2d_pageable=sum("Pinned" not in e["name"] for e in h2d) / steps,
                syncs=sum(e["name"] in SYNC_CALLS for e in runtime) / steps,
                ring_waits=sum(e["name"] == RING_WAIT for e in runtime) / steps)


def plot(path: Path, title: str, panels: list[dict]) -> None:
    """One PNG of side-by-side panels: dict(xlabel, ylabel, series={label: (xs, ys)},
    logx, logy, hline=(y, label))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, p in zip(axes[0], panels):
        for label, (xs, ys) in p["series"].items():
            ax.plot(xs, ys, marker="o", label=label)
        if p.get("hline"):
            ax.axhline(p["hline"][0], color="grey", linestyle="--", label=p["hline"][1])
        ax.set_xlabel(p["xlabel"])
        ax.set_ylabel(p["ylabel"])
        ax.set_title(p.get("title", ""))
        if p.get("logx"):
            ax.set_xscale("log", base=2)
        if p.get("logy"):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
