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
