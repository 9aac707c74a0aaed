"""What the torch profiler saw: host-to-device copies and host synchronisations."""

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
