"""fp8 (e4m3) decode tiles: time of a decode launch over an fp8 cache for several
(block_n, warps, stages), beside the bf16 cache's default, in one run.

    python benchmarks/sweep_fp8_decode.py [--out DIR]

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
CONFIGS = [None, (128, 4, 3), (128, 8, 2), (256, 8, 2), (64, 4, 2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200"))
    args = parser.parse_args()
    quick = not torch.cuda.is_available()
    shapes = [(1, 64), (4, 64)] if quick else SHAPES
    configs = CONFIGS[:2] if quick else CONFIGS
    base = default_config(D, DT, HQ // HKV, max_query_len=1)
    rows = []
    for batch, ctx in shapes:
        decode = ([1] * batch, [ctx - 1] * batch, [[]] * batch)
        bf16, splits = _attend(*decode, decode=True)
        rows.append(dict(impl="bf16_default", batch=batch, context=ctx, splits=splits, ms=bf16, of_bf16=1.0))
        for c in configs:
            cfg = base if c is None else KernelConfig(block_q=base.block_q, block_n=c[0], num_warps=c[1],
                                                      num_stages=c[2])
            try:
                ms, _ = _attend(*decode, decode=True, fp8=True, config=cfg)
            except Exception as exc:          # a config that does not compile or fit: recorded, not fatal
                print(f"batch {batch} ctx {ctx} {c}: {type(exc).__name__}: {exc}"[:200])
                continue
            rows.append(dict(impl="fp8", block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                             default=c is None, batch=batch, context=ctx, splits=splits, ms=ms, of_bf16=ms / bf16))
            print(f"batch {batch:4d} ctx {ctx:6d} fp8 {cfg.block_n:4d}/{cfg.num_warps}/{cfg.num_stages}: "
                  f"{1e3 * ms:8.1f} us = {ms / bf16:.3f} x bf16 ({1e3 * bf16:.1f} us)", flush=True)
    print(f"wrote {write(args.out, 'sweep_fp8_decode' if not quick else 'sweep_fp8_decode_quick', rows)}")


if __name__ == "__main__":
    main()
