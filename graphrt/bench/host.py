"""Host µs of each piece of one ``rt.step``, timed one piece at a time in one process: the
per-piece breakdown behind ``graphrt bench runtime``'s host figure (``graphrt bench host``,
``host.json``).

Pieces (decode steps of the toy model, context 1024): ``Step.from_arrays``,
``Step.validate``, ``GraphSet.pick`` + the replay guard, ``StepBuffers.pack``,
``StepBuffers.copy`` (the pinned copy and its event), the graph replay alone, a bare
pinned ``copy_`` of the same bytes, and the whole ``rt.step`` with the Step built inside.
Each round times every piece as the median over 1000 calls (20 with ``--quick``) after a
warm-up, the pieces one after another; a figure is the median of five rounds' medians
(two with ``--quick``), each round's kept beside it (``*_us_rounds``). The GPU is
synchronised every 50 calls, and the whole step's waits for a free staging slot are taken
out of its time, so that the figures are the host's own work.

Without a GPU the graph pieces are absent and the copy is a host memcpy; without
``--quick`` too, the cells are one layer at batch 1, 64 and 256 (2000 calls a piece) and
the whole step, there the interpreted model, is left out: what ``benchmarks/ab.py --which
host`` compares between two trees on a CPU machine.
"""

from __future__ import annotations

from pathlib import Path

import torch

from graphrt.bench.common import captured_decode, host_median_us, quick_out_main, summarize_rounds, write


ROUNDS = 5


def pieces(layers: int, batch: int, reps: int, quick: bool, rounds: int = ROUNDS) -> dict:
    from graphrt import Step

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    context = 48 if quick else 1024
    rt, arrays, ids = captured_decode(layers, batch, context, small=not cuda)
    cfg = rt.cfg
    step = Step.from_arrays(**arrays)
    step.validate(cfg)
    row = dict(bench="host", impl="graphrt", layers=layers, batch=batch, context=context, rounds=rounds, reps=reps)
    timed = {"from_arrays": lambda: Step.from_arrays(**arrays), "validate": lambda: step.validate(cfg)}
    layout = rt.buffers.layout(batch, batch)
    captured = None
    if rt.graphs is not None:
        captured = rt.graphs.pick(batch, batch, True)
        layout = rt._prepared[captured.bucket][0]

        def pick_and_guard():
            rt.graphs.pick(step.num_seqs, step.num_tokens, step.is_decode)
            rt.graphs.check_guard()

        timed["pick_guard"] = pick_and_guard
    timed["pack"] = lambda: rt.buffers.pack(step, layout, ids)
    nbytes = layout.copy_bytes(step.block_columns)
    row["copy_bytes"] = nbytes
    timed["copy"] = lambda: rt.buffers.copy(0, nbytes)
    staging, arena = rt.buffers.staging[0], rt.buffers.arena
    timed["bare_copy"] = lambda: arena[:nbytes].copy_(staging[:nbytes], non_blocking=True)
    if captured is not None:
        timed["replay"] = lambda: rt.graphs.replay(captured)
    if cuda or quick:       # (on a CPU host the whole step is the interpreted model: not host work)
        timed["step"] = lambda: rt.step(Step.from_arrays(**arrays), ids)
    # rounds interleave the pieces, so a slow spell of the host shows in every piece's
    # spread instead of in one piece's median; the whole step's ring waits are taken out
    # (with 1000 replays queued between syncs it would otherwise time the GPU)
    per_round = {name: [] for name in timed}
    for _ in range(rounds):
        for name, fn in timed.items():
            waited = (lambda: rt.buffers.wait_seconds) if name == "step" else None
            per_round[name].append(host_median_us(fn, reps, sync, waited))
    for name, values in per_round.items():
        summarize_rounds(row, f"{name}_us", values)
    return row


def run(*, quick: bool, out: Path, quiet: bool = False) -> list[dict]:
    if quick:
        reps, cells = 20, [(1, 1), (1, 4)]
    elif torch.cuda.is_available():
        reps, cells = 1000, [(1, 1), (1, 256), (8, 1), (32, 256)]
    else:                   # a CPU host: the host pieces alone at the batches that move them
        reps, cells = 2000, [(1, 1), (1, 64), (1, 256)]
    rows = [pieces(layers, batch, reps, quick, 2 if quick else ROUNDS) for layers, batch in cells]
    for r in rows:
        print("  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                        if k not in ("bench", "impl") and not k.endswith("_rounds")))
    path = write(out, "host_quick" if quick else "host", rows)
    if not quiet:
        print(f"wrote {path}")
    return rows


def main(argv: list[str] | None = None) -> None:
    quick_out_main(run, __doc__, argv)
