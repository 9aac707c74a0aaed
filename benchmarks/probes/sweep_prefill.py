"""Prefill tiles: causal prefill time for several (rows, block_n, warps, stages) beside
torch SDPA (causal, GQA) in one run.

    python benchmarks/probes/sweep_prefill.py [--out DIR] [--sizes 4096 16384] [--new-kv]

Shapes as ``graphrt bench kernels`` (bf16, 32/8 heads, head_dim 128, KV block 16, random
block placement, one sequence of n new tokens). Writes ``sweep_prefill.json``: per row
ms, TFLOP/s and ``of_sdpa`` (SDPA time / graphrt time: > 1 is faster than SDPA). With
``--new-kv`` each launch is given the new K/V (``sweep_prefill_new_kv.json``): it writes
them and reads the new keys in bulk copies, the path whose tiles the table took from the
cache path's sweep (sm_90, Triton 3.6: the 256-row 8-warp tile spills there, 272 B, the
128-row one does not).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from graphrt.bench.common import time_ms, write
from graphrt.bench.kernels import D, DEV, DT, HKV, HQ, _attend, causal_pairs, record_sdpa_backends
from graphrt.kernels.paged_attention import KernelConfig, default_config

SIZES = [1024, 2048, 4096, 16384]
# (tile rows, block_n, warps, stages); None: the table's choice for the launch
CONFIGS = [None, (64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 2), (256, 64, 8, 3),
           (256, 128, 8, 2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200"))
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="new tokens of the one sequence")
    parser.add_argument("--new-kv", action="store_true", help="launches given the new K/V (written in the launch)")
    args = parser.parse_args()
    quick = not torch.cuda.is_available()
    sizes = [64] if quick else args.sizes
    configs = CONFIGS[:2] if quick else CONFIGS
    qpk = HQ // HKV
    rows = []
    for n in sizes:
        flops = 4 * HQ * D * causal_pairs(n)
        qs, ks, vs = (torch.randn(1, h, n, D, device=DEV, dtype=DT) for h in (HQ, HKV, HKV))
        sdpa = time_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True), iters=20)
        del qs, ks, vs
        rows.append(dict(impl="sdpa", tokens=n, ms=sdpa, tflops=flops / sdpa / 1e9, of_sdpa=1.0))
        for c in configs:
            cfg = (default_config(D, DT, qpk, num_tokens=n) if c is None else
                   KernelConfig(block_q=c[0] // qpk, block_n=c[1], num_warps=c[2], num_stages=c[3], short_block_n=128))
            try:
                ms, _ = _attend([n], [0], [[]], decode=False, iters=20, config=cfg, new_kv=args.new_kv)
            except Exception as exc:          # a config that does not compile or fit: recorded, not fatal
                print(f"n={n} {c}: {type(exc).__name__}: {exc}"[:200])
                continue
            rows.append(dict(impl="graphrt", tokens=n, rows=cfg.block_q * qpk, block_n=cfg.block_n,
                             num_warps=cfg.num_warps, num_stages=cfg.num_stages, default=c is None, ms=ms,
                             tflops=flops / ms / 1e9, of_sdpa=sdpa / ms, new_kv=args.new_kv))
            print(f"n={n:6d} {cfg.block_q * qpk:4d}x{cfg.block_n:<4d} w{cfg.num_warps} s{cfg.num_stages}"
                  f"{' (default)' if c is None else ''}: {ms:8.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s = "
                  f"{sdpa / ms:.2f} x SDPA ({flops / sdpa / 1e9:.1f})", flush=True)
    record_sdpa_backends(rows)          # (after every timing: the profiler under none)
    name = "sweep_prefill" + ("_new_kv" if args.new_kv else "") + ("_quick" if quick else "")
    print(f"wrote {write(args.out, name, rows)}")


if __name__ == "__main__":
    main()
