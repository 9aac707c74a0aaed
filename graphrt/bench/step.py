"""One L-layer model step, four ways, side by side:

  per_layer_rebuild  metadata built once per step with pageable copies, and the prefix-range
                     tensor rebuilt from Python lists with ``torch.tensor(..., device=)`` in
                     every layer (a pattern a real engine shipped);
  per_step_rebuild   everything built once per step, pageable copies (the usual fix);
  graphrt_eager      graphrt staging: one pinned copy per step, layers launched eagerly;
  graphrt_graph      graphrt staging + CUDA graph replay.

Each a decode step (one new token per sequence, context 1k, one 256-token image per
sequence, room for 8), same model (``graphrt.toy.ToyModel``), same KV caches.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from graphrt.bench.common import (blocks_per_seq, decode_arrays, plot, profile_steps, progress,
                                  quick_out_main, write)

IMPLS = ("per_layer_rebuild", "per_step_rebuild", "graphrt_eager", "graphrt_graph")


class _RebuildContext:
    """A model-step context whose metadata is built with plain torch uploads."""

    def __init__(self, step, ids, cfg, device, k_caches, v_caches, per_layer: bool):
        from graphrt.step import build_metadata

        self.meta, self.positions = build_metadata(step, cfg, device)          # several pageable copies
        self.input_ids = torch.tensor(ids.tolist(), dtype=torch.int64, device=device)
        self.last_token_index = (self.meta.query_start_loc[1:] - 1).long()
        self._ranges = self.meta_ranges_list(step, cfg) if per_layer else None
        self._caches, self._device = (k_caches, v_caches), device

    @staticmethod
    def meta_ranges_list(step, cfg) -> list:
        padded = np.zeros((step.num_seqs, cfg.max_prefix_ranges, 2), np.int64)
        padded[:, : step.ranges.shape[1]] = step.ranges
        return padded.tolist()

    def attention(self, layer, q, k, v, **opts):
        from graphrt.kernels import paged_attention, write_kv

        meta = self.meta
        if self._ranges is not None:   # the per-layer rebuild
            meta = dataclasses.replace(meta, prefix_ranges=torch.tensor(self._ranges, dtype=torch.int32,
                                                                         device=self._device))
        kc, vc = self._caches[0][layer], self._caches[1][layer]
        write_kv(k, v, kc, vc, meta)
        out = torch.empty_like(q)
        return paged_attention(q, kc, vc, out, meta, **opts)


def run(*, quick: bool, out: Path, quiet: bool = False) -> list[dict]:
    from graphrt import Runtime, RuntimeConfig, Step
    from graphrt.toy import ToyModel

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if quick or not cuda:
        layers_list, batches, context, steps = [2], [1, 2], 48, 2
        shape = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, hidden=64)
    else:
        layers_list, batches, context, steps = [8, 32, 64], [1, 8, 64, 256], 1024, 30
        shape = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, hidden=1024)
    hidden = shape.pop("hidden")
    rows = []
    dtype = torch.bfloat16 if cuda else torch.float32
    for layers in layers_list:
        model = None
        for batch in progress(batches, f"step L={layers}", quiet):
            per = blocks_per_seq(context)
            cfg = RuntimeConfig(**shape, block_size=16, num_blocks=batch * per, max_num_seqs=batch,
                                max_num_tokens=batch, max_model_len=context + 1, max_prefix_ranges=8, dtype=dtype)
            if model is None:     # weights depend on the attention shape only, shared by every batch
                model = ToyModel(cfg, num_layers=layers, hidden=hidden, vocab=1024, device=device)
            cache = torch.randn(cfg.num_blocks, 16, cfg.num_kv_heads, cfg.head_dim, device=device).to(cfg.dtype)
            # one cache pair for every layer: the bytes read per layer are the same, memory is not
            caches = ([cache] * layers, [cache.clone()] * layers)
            step = Step.from_arrays(**decode_arrays(batch, context, cfg.block_size))
            ids = np.arange(batch) % 1000
            rt = Runtime(cfg, model, num_layers=layers, device=device, kv_caches=caches)
            graph_rt = None
            if cuda:
                graph_rt = Runtime(cfg, model, num_layers=layers, device=device, kv_caches=caches)
                graph_rt.capture(decode_buckets=[batch], mixed_buckets=[], quiet=True)
            ways = {
                "per_layer_rebuild": lambda: model(_RebuildContext(step, ids, cfg, device, *caches, per_layer=True)),
                "per_step_rebuild": lambda: model(_RebuildContext(step, ids, cfg, device, *caches, per_layer=False)),
                "graphrt_eager": lambda: rt.step(step, ids),
            }
            if graph_rt is not None:
                ways["graphrt_graph"] = lambda: graph_rt.step(step, ids)
            for impl, fn in ways.items():
                runtime = graph_rt if impl == "graphrt_graph" else rt if impl == "graphrt_eager" else None
                fn()
                n = steps
                if cuda:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(3):
                        fn()
                    torch.cuda.synchronize()
                    # about half a second of steps, at least `steps`: short steps get enough samples
                    n = int(min(300, max(steps, 0.5 * 3 / (time.perf_counter() - t0))))
                host, t_start = [], time.perf_counter()
                for _ in range(n):
                    waited = runtime.buffers.wait_seconds if runtime else 0.0
                    t0 = time.perf_counter()
                    fn()
                    host.append(time.perf_counter() - t0 - ((runtime.buffers.wait_seconds - waited) if runtime else 0))
                if cuda:
                    torch.cuda.synchronize()
                wall = (time.perf_counter() - t_start) / n
                row = dict(bench="step", impl=impl, layers=layers, batch=batch, context=context, steps=n,
                           host_us=1e6 * float(np.median(host)), wall_us=1e6 * wall)
                if cuda:
                    row.update(profile_steps(fn, 20))
                    # Kernel time per step over the unprofiled wall time per step: the torch
                    # profiler slows the host (CUPTI), which makes small profiled steps host-bound.
                    row["gpu_over_wall"] = row["gpu_us"] / row["wall_us"]
                rows.append(row)
            del caches, cache, rt, graph_rt
    if cuda and not quick:
        _report(rows)
    path = write(out, "step" if not quick else "step_quick", rows)
    if not quiet:
        print(f"wrote {path}")
    _plot(rows, out / ("step_quick.png" if quick or not cuda else "step.png"))
    return rows


def _report(rows: list[dict]) -> None:
    print(f"{'L':>3} {'batch':>5} {'impl':>18} {'host us':>9} {'wall us':>9} {'gpu us':>9} {'busy':>5} {'span':>5} "
          f"{'h2d':>5} {'bytes':>8} {'syncs':>5} {'waits':>5}")
    for r in rows:
        print(f"{r['layers']:3d} {r['batch']:5d} {r['impl']:>18} {r['host_us']:9.0f} {r['wall_us']:9.0f} "
              f"{r.get('gpu_us', 0):9.0f} {r.get('gpu_busy', 0):5.2f} {r.get('gpu_busy_span', 0):5.2f} "
              f"{r.get('h2d_copies', 0):5.1f} {r.get('h2d_bytes', 0):8.0f} "
              f"{r.get('syncs', 0):5.1f} {r.get('ring_waits', 0):5.1f}")


def _plot(rows: list[dict], path: Path) -> None:
    panels = []
    for layers in sorted({r["layers"] for r in rows}):
        series = {}
        for impl in IMPLS:
            pts = sorted((r["batch"], r["wall_us"]) for r in rows if r["layers"] == layers and r["impl"] == impl)
            if pts:
                series[impl] = ([p[0] for p in pts], [p[1] / 1e3 for p in pts])
        context = rows[0]["context"]
        panels.append(dict(title=f"{layers} layers", xlabel=f"batch (decode, context {context})", ylabel="ms per step",
                           series=series, logx=True, logy=True))
    plot(path, "One model step, four ways (wall time per step)", panels)


def main(argv: list[str] | None = None) -> None:
    quick_out_main(run, __doc__, argv)
