"""What the torch profiler saw: host-to-device copies, host synchronisations, and per-step
GPU activity from a Chrome trace."""

from __future__ import annotations

from dataclasses import dataclass

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")   # the host waits for the GPU
RING_WAIT = "cudaEventSynchronize"    # graphrt's ring: the host waits for a free staging slot (back-pressure)


@dataclass
class TransferCount:
    regions: int          # CPU ranges named ``region`` found (e.g. one per step)
    h2d_pinned: int       # "Memcpy HtoD (Pinned -> Device)" on the GPU timeline, whole profile
    h2d_pageable: int     # any other HtoD memcpy, whole profile
    syncs: int            # synchronising CUDA runtime calls made inside a region
    ring_waits: int       # waits for a free staging slot inside a region


def count_transfers(prof, region: str) -> TransferCount:
    """Count from a finished ``torch.profiler.profile``; ``region`` names the
    ``record_function`` ranges that mark the code under test (e.g. each ``rt.step``)."""
    events = prof.events()
    cpu = [e for e in events if e.device_type.name == "CPU"]
    windows = [e.time_range for e in cpu if e.name == region]
    inside = [e.name for e in cpu if any(w.start <= e.time_range.start <= w.end for w in windows)]
    h2d = [e.name for e in events if e.device_type.name != "CPU" and "Memcpy HtoD" in e.name]
    pinned = sum("Pinned" in n for n in h2d)
    return TransferCount(len(windows), pinned, len(h2d) - pinned, sum(n in SYNC_CALLS for n in inside),
                         inside.count(RING_WAIT))


GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class StepProfile:
    """One profiled step, from a Chrome trace of the torch profiler (times in µs)."""

    index: int
    host_us: float         # length of the step's CPU range
    gpu_us: float          # union of the GPU activity the step launched
    span_us: float         # first to last GPU activity of the step
    busy: float            # gpu_us / span_us
    gaps: int              # idle gaps between the step's GPU activities
    gap_us: float          # their total
    max_gap_us: float      # the longest
    lead_us: float         # GPU idle between the previous step's last activity and this one's first
    h2d_pinned: int
    h2d_pageable: int
    syncs: int             # synchronising CUDA runtime calls inside the step's CPU range
    ring_waits: int
    gpu_start: float       # trace time of the step's first GPU activity (None without any)
    gpu_end: float         # and of the end of its last


def busy_over_steps(steps: list[StepProfile]) -> float:
    """GPU busy over the whole run: activity over the time from the first step's first
    GPU activity to the last step's last (idle lead-ins between steps count as idle)."""
    active = [s for s in steps if s.gpu_start is not None]
    if not active:
        return 0.0
    return sum(s.gpu_us for s in active) / (active[-1].gpu_end - active[0].gpu_start)


def step_profiles(events: list[dict], region: str) -> list[StepProfile]:
    """Per-step figures from Chrome-trace ``events`` (``traceEvents`` of
    ``prof.export_chrome_trace``). Steps are the CPU ranges named ``region``; a GPU
    activity belongs to the step whose range holds the runtime call that launched it
    (matched by correlation id), so a host running ahead is accounted correctly."""
    complete = [e for e in events if e.get("ph") == "X"]
    windows = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in complete
                     if e.get("name") == region and e.get("cat") == "user_annotation")
    runtime = [e for e in complete if e.get("cat") in ("cuda_runtime", "cuda_driver")]

    def step_of(ts: float) -> int | None:
        for i, (start, end) in enumerate(windows):
            if start <= ts <= end:
                return i
        return None

    owner = {e.get("args", {}).get("correlation"): step_of(e["ts"]) for e in runtime}
    gpu: list[list[dict]] = [[] for _ in windows]
    for e in complete:
        if e.get("cat") in GPU_CATEGORIES:
            i = owner.get(e.get("args", {}).get("correlation"))
            if i is not None:
                gpu[i].append(e)
    out, prev_end = [], None
    for i, (start, end) in enumerate(windows):
        spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in gpu[i])
        merged: list[list[float]] = []
        for s, t in spans:
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], t)
            else:
                merged.append([s, t])
        busy = sum(t - s for s, t in merged)
        span = merged[-1][1] - merged[0][0] if merged else 0.0
        gaps = [b[0] - a[1] for a, b in zip(merged, merged[1:])]
        lead = merged[0][0] - prev_end if merged and prev_end is not None else 0.0
        prev_end = merged[-1][1] if merged else prev_end
        calls = [e["name"] for e in runtime if start <= e["ts"] <= end]
        h2d = [e["name"] for e in gpu[i] if e.get("cat") == "gpu_memcpy" and "HtoD" in e["name"]]
        pinned = sum("Pinned" in n for n in h2d)
        out.append(StepProfile(i, end - start, busy, span, busy / span if span else 0.0, len(gaps), sum(gaps),
                               max(gaps, default=0.0), max(lead, 0.0), pinned, len(h2d) - pinned,
                               sum(n in SYNC_CALLS for n in calls), calls.count(RING_WAIT),
                               merged[0][0] if merged else None, merged[-1][1] if merged else None))
    return out
