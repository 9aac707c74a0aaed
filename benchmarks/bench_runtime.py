"""Host and wall time of a graphrt step (stage -> one pinned copy -> replay), NVTX off/on.

    python benchmarks/bench_runtime.py [--quick]

host_us: host time of rt.step minus any wait for a free staging slot (the host's own
work per step; in a GPU-bound loop the ring makes the host wait, which is not its cost);
wall_us: steady-state time per step over a run of steps, GPU included; copy_bytes: the
step's one H2D copy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"     # before anything imports triton
sys.path.insert(0, os.path.dirname(__file__))
from _common import write  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from graphrt import Runtime, RuntimeConfig, SeqStep, Step
    from graphrt.toy import ToyModel

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    layers_list, batches, context, steps = ([2], [1, 4], 64, 3) if args.quick or not cuda else \
        ([8, 32], [1, 8, 64, 256], 1024, 200)
    rows = []
    for layers in layers_list:
        cfg = RuntimeConfig(num_q_heads=32 if cuda else 4, num_kv_heads=8 if cuda else 2,
                            head_dim=128 if cuda else 64, block_size=16, num_blocks=256 * 72 if cuda else 64,
                            max_num_seqs=max(batches), max_num_tokens=512 if cuda else 16,
                            max_model_len=4096 if cuda else 256, max_prefix_ranges=8 if cuda else 2,
                            dtype=torch.bfloat16 if cuda else torch.float32)
        model = ToyModel(cfg, num_layers=layers, hidden=1024 if cuda else 64, vocab=1024, device=device)
        for nvtx_on in (False, True):
            rt = Runtime(cfg, model, num_layers=layers, device=device, nvtx=nvtx_on)
            rt.capture(decode_buckets=batches, mixed_buckets=[cfg.max_num_tokens])
            for batch in batches:
                per = -(-(context + 1) // cfg.block_size)
                step = Step([SeqStep(q_len=1, context_len=context, block_ids=list(range(i * per, (i + 1) * per)),
                                     prefix_ranges=[(5, 5 + min(256, context // 2))]) for i in range(batch)])
                ids = np.arange(batch) % 1000
                for _ in range(3):
                    rt.step(step, ids)
                if cuda:
                    torch.cuda.synchronize()
                host = []
                t_start = time.perf_counter()
                for _ in range(steps):
                    waited = rt.buffers.wait_seconds
                    t0 = time.perf_counter()
                    rt.step(step, ids)
                    host.append(time.perf_counter() - t0 - (rt.buffers.wait_seconds - waited))
                if cuda:
                    torch.cuda.synchronize()
                wall = (time.perf_counter() - t_start) / steps
                rows.append(dict(bench="runtime", impl="graphrt_graph" if rt.last.mode == "replay" else "graphrt_eager",
                                 nvtx=nvtx_on, layers=layers, batch=batch, context=context,
                                 host_us=1e6 * statistics.median(host), wall_us=1e6 * wall,
                                 h2d_bytes=rt.last.copy_bytes, h2d_copies=1))
                r = rows[-1]
                print(f"L={layers:3d} batch={batch:4d} nvtx={'on ' if nvtx_on else 'off'} {r['impl']}: "
                      f"host {r['host_us']:7.1f} us  wall {r['wall_us']:8.1f} us  copy {r['h2d_bytes']} B", flush=True)
    path = write("runtime" if not args.quick else "runtime_quick", rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
