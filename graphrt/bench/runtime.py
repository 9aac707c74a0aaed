"""Host and wall time of a graphrt step (stage -> one pinned copy -> replay), NVTX off/on.

host_us: host time of rt.step minus any wait for a free staging slot (the host's own work
per step; in a GPU-bound loop the ring makes the host wait, which is not its cost);
wall_us: steady-state time per step over a run of steps, GPU included; h2d_bytes: the
step's one host-to-device copy. The Step is built inside the timed call (from_arrays).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import torch

from graphrt.bench.common import decode_arrays, progress, quick_out_main, write


def run(*, quick: bool, out: Path, quiet: bool = False) -> list[dict]:
    from graphrt import Runtime, RuntimeConfig, Step
    from graphrt.toy import ToyModel

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    small = quick or not cuda
    layers_list, batches, context, steps = ([2], [1, 4], 48, 3) if small else ([8, 32], [1, 8, 64, 256], 1024, 200)
    rows = []
    for layers in layers_list:
        cfg = RuntimeConfig(num_q_heads=4 if small else 32, num_kv_heads=2 if small else 8,
                            head_dim=64 if small else 128, block_size=16, num_blocks=max(batches) * 72,
                            max_num_seqs=max(batches), max_num_tokens=max(batches) * 2,
                            max_model_len=context + 64, max_prefix_ranges=8,
                            dtype=torch.float32 if small else torch.bfloat16)
        model = ToyModel(cfg, num_layers=layers, hidden=64 if small else 1024, vocab=1024, device=device)
        cache = (torch.randn(cfg.num_blocks, 16, cfg.num_kv_heads, cfg.head_dim, device=device).to(cfg.dtype),)
        caches = (list(cache) * layers, list(cache) * layers)       # one cache for all layers: same bytes read
        for nvtx_on in (False, True):
            rt = Runtime(cfg, model, num_layers=layers, device=device, nvtx=nvtx_on, kv_caches=caches)
            rt.capture(decode_buckets=batches, mixed_buckets=[cfg.max_num_tokens], quiet=True)
            for batch in progress(batches, f"runtime L={layers} nvtx={nvtx_on}", quiet):
                arrays = decode_arrays(batch, context, cfg.block_size)
                ids = np.arange(batch) % 1000

                def one_step():
                    step = Step.from_arrays(**arrays)
                    return rt.step(step, ids)

                for _ in range(3):
                    one_step()
                if cuda:
                    torch.cuda.synchronize()
                host, t_start = [], time.perf_counter()
                for _ in range(steps):
                    waited = rt.buffers.wait_seconds
                    t0 = time.perf_counter()
                    one_step()
                    host.append(time.perf_counter() - t0 - (rt.buffers.wait_seconds - waited))
                if cuda:
                    torch.cuda.synchronize()
                rows.append(dict(bench="runtime", impl="graphrt_graph" if rt.last.mode == "replay" else "graphrt_eager",
                                 nvtx=nvtx_on, layers=layers, batch=batch, context=context,
                                 host_us=1e6 * statistics.median(host),
                                 wall_us=1e6 * (time.perf_counter() - t_start) / steps,
                                 h2d_bytes=rt.last.copy_bytes))
    for r in rows:
        print(f"L={r['layers']:3d} batch={r['batch']:4d} nvtx={'on ' if r['nvtx'] else 'off'} {r['impl']}: "
              f"host {r['host_us']:7.1f} us  wall {r['wall_us']:8.1f} us  copy {r['h2d_bytes']} B")
    path = write(out, "runtime" if not small else "runtime_quick", rows)
    if not quiet:
        print(f"wrote {path}")
    return rows


def main(argv: list[str] | None = None) -> None:
    quick_out_main(run, __doc__, argv)
