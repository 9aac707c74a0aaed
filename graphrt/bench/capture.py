"""Capture cost: time and graph-pool memory to capture every default bucket of a
32-layer model (decode buckets up to 256 sequences, mixed buckets up to 8192 tokens),
from a cold Triton cache (a fresh ``TRITON_CACHE_DIR``: the first run on a new machine
or after an upgrade) and then a warm one (the same directory again); then both again in
a second fresh directory with ``rt.capture(precompile=True)`` (the kernel variants
compiled in parallel processes first). Each runs in a fresh process, so nothing compiled
stays in memory between them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from graphrt.bench.common import quick_out_main, write


def run(*, quick: bool, out: Path, quiet: bool = False) -> list[dict]:
    small = quick or not torch.cuda.is_available()
    rows = []
    with tempfile.TemporaryDirectory(prefix="graphrt-triton-cache-") as cache_dir, \
            tempfile.TemporaryDirectory(prefix="graphrt-triton-cache-") as cache_dir_2:
        for cache, precompile, directory in (("cold", False, cache_dir), ("warm", False, cache_dir),
                                             ("cold", True, cache_dir_2), ("warm", True, cache_dir_2)):
            env = {**os.environ, "TRITON_CACHE_DIR": directory}
            code = (f"import json; from graphrt.bench.capture import measure; "
                    f"print(json.dumps(measure(quick={quick}, precompile={precompile})))")
            child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=3600)
            if child.returncode != 0:
                raise RuntimeError(f"capture bench ({cache} cache) failed:\n{child.stderr[-3000:]}")
            measured = json.loads(child.stdout.strip().splitlines()[-1])
            rows += [{**r, "cache": cache, "precompile": precompile} for r in measured]
            total = measured[-1]
            if total["buckets"]:
                how = " with precompile" if precompile else ""
                print(f"{cache} Triton cache{how}: captured {total['buckets']} buckets of a {total['layers']}-layer "
                      f"model in {total['ms'] / 1e3:.1f} s, graph pool {total['pool_bytes'] / 2**20:.0f} MiB"
                      + (f" (precompile{' from its manifest' if total.get('precompile_from_manifest') else ''}: "
                         f"{total['precompile_variants']} variants, {total['precompile_workers']} "
                         f"workers, {total['precompile_s']:.1f} s: "
                         + ", ".join(f"{k} {v:.1f}" for k, v in (total["precompile_phases"] or {}).items())
                         + _slowest(total["precompile_compile_s"]) + ")" if precompile else ""))
            else:
                print(f"{cache} Triton cache: no CUDA device, nothing to capture (every step runs eagerly)")
    path = write(out, "capture" if not small else "capture_quick", rows)
    if not quiet:
        print(f"wrote {path}")
    return rows


def _slowest(seconds: dict | None) -> str:
    """The pool's slowest import and slowest compile, as text ("" without a pool)."""
    if not seconds:
        return ""
    imports = [v for k, v in seconds.items() if k.startswith("(imports)")]
    compiles = {k: v for k, v in seconds.items() if not k.startswith("(imports)")}
    worst = max(compiles, key=compiles.get) if compiles else None
    return (f"; in the pool: imports up to {max(imports):.1f} s" if imports else "") + (
        f", slowest compile {worst.split('@')[0]} {compiles[worst]:.1f} s" if worst else "")


def measure(*, quick: bool, precompile: bool = False) -> list[dict]:
    """Capture every default bucket in this process: one row per bucket and a total
    (with ``precompile``, what it found and the seconds it took, included in the total)."""
    from graphrt import Runtime, RuntimeConfig
    from graphrt.toy import ToyModel

    cuda = torch.cuda.is_available()
    small = quick or not cuda
    layers = 2 if small else 32
    cfg = RuntimeConfig(num_q_heads=4 if small else 32, num_kv_heads=2 if small else 8, head_dim=64 if small else 128,
                        block_size=16, num_blocks=4096, max_num_seqs=8 if small else 256,
                        max_num_tokens=64 if small else 8192, max_model_len=8192, max_prefix_ranges=8,
                        dtype=torch.float32 if small else torch.bfloat16)
    device = "cuda" if cuda else "cpu"
    model = ToyModel(cfg, num_layers=layers, hidden=64 if small else 1024, vocab=1024, device=device)
    cache = torch.zeros(cfg.num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim, dtype=cfg.dtype, device=device)
    rt = Runtime(cfg, model, num_layers=layers, device=device, kv_caches=([cache] * layers, [cache] * layers))
    t0 = time.perf_counter()
    graphs = rt.capture(precompile=precompile)
    total_s = time.perf_counter() - t0
    report = rt.graphs.precompile_report if rt.graphs is not None else None
    rows = [dict(bench="capture", impl="graphrt_graph", layers=layers, bucket=str(g.bucket), kind=g.bucket.kind,
                 seqs=g.bucket.num_seqs, tokens=g.bucket.num_tokens, ms=1e3 * g.seconds, pool_bytes=g.pool_bytes)
            for g in graphs]
    rows.append(dict(bench="capture", impl="graphrt_graph", layers=layers, bucket="all", buckets=len(graphs),
                     ms=1e3 * total_s, pool_bytes=sum(g.pool_bytes for g in graphs),
                     precompile_variants=report.variants if report else None,
                     precompile_workers=report.workers if report else None,
                     precompile_s=report.seconds if report else None,
                     precompile_phases=report.phases if report else None,
                     precompile_compile_s=report.compile_seconds if report else None,
                     precompile_failures=report.failures if report else None,
                     precompile_from_manifest=report.from_manifest if report else None))
    return rows


def main(argv: list[str] | None = None) -> None:
    quick_out_main(run, __doc__, argv)
