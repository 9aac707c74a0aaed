"""The host pieces of a decode step without a GPU: ``Step.from_arrays``, ``Step.validate``,
``StepBuffers.pack`` (into a staging slot) and the copy's bytes, at context 1024 and batch
1, 64 and 256 (the toy runtime's small shapes: the host work does not depend on them
beyond the block table). Prints one JSON line ({label, rows}); for an A/B of two trees run
it under each tree's ``PYTHONPATH`` in turn (``benchmarks/probes/ab_host_cpu.sh``).

    python benchmarks/probes/probe_host_cpu.py --label head
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True)
    parser.add_argument("--reps", type=int, default=2000)
    args = parser.parse_args()
    import graphrt
    from graphrt import Step
    from graphrt.bench.common import decode_arrays, host_median_us, toy_runtime

    rows = []
    for batch in (1, 64, 256):
        rt = toy_runtime(1, batch, 1024, small=True)
        arrays, ids = decode_arrays(batch, 1024, rt.cfg.block_size), [i % 1000 for i in range(batch)]
        step = Step.from_arrays(**arrays)
        step.validate(rt.cfg)
        layout = rt.buffers.layout(batch, batch)

        def nothing():
            return None
        row = dict(batch=batch, context=1024)
        row["from_arrays_us"] = host_median_us(lambda: Step.from_arrays(**arrays), args.reps, nothing)
        row["validate_us"] = host_median_us(lambda: step.validate(rt.cfg), args.reps, nothing)
        row["pack_us"] = host_median_us(lambda: rt.buffers.pack(step, layout, ids), args.reps, nothing)
        row["copy_bytes"] = layout.copy_bytes(step.block_columns)
        rows.append(row)
    fast = getattr(getattr(graphrt, "_fast", None), "__file__", None)
    print(json.dumps(dict(label=args.label, cpu=platform.processor() or platform.machine(), fast_helper=bool(fast),
                          graphrt=os.path.dirname(graphrt.__file__), rows=rows)))


if __name__ == "__main__":
    main()
