"""GPU µs of one captured toy-model decode step (its graph replayed back to back, timed
with events): the figure ``graphrt bench runtime`` reports as gpu_us, for one cell, so
that two source trees can be compared in alternating fresh processes.

    PYTHONPATH=<tree site> python benchmarks/probe_step_gpu.py --layers 1 --batch 256
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
import torch


def main() -> None:
    import graphrt
    from graphrt import Runtime, RuntimeConfig, Step
    from graphrt.bench.common import decode_arrays
    from graphrt.toy import ToyModel

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    b = args.batch
    cfg = RuntimeConfig(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=b * 72,
                        max_num_seqs=b, max_num_tokens=b * 2, max_model_len=args.context + 64, max_prefix_ranges=8,
                        dtype=torch.bfloat16)
    model = ToyModel(cfg, num_layers=args.layers, hidden=1024, vocab=1024, device="cuda")
    cache = torch.randn(cfg.num_blocks, 16, cfg.num_kv_heads, cfg.head_dim, device="cuda").to(cfg.dtype)
    rt = Runtime(cfg, model, num_layers=args.layers, device="cuda",
                 kv_caches=([cache] * args.layers, [cache] * args.layers))
    rt.capture(decode_buckets=[b], mixed_buckets=[cfg.max_num_tokens], quiet=True)
    rt.step(Step.from_arrays(**decode_arrays(b, args.context, 16)), np.arange(b) % 1000)
    graph = rt.graphs.graphs[rt.last.bucket]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    figures = []
    for _ in range(5):
        rt.graphs.replay(graph)
        start.record()
        for _ in range(200):
            rt.graphs.replay(graph)
        end.record()
        end.synchronize()
        figures.append(1e3 * start.elapsed_time(end) / 200)
    print(json.dumps(dict(label=args.label, graphrt=graphrt.__file__, layers=args.layers, batch=b, context=args.context,
                          gpu_us=statistics.median(figures), all_us=figures)))


if __name__ == "__main__":
    main()
