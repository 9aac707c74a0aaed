"""Host µs of each piece of one ``rt.step``, timed one piece at a time in one process: the
per-piece breakdown behind ``graphrt bench runtime``'s host figure (``graphrt bench host``,
``host.json``).

Pieces (decode steps of the toy model, context 1024): ``Step.from_arrays``,
``Step.validate``, ``GraphSet.pick`` + the replay guard, ``StepBuffers.pack``,
``StepBuffers.copy`` (the pinned copy and its event), the graph replay alone, a bare
pinned ``copy_`` of the same bytes, and the whole ``rt.step`` with the Step built inside.
Each figure is the median over 1000 calls (20 with ``--quick``) after a warm-up; the GPU
is synchronised every 50 calls so that the ring of staging slots never makes the host wait. On CPU the
graph pieces are absent and the copy is a host memcpy.
"""

from __future__ import annotations

from pathlib import Path

import torch

from graphrt.bench.common import captured_decode, host_median_us, quick_out_main, write


def pieces(layers: int, batch: int, reps: int, quick: bool) -> dict:
    from graphrt import Step

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    context = 48 if quick else 1024
    rt, arrays, ids = captured_decode(layers, batch, context, small=not cuda)
    cfg = rt.cfg
    step = Step.from_arrays(**arrays)
    step.validate(cfg)
    row = dict(bench="host", impl="graphrt", layers=layers, batch=batch, context=context)
    row["from_arrays_us"] = host_median_us(lambda: Step.from_arrays(**arrays), reps, sync)
    row["validate_us"] = host_median_us(lambda: step.validate(cfg), reps, sync)
    layout = rt.buffers.layout(batch, batch)
    captured = None
    if rt.graphs is not None:
        captured = rt.graphs.pick(batch, batch, True)
        layout = rt._prepared[captured.bucket][0]

        def pick_and_guard():
            rt.graphs.pick(step.num_seqs, step.num_tokens, step.is_decode)
            rt.graphs.check_guard()

        row["pick_guard_us"] = host_median_us(pick_and_guard, reps, sync)
    row["pack_us"] = host_median_us(lambda: rt.buffers.pack(step, layout, ids), reps, sync)
    nbytes = layout.copy_bytes(step.block_columns)
    row["copy_bytes"] = nbytes
    row["copy_us"] = host_median_us(lambda: rt.buffers.copy(0, nbytes), reps, sync)
    staging, arena = rt.buffers.staging[0], rt.buffers.arena
    row["bare_copy_us"] = host_median_us(lambda: arena[:nbytes].copy_(staging[:nbytes], non_blocking=True), reps,
                                         sync)
    if captured is not None:
        row["replay_us"] = host_median_us(lambda: rt.graphs.replay(captured), reps, sync)
    row["step_us"] = host_median_us(lambda: rt.step(Step.from_arrays(**arrays), ids), reps, sync)
    return row


def run(*, quick: bool, out: Path, quiet: bool = False) -> list[dict]:
    small = quick or not torch.cuda.is_available()
    reps = 20 if small else 1000
    cells = [(1, 1), (1, 4)] if small else [(1, 1), (8, 1), (32, 256)]
    rows = [pieces(layers, batch, reps, small) for layers, batch in cells]
    for r in rows:
        print("  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                        if k not in ("bench", "impl")))
    path = write(out, "host" if not small else "host_quick", rows)
    if not quiet:
        print(f"wrote {path}")
    return rows


def main(argv: list[str] | None = None) -> None:
    quick_out_main(run, __doc__, argv)
