"""fp8 (e4m3) decode tiles: time of a decode launch over an fp8 cache for several
(block_n, warps, stages, register cap), beside the bf16 cache's default (and the bf16 tile
under the same caps), in one run.

    python benchmarks/probes/sweep_fp8_decode.py [--out DIR] [--new-kv]

The register caps test one reading of why fp8 stays at ~0.77x of bf16 where it reads half
the bytes: the 128-key tile takes 187-245 registers, so 2 programs share an SM, and with
half the bytes per tile half as many are in flight. Under a 168 cap (sm_90, Triton 3.6:
12 spill loads/stores, ``sass_stats.py --fp8 --seqs 64 --maxnreg 168``) 3 programs fit.

Shapes as ``graphrt bench kernels`` (32/8 heads, head_dim 128, KV block 16, random block
placement); each figure is a CUDA-graph replay median (``time_ms``). Writes
``sweep_fp8_decode.json`` with ``of_bf16`` (fp8 time / bf16 time) per row.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from graphrt.bench.common import write
from graphrt.bench.kernels import D, DT, HKV, HQ, _attend
from graphrt.kernels.paged_attention import KernelConfig, default_config

SHAPES = [(1, 1024), (8, 8192), (64, 32768), (256, 32768)]
# (block_n, warps, stages, maxnreg); None: the table's. (8-warp tiles measured 1.1-1.3x
# of bf16 at 6e2971e, so they are left out.)
CONFIGS = [None, (128, 4, 2, 168), (128, 4, 3, None), (128, 4, 3, 168), (64, 4, 3, 128)]
# bf16 tiles under a cap, beside its default
BF16_CAPS = [168]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200"))
    parser.add_argument("--new-kv", action="store_true",
                        help="launches given the new K/V (the runtime's decode buckets: the write in the launch)")
    args = parser.parse_args()
    quick = not torch.cuda.is_available()
    shapes = [(1, 64), (4, 64)] if quick else SHAPES
    configs = CONFIGS[:2] if quick else CONFIGS
    base = default_config(D, DT, HQ // HKV, max_query_len=1)
    rows = []
    for batch, ctx in shapes:
        decode = ([1] * batch, [ctx - 1] * batch, [[]] * batch)
        bf16, splits = _attend(*decode, decode=True, new_kv=args.new_kv)
        rows.append(dict(impl="bf16_default", batch=batch, context=ctx, splits=splits, ms=bf16, of_bf16=1.0,
                         new_kv=args.new_kv))
        runs = [("fp8", c) for c in configs] + [("bf16", (base.block_n, base.num_warps, base.num_stages, cap))
                                                for cap in (BF16_CAPS if not quick else [])]
        for impl, c in runs:
            cfg = base if c is None else KernelConfig(block_q=base.block_q, block_n=c[0], num_warps=c[1],
                                                      num_stages=c[2], maxnreg=c[3])
            try:
                ms, _ = _attend(*decode, decode=True, fp8=impl == "fp8", config=cfg, new_kv=args.new_kv)
            except Exception as exc:          # a config that does not compile or fit: recorded, not fatal
                print(f"batch {batch} ctx {ctx} {impl} {c}: {type(exc).__name__}: {exc}"[:200])
                continue
            rows.append(dict(impl=impl, block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                             maxnreg=cfg.maxnreg, default=c is None, batch=batch, context=ctx, splits=splits, ms=ms,
                             of_bf16=ms / bf16, new_kv=args.new_kv))
            print(f"batch {batch:4d} ctx {ctx:6d} {impl} {cfg.block_n:4d}/{cfg.num_warps}/{cfg.num_stages}"
                  f"/{cfg.maxnreg}: {1e3 * ms:8.1f} us = {ms / bf16:.3f} x bf16 ({1e3 * bf16:.1f} us)", flush=True)
    name = "sweep_fp8_decode" + ("_new_kv" if args.new_kv else "") + ("_quick" if quick else "")
    print(f"wrote {write(args.out, name, rows)}")


if __name__ == "__main__":
    main()
