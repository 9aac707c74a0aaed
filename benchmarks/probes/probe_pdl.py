"""Question: how much of a one-row decode step's time above its weight bytes is kernel
boundaries, and does programmatic dependent launch (PDL: a kernel's programs start while the
kernel before it drains, and wait inside for its results) take it back — plain, or with each
matrix-vector kernel loading its first weight tile before it waits (weights do not depend on
the kernel before)?

A Llama-3.2-1B-shaped layer's kernels at one row, 16 layers, one CUDA graph: norm (one
program) -> q/k/v matrix-vector -> a small one-program kernel standing for rotary +
attention -> o -> norm -> gate/up -> SiLU*mul (one program) -> down. Every layer has its own
weights (121 MB a layer: the step misses L2). Variants: ``plain``; ``pdl`` (every kernel
launched with PDL, waiting at its start and letting its dependents launch at once);
``pdl_prefetch`` (as pdl, but each matrix-vector program loads its first weight tile before
it waits). Also the matrix-vector kernels alone (no small kernels between), and the floor:
the weight bytes at probe_linear's copy rate (bytes read and written by a 1 GB copy), same
run. Standalone kernels, not graphrt's: a probe of the mechanism.

    python3 benchmarks/probes/probe_pdl.py [--layers 16] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from probe_linear import copy_ceiling_gbs, graph_us    # (this directory is on sys.path when run as a script)


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GDC: tl.constexpr,
          PREFETCH: tl.constexpr):
    i = tl.program_id(0)
    o_n = i * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    p_w = w_ptr + o_n.to(tl.int64)[:, None] * K
    o_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PREFETCH:
        w0 = tl.load(p_w + o_k[None, :], mask=m_n[:, None] & (o_k < K)[None, :], other=0.0)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if PREFETCH:
        x0 = tl.load(x_ptr + o_k, mask=o_k < K, other=0.0)
        acc += w0.to(tl.float32) * x0.to(tl.float32)[None, :]
        start = BLOCK_K
    else:
        start = 0
    for k0 in range(start, K, BLOCK_K):
        o = k0 + o_k
        w = tl.load(p_w + o[None, :], mask=m_n[:, None] & (o < K)[None, :], other=0.0)
        x = tl.load(x_ptr + o, mask=o < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + o_n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=m_n)


@triton.jit
def _small(x_ptr, y_ptr, N_IN, N_OUT, BLOCK: tl.constexpr, GDC: tl.constexpr):
    # one program: y[:N_OUT] = x[:N_OUT] * rsqrt(mean(x[:N_IN]^2)) (a norm's shape of work)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    o = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + o, mask=o < N_IN, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / N_IN + 1e-6)
    tl.store(y_ptr + o, (x * r).to(y_ptr.dtype.element_ty), mask=o < N_OUT)


def gemv(x, w, y, gdc, prefetch):
    n, k = w.shape
    bn, bk = 4, 1024
    _gemv[(triton.cdiv(n, bn),)](x, w, y, n, k, BLOCK_N=bn, BLOCK_K=bk, GDC=gdc, PREFETCH=prefetch, num_warps=4,
                                 launch_pdl=gdc)


def small(x, y, n_in, n_out, gdc):
    _small[(1,)](x, y, n_in, n_out, BLOCK=triton.next_power_of_2(max(n_in, n_out)), GDC=gdc, num_warps=4,
                 launch_pdl=gdc)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    h, qkv, inter = 2048, 3072, 8192
    shapes = dict(qkv=(qkv, h), o=(h, h), gate_up=(2 * inter, h), down=(h, inter))
    ws = [{k: torch.randn(*s, device=dev, dtype=dt) * 0.02 for k, s in shapes.items()} for _ in range(args.layers)]
    nbytes = sum(w.numel() * 2 for layer in ws for w in layer.values())
    buf = {k: torch.randn(n, device=dev, dtype=dt) for k, n in
           dict(h=h, x=h, q=qkv, a=h, o=h, x2=h, gu=2 * inter, m=inter, d=h).items()}

    def step(gdc: bool, prefetch: bool, smalls: bool = True):
        for layer in ws:
            if smalls:
                small(buf["h"], buf["x"], h, h, gdc)
            gemv(buf["x"], layer["qkv"], buf["q"], gdc, prefetch)
            if smalls:
                small(buf["q"], buf["a"], qkv, h, gdc)
            gemv(buf["a"], layer["o"], buf["o"], gdc, prefetch)
            if smalls:
                small(buf["o"], buf["x2"], h, h, gdc)
            gemv(buf["x2"], layer["gate_up"], buf["gu"], gdc, prefetch)
            if smalls:
                small(buf["gu"], buf["m"], 2 * inter, inter, gdc)
            gemv(buf["m"], layer["down"], buf["d"], gdc, prefetch)

    copy_gbs = copy_ceiling_gbs()
    floor_us = nbytes / copy_gbs / 1e3
    res = dict(gpu=torch.cuda.get_device_name(), layers=args.layers, mbytes=nbytes / 1e6, copy_gbs=copy_gbs,
               floor_us=floor_us, torch=torch.__version__, triton=triton.__version__)
    ref = None
    for name, gdc, prefetch, smalls in [("plain", False, False, True), ("pdl", True, False, True),
                                        ("pdl_prefetch", True, True, True), ("gemv_only_plain", False, False, False),
                                        ("gemv_only_pdl_prefetch", True, True, False)]:
        try:
            us = graph_us([lambda: step(gdc, prefetch, smalls)], reps=30)
            step(gdc, prefetch, smalls)
            torch.cuda.synchronize()
            out = buf["d"].float().clone()
            if smalls:
                if ref is None:
                    ref = out
                res[f"{name}_matches_plain"] = bool(torch.equal(out, ref))
            res[f"{name}_us"] = us
            res[f"{name}_of_floor"] = us / floor_us
        except Exception as exc:          # PDL unsupported is a result too
            res[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_pdl.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
