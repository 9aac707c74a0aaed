"""``graphrt profile``: record steps of the toy model on the runtime and show where the
time goes.

With the torch profiler (default) it writes a Chrome / Perfetto trace (open it at
https://ui.perfetto.dev or chrome://tracing) holding graphrt's ``graphrt_step`` ranges, and
prints per step: host µs, GPU µs, GPU busy over the step's GPU span, idle gaps between
its kernels, the GPU's idle lead-in before it (host-bound steps show it), H2D copies
(pinned / pageable) and host syncs. With ``--nsys`` it instead brackets the steps with
cudaProfilerStart/Stop for ``nsys profile --capture-range=cudaProfilerApi`` (or ``ncu
--profile-from-start off``) and emits graphrt's NVTX ranges (see docs/profiling.md).
``--prefill N`` adds a sequence prefilling N tokens beside the decodes: a mixed step.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch


def run_profile(*, device: str, layers: int, batch: int, context: int, steps: int, warmup: int, trace: Path,
                nsys: bool, prefill: int = 0) -> int:
    from torch.profiler import ProfilerActivity, profile, record_function

    from graphrt.bench.common import blocks_per_seq, decode_arrays
    from graphrt.config import RuntimeConfig
    from graphrt.profiling import busy_over_steps, step_profiles
    from graphrt.runtime import Runtime
    from graphrt.step import Step
    from graphrt.toy import ToyModel

    on_gpu = device == "cuda"
    heads = dict(num_q_heads=32, num_kv_heads=8, head_dim=128) if on_gpu else dict(num_q_heads=4, num_kv_heads=2,
                                                                                    head_dim=64)
    if not 0 <= prefill <= context:
        raise SystemExit(f"graphrt profile: --prefill must be in [0, --context={context}], got {prefill}")
    per = blocks_per_seq(context)
    arrays = decode_arrays(batch, context)
    seqs, tokens = batch, batch
    if prefill:                  # a mixed step: one more sequence prefilling `prefill` tokens after the decodes
        seqs, tokens = batch + 1, batch + prefill
        arrays = dict(q_lens=np.append(arrays["q_lens"], prefill), context_lens=np.append(arrays["context_lens"], 0),
                      block_table=np.arange(seqs * per).reshape(seqs, per),
                      prefix_ranges=np.concatenate([arrays["prefix_ranges"], [[[0, 0]]]]))
    cfg = RuntimeConfig(**heads, block_size=16, num_blocks=seqs * per, max_num_seqs=seqs, max_num_tokens=tokens,
                        max_model_len=context + 1, max_prefix_ranges=2,
                        dtype=torch.bfloat16 if on_gpu else torch.float32)
    model = ToyModel(cfg, num_layers=layers, hidden=1024 if on_gpu else 64, vocab=1024, device=device)
    rt = Runtime(cfg, model, num_layers=layers, device=device, nvtx=nsys)
    rt.capture(decode_buckets=[] if prefill else [batch], mixed_buckets=[tokens] if prefill else [])
    step = Step.from_arrays(**arrays)
    ids = np.arange(tokens) % 1000
    for _ in range(warmup):
        rt.step(step, ids)
    if on_gpu:
        torch.cuda.synchronize()
    what = f" beside a {prefill}-token prefill" if prefill else ""
    print(f"graphrt profile: {device}, {layers} layers, batch {batch} decode at context {context}{what}, "
          f"{'graph replay' if on_gpu else 'eager (Triton interpreter)'}; {steps} steps")

    if nsys:
        if not on_gpu:
            raise SystemExit("graphrt profile --nsys needs a CUDA device")
        torch.cuda.profiler.start()
        for _ in range(steps):
            rt.step(step, ids)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print("recorded between cudaProfilerStart/Stop; graphrt's NVTX ranges are in domain 'graphrt'")
        return 0

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function("graphrt_step"):
                rt.step(step, ids)
        if on_gpu:
            torch.cuda.synchronize()
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text()).get("traceEvents", [])
    rows = step_profiles(events, "graphrt_step")
    print(f"{'step':>4} {'host us':>8} {'gpu us':>8} {'span us':>8} {'busy':>5} {'gaps':>5} {'gap us':>7} "
          f"{'max gap':>7} {'lead us':>8} {'h2d':>7} {'syncs':>5}")
    for r in rows:
        print(f"{r.index:4d} {r.host_us:8.0f} {r.gpu_us:8.0f} {r.span_us:8.0f} {r.busy:5.2f} {r.gaps:5d} "
              f"{r.gap_us:7.1f} {r.max_gap_us:7.1f} {r.lead_us:8.0f} {r.h2d_pinned:3d}/{r.h2d_pageable:<3d} {r.syncs:5d}")
    if rows and on_gpu:
        tail = rows[1:] or rows                   # the first step has no previous one to lead from
        print(f"median: host {np.median([r.host_us for r in tail]):.0f} us, GPU "
              f"{np.median([r.gpu_us for r in tail]):.0f} us, busy over span {np.median([r.busy for r in tail]):.2f}, "
              f"idle lead-in {np.median([r.lead_us for r in tail]):.0f} us; GPU busy over all {len(rows)} steps "
              f"{busy_over_steps(rows):.2f}")
    elif not on_gpu:
        print("(no CUDA device: the trace has CPU ranges only, GPU figures are 0)")
    print(f"trace: {trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    return 0

