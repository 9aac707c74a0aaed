"""Split-KV factors for decode: time of a decode launch (bf16 cache) for several split
factors at each (batch, context), beside the factor ``decode_splits`` picks, in one run.

    python benchmarks/probes/sweep_splits.py [--out DIR]

The split count is a launch dimension, not a compile-time constant, so any factor in
1..64 costs no extra attention variant (the merge kernel has one per power-of-two
ceiling). Shapes as ``graphrt bench kernels`` (32/8 heads, head_dim 128, KV block 16,
random block placement); each figure is a CUDA-graph replay median, per launch, of a
graph of several launches over separate caches where one launch reads little (as the
layers of a step: ``calls_per_graph``), with the lone launch's replay beside the picked
factor (``lone_ms``: that adds the graph launch's own latency). Writes
``sweep_splits.json``: per row ms, TB/s read and ``of_copy`` (over the device copy
bandwidth measured in the same run).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from graphrt.bench.common import write
from graphrt.bench.kernels import _attend, calls_per_graph, ceilings, kv_bytes

SHAPES = [(1, 1024), (1, 8192), (1, 32768), (8, 1024), (8, 8192), (8, 32768), (64, 8192)]
SPLITS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200"))
    args = parser.parse_args()
    quick = not torch.cuda.is_available()
    shapes, factors = ([(1, 64), (2, 64)], [1, 3]) if quick else (SHAPES, SPLITS)
    env = ceilings(quick)
    rows = []
    for batch, ctx in shapes:
        decode = ([1] * batch, [ctx - 1] * batch, [[]] * batch)
        calls = calls_per_graph(kv_bytes(batch, ctx))
        lone, picked = _attend(*decode, decode=True, iters=3 if quick else 50)
        for s in factors:
            ms, _ = _attend(*decode, decode=True, splits=s, iters=3 if quick else 50, calls=calls)
            tbps = kv_bytes(batch, ctx) / ms / 1e9
            rows.append(dict(impl="graphrt", batch=batch, context=ctx, splits=s, picked=s == picked, ms=ms,
                             calls_per_graph=calls, lone_ms=lone if s == picked else None, tbps=tbps,
                             of_copy=tbps / env["copy_tbps"]))
            print(f"batch {batch:3d} ctx {ctx:6d} splits {s:2d}{' (picked)' if s == picked else '         '}: "
                  f"{1000 * ms:8.1f} us  {tbps:5.2f} TB/s = {tbps / env['copy_tbps']:.2f} x copy"
                  + (f"  (alone in its graph: {1000 * lone:.1f} us)" if s == picked else ""), flush=True)
    print(f"wrote {write(args.out, 'sweep_splits' if not quick else 'sweep_splits_quick', rows, env)}")


if __name__ == "__main__":
    main()
