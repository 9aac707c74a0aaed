"""Host µs of each piece of one ``rt.step``, timed one piece at a time in one process: the
per-piece breakdown behind ``graphrt bench runtime``'s host figure.

    python benchmarks/host_pieces.py [--quick] [--out DIR]      # writes host_pieces.json

Pieces (decode steps of the toy model, context 1024): ``Step.from_arrays``,
``Step.validate``, ``GraphSet.pick`` + the replay guard, ``StepBuffers.pack``,
``StepBuffers.copy`` (the pinned copy and its event), the graph replay alone, a bare
pinned ``copy_`` of the same bytes, and the whole ``rt.step`` with the Step built inside.
Each figure is the median over ``--reps`` calls after a warm-up; the GPU is synchronised
every 50 calls so that the ring of staging slots never makes the host wait. On CPU the
graph pieces are absent and the copy is a host memcpy.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from graphrt import Runtime, RuntimeConfig, Step
from graphrt.bench.common import decode_arrays, default_out, write
from graphrt.toy import ToyModel


def median_us(fn, reps: int, sync) -> float:
    for _ in range(20):
        fn()
    sync()
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if i % 50 == 49:
            sync()
    sync()
    return 1e6 * statistics.median(times)


def pieces(layers: int, batch: int, reps: int, quick: bool) -> dict:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    context = 48 if quick else 1024
    cfg = RuntimeConfig(num_q_heads=32 if cuda else 4, num_kv_heads=8 if cuda else 2, head_dim=128 if cuda else 32,
                        block_size=16, num_blocks=batch * 72, max_num_seqs=batch, max_num_tokens=batch * 2,
                        max_model_len=context + 64, max_prefix_ranges=8,
                        dtype=torch.bfloat16 if cuda else torch.float32)
    model = ToyModel(cfg, num_layers=layers, hidden=1024 if cuda else 32, vocab=1024, device=device)
    rt = Runtime(cfg, model, num_layers=layers, device=device)
    rt.capture(decode_buckets=[batch], mixed_buckets=[cfg.max_num_tokens], quiet=True)
    arrays = decode_arrays(batch, context, cfg.block_size)
    ids = np.arange(batch) % 1000
    step = Step.from_arrays(**arrays)
    step.validate(cfg)
    row = dict(bench="host_pieces", impl="graphrt", layers=layers, batch=batch, context=context)
    row["from_arrays_us"] = median_us(lambda: Step.from_arrays(**arrays), reps, sync)
    row["validate_us"] = median_us(lambda: step.validate(cfg), reps, sync)
    layout = rt.buffers.layout(batch, batch)
    captured = None
    if rt.graphs is not None:
        captured = rt.graphs.pick(batch, batch, True)
        layout = rt._layouts[captured.bucket]

        def pick_and_guard():
            rt.graphs.pick(step.num_seqs, step.num_tokens, step.is_decode)
            rt.graphs.check_guard()

        row["pick_guard_us"] = median_us(pick_and_guard, reps, sync)
    row["pack_us"] = median_us(lambda: rt.buffers.pack(step, layout, ids), reps, sync)
    nbytes = layout.copy_bytes(step.block_columns)
    row["copy_bytes"] = nbytes
    row["copy_us"] = median_us(lambda: rt.buffers.copy(0, nbytes), reps, sync)
    staging, arena = rt.buffers.staging[0], rt.buffers.arena
    row["bare_copy_us"] = median_us(lambda: arena[:nbytes].copy_(staging[:nbytes], non_blocking=True), reps, sync)
    if captured is not None:
        row["replay_us"] = median_us(lambda: rt.graphs.replay(captured), reps, sync)
    row["step_us"] = median_us(lambda: rt.step(Step.from_arrays(**arrays), ids), reps, sync)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repetitions")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    reps = args.reps or (20 if args.quick else 1000)
    cells = [(1, 1), (1, 4)] if args.quick else [(1, 1), (8, 1), (32, 256)]
    rows = [pieces(layers, batch, reps, args.quick) for layers, batch in cells]
    for r in rows:
        print("  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    path = write(args.out or default_out(), "host_pieces" if not args.quick else "host_pieces_quick", rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
