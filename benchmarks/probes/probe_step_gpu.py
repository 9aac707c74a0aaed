"""GPU µs of one captured toy-model decode step (its graph replayed back to back, timed
with events): the figure ``graphrt bench runtime`` reports as gpu_us, for one cell, so
that two source trees can be compared in alternating fresh processes.

    PYTHONPATH=<tree site> python benchmarks/probes/probe_step_gpu.py --layers 1 --batch 256
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def main() -> None:
    import graphrt
    from graphrt import Step
    from graphrt.bench.common import captured_decode

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    b = args.batch
    rt, arrays, ids = captured_decode(args.layers, b, args.context, small=False)
    rt.step(Step.from_arrays(**arrays), ids)
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
