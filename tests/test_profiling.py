"""graphrt.profiling.count_transfers on synthetic profiler events."""

from types import SimpleNamespace as NS

from graphrt.profiling import count_transfers


def ev(name, device, start, end=None):
    return NS(name=name, device_type=NS(name=device), time_range=NS(start=start, end=start if end is None else end))


def test_counts_inside_regions_only():
    events = [
        ev("graphrt_step", "CPU", 0, 10), ev("graphrt_step", "CPU", 20, 30),
        ev("cudaStreamSynchronize", "CPU", 5),        # inside: a sync
        ev("cudaEventSynchronize", "CPU", 25),        # inside: a ring wait
        ev("cudaDeviceSynchronize", "CPU", 15),       # between steps: the loop's own
        ev("Memcpy HtoD (Pinned -> Device)", "CUDA", 6), ev("Memcpy HtoD (Pinned -> Device)", "CUDA", 26),
        ev("Memcpy HtoD (Pageable -> Device)", "CUDA", 16), ev("Memcpy DtoH (Device -> Pinned)", "CUDA", 17),
    ]
    seen = count_transfers(NS(events=lambda: events), "graphrt_step")
    assert (seen.regions, seen.h2d_pinned, seen.h2d_pageable, seen.syncs, seen.ring_waits) == (2, 2, 1, 1, 1)


def test_step_profiles_from_chrome_events():
    """GPU activity is owned by the step that launched it (correlation ids), even when it
    runs after the host has moved on to the next step."""
    from graphrt.profiling import busy_over_steps, step_profiles

    def x(name, cat, ts, dur=0, corr=None):
        return dict(ph="X", name=name, cat=cat, ts=ts, dur=dur, args={} if corr is None else {"correlation": corr})

    events = [
        x("graphrt_step", "user_annotation", 0, 10), x("graphrt_step", "user_annotation", 12, 10),
        x("cudaMemcpyAsync", "cuda_runtime", 2, 1, corr=1), x("cudaGraphLaunch", "cuda_runtime", 5, 2, corr=2),
        x("cudaMemcpyAsync", "cuda_runtime", 14, 1, corr=3), x("cudaGraphLaunch", "cuda_runtime", 16, 2, corr=4),
        x("cudaStreamSynchronize", "cuda_runtime", 20, 1, corr=5),
        x("cudaEventSynchronize", "cuda_runtime", 13, 1, corr=6),
        # step 0 on the GPU: copy, then two kernels with a 3 us gap, all after the host left the step
        x("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 8, 1, corr=1),
        x("k1", "kernel", 9, 5, corr=2), x("k2", "kernel", 17, 3, corr=2),
        # step 1: starts 10 us after step 0's last kernel, one pageable copy
        x("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", 30, 2, corr=3), x("k1", "kernel", 32, 4, corr=4),
        x("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 40, 1, corr=99),      # launched outside any step
    ]
    a, b = step_profiles(events, "graphrt_step")
    assert (a.gpu_us, a.span_us, a.gaps, a.gap_us, a.max_gap_us, a.lead_us) == (9, 12, 1, 3, 3, 0)
    assert (a.h2d_pinned, a.h2d_pageable, a.syncs, a.ring_waits, a.host_us) == (1, 0, 0, 0, 10)
    assert (b.gpu_us, b.span_us, b.gaps, b.lead_us, b.busy) == (6, 6, 0, 10, 1.0)
    assert (b.h2d_pinned, b.h2d_pageable, b.syncs, b.ring_waits) == (0, 1, 1, 1)
    assert busy_over_steps([a, b]) == 15 / 28


def test_profile_command_writes_a_trace(tmp_path):
    """``graphrt profile`` end to end (on CPU the trace holds the step ranges only)."""
    import json
    import subprocess
    import sys

    trace = tmp_path / "trace.json"
    run = subprocess.run([sys.executable, "-m", "graphrt", "profile", "--layers", "1", "--batch", "2", "--context",
                          "40", "--steps", "2", "--warmup", "1", "--trace", str(trace)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "busy" in run.stdout and f"trace: {trace}" in run.stdout
    # Host-side ranges; on a GPU the trace also mirrors each as a gpu_user_annotation.
    steps = [e for e in json.loads(trace.read_text())["traceEvents"]
             if e.get("name") == "graphrt_step" and e.get("cat") == "user_annotation"]
    assert len(steps) == 2, steps
