"""Soak: many replays of random steps (every bucket, decode and mixed, image ranges) with
the host running ahead, a sample checked against float64 reference attention, GPU memory
and host time watched.

A sampled step is checked right after it runs: a ``ReferenceRunner`` sharing the
runtime's KV caches recomputes it from the same cache contents. Figures: mismatches,
allocated / reserved GPU memory after warm-up and at the end (the check's own cached
blocks are handed back after each check, so they do not count), host µs per step by
window of steps (stable when the windows agree), buckets hit.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from graphrt.bench.common import default_out, progress, write


def random_step(rng: np.random.Generator, cfg, free: np.ndarray, *, decode: bool):
    """A random step: 1..max_num_seqs sequences with random contexts and images, blocks
    drawn from ``free`` (a permutation of the cache's blocks, reused step after step)."""
    from graphrt import Step

    n = int(rng.integers(1, cfg.max_num_seqs + 1))
    if decode:
        q = np.ones(n, np.int64)
    else:
        q = np.where(rng.random(n) < 0.5, 1, rng.integers(2, 256, n))
        q[0] = max(int(q[0]), 2)
        while q.sum() > cfg.max_num_tokens:
            q = np.maximum(q // 2, 1)
    ctx = rng.integers(0, cfg.max_model_len - int(q.max()) - 1, n)
    seq_lens = ctx + q
    per = -(-seq_lens // cfg.block_size)
    if per.sum() > free.size:              # keep within the cache: shorten contexts
        ctx = np.minimum(ctx, 64)
        seq_lens = ctx + q
        per = -(-seq_lens // cfg.block_size)
    table = np.zeros((n, int(per.max())), np.int64)
    table[np.arange(per.max()) < per[:, None]] = free[: per.sum()]
    rng.shuffle(free)
    ranges = np.zeros((n, cfg.max_prefix_ranges, 2), np.int64)
    counts = np.zeros(n, np.int64)
    for i in range(n):
        if rng.random() < 0.5 and seq_lens[i] >= 4:       # one image somewhere in the sequence
            s = int(rng.integers(0, seq_lens[i] - 2))
            e = int(rng.integers(s + 1, min(seq_lens[i], s + 300) + 1))
            ranges[i, 0], counts[i] = (s, e), 1
    return Step.from_arrays(q_lens=q, context_lens=ctx, block_table=table, block_counts=per,
                            prefix_ranges=ranges, range_counts=counts)


def run(*, quick: bool, out: Path, quiet: bool = False, steps: int | None = None) -> list[dict]:
    from graphrt import ReferenceRunner, Runtime, RuntimeConfig
    from graphrt.toy import ToyModel

    cuda = torch.cuda.is_available()
    small = quick or not cuda
    device = "cuda" if cuda else "cpu"
    steps = steps or (12 if small else 10_000)
    every = 4 if small else 50
    warm = 2 if small else 500
    cfg = RuntimeConfig(num_q_heads=4 if small else 32, num_kv_heads=2 if small else 8, head_dim=64 if small else 128,
                        block_size=16, num_blocks=256 if small else 16384, max_num_seqs=4 if small else 64,
                        max_num_tokens=64 if small else 2048, max_model_len=160 if small else 4096,
                        max_prefix_ranges=2, dtype=torch.float32 if small else torch.bfloat16)
    layers = 2 if small else 4
    model = ToyModel(cfg, num_layers=layers, hidden=64 if small else 512, vocab=256, window=64, device=device)
    rt = Runtime(cfg, model, num_layers=layers, device=device, strict=cuda)
    graphs = rt.capture(quiet=quiet)
    ref = ReferenceRunner(cfg, model, num_layers=layers, device=device, kv_caches=(rt.k_caches, rt.v_caches))
    rng = np.random.default_rng(0)
    free = rng.permutation(cfg.num_blocks)
    tol = 5e-2 if cfg.dtype == torch.bfloat16 else 2e-3
    host_us, buckets, checked, mismatches, worst = [], {}, 0, 0, 0.0
    mem_warm, check_s, start = None, 0.0, time.perf_counter()
    for i in progress(range(steps), "soak", quiet):
        step = random_step(rng, cfg, free, decode=bool(rng.random() < 0.6))
        ids = rng.integers(0, 256, step.num_tokens)
        waited = rt.buffers.wait_seconds
        t0 = time.perf_counter()
        _, logits = rt.step(step, ids)
        host_us.append(1e6 * (time.perf_counter() - t0 - (rt.buffers.wait_seconds - waited)))
        label = str(rt.last.bucket) if rt.last.bucket else "eager"
        buckets[label] = buckets.get(label, 0) + 1
        if i % every == every - 1:         # the loop reads back here, as a real loop samples a token
            t1 = time.perf_counter()
            got = logits[: step.num_seqs].double().cpu()
            want = ref.step(step, ids)[1][: step.num_seqs].double().cpu()
            err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
            worst = max(worst, err)
            checked += 1
            mismatches += err > tol
            del got, want
            # The float64 check allocates on the GPU too; hand its cached blocks back so the
            # reserved figures below are the runtime's (graph pools are not released by this).
            if cuda:
                torch.cuda.empty_cache()
            check_s += time.perf_counter() - t1
        if i == warm - 1 and cuda:
            torch.cuda.synchronize()
            mem_warm = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
    if cuda:
        torch.cuda.synchronize()
    wall_s = time.perf_counter() - start
    mem_end = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) if cuda else (0, 0)
    window = max(steps // 10, 1)
    windows = [float(np.median(host_us[k: k + window])) for k in range(0, steps - window + 1, window)]
    row = dict(bench="soak", impl="graphrt_graph" if cuda else "graphrt_eager", steps=steps, checked=checked,
               mismatches=mismatches, worst_rel_error=worst, tolerance=tol, buckets_captured=len(graphs),
               buckets_hit=len(buckets), replays=sum(v for k, v in buckets.items() if k != "eager"),
               eager=buckets.get("eager", 0), host_us=float(np.median(host_us)), host_us_windows=windows,
               host_us_spread=max(windows) / min(windows),
               allocated_after_warmup=mem_warm[0] if mem_warm else None, allocated_end=mem_end[0],
               reserved_after_warmup=mem_warm[1] if mem_warm else None, reserved_end=mem_end[1],
               ring_wait_s=rt.buffers.wait_seconds, wall_s=wall_s, check_s=check_s)
    print(f"soak: {steps} steps ({row['replays']} replays over {len(buckets)} buckets, {row['eager']} eager), "
          f"{checked} checked, {mismatches} mismatches (worst {worst:.2e}, tolerance {tol:g}); "
          f"{wall_s:.1f} s, {check_s:.1f} s of it checking")
    print(f"  host us per step by window of {window}: {', '.join(f'{w:.0f}' for w in windows)} "
          f"(max/min {row['host_us_spread']:.2f})")
    if cuda:
        print(f"  GPU memory allocated / reserved: after warm-up {mem_warm[0]} / {mem_warm[1]}, "
              f"at the end {mem_end[0]} / {mem_end[1]} bytes")
    path = write(out, "soak" if not small else "soak_quick", [row])
    if not quiet:
        print(f"wrote {path}")
    return [row]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    run(quick=args.quick, out=args.out or default_out(), steps=args.steps)
