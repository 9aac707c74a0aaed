"""Question: what does each of small_linear's prologues and epilogues (the linear pass's
fusions) cost per launch, at one row and at eight, and which tile serves the fused one-row
launches best? Llama-1B's shapes in bf16 (q/k/v, gate/up, down, o). Each case is one CUDA
graph of LAYERS launches, each with its own weights (16 layers' worth, 1.9 GB: every launch
streams its weights from DRAM, as in a model's step; a case that reused one weight would
read it from L2), replayed REPEATS times back to back: µs a launch and the TB/s of its
weights; cuBLAS's o and down beside. ``--sweep``: the one-row fused launches also under
other tiles (block_n x block_k x warps), against the default config.

    python3 benchmarks/probes/probe_linear_fusions.py [--sweep] [--out DIR]
"""

import argparse
import itertools
import json
from pathlib import Path

import torch

from graphrt.kernels.linear import LinearConfig, default_linear_config, small_linear

LAYERS = 16
REPEATS = 3


def timed(launches) -> float:
    """µs a launch of ``launches`` (callables) captured in one graph, the graph replayed
    twice before the timed replay."""
    for f in launches:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPEATS):
            for f in launches:
                f()
    for _ in range(2):
        g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / (REPEATS * len(launches)) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    d, bf = torch.device("cuda"), torch.bfloat16
    print(torch.cuda.get_device_name(), flush=True)

    def weights(n, k, scale):
        return [torch.randn(n, k, device=d, dtype=bf) / scale for _ in range(LAYERS)]

    wq, wk, wv = weights(2048, 2048, 40), weights(512, 2048, 40), weights(512, 2048, 40)
    wg, wu = weights(8192, 2048, 40), weights(8192, 2048, 40)
    wd, wo = weights(2048, 8192, 90), weights(2048, 2048, 40)
    mbytes = {"qkv": 3072 * 2048 * 2e-6, "gu": 16384 * 2048 * 2e-6, "down": 2048 * 8192 * 2e-6,
              "o": 2048 * 2048 * 2e-6}
    rows = []
    for m in (1, 8):
        x, h = torch.randn(m, 2048, device=d, dtype=bf), torch.randn(m, 8192, device=d, dtype=bf)
        nw = torch.randn(2048, device=d, dtype=bf)
        r = torch.randn(m, 2048, device=d, dtype=bf)

        def cases(cfg=None):
            return {
                "qkv": lambda i: small_linear(x, [wq[i], wk[i], wv[i]], config=cfg),
                "qkv+norm": lambda i: small_linear(x, [wq[i], wk[i], wv[i]], norm_weight=nw, config=cfg),
                "gu": lambda i: small_linear(x, [wg[i], wu[i]], config=cfg),
                "gu+norm": lambda i: small_linear(x, [wg[i], wu[i]], norm_weight=nw, config=cfg),
                "down": lambda i: small_linear(h, [wd[i]], config=cfg),
                "down+gate": lambda i: small_linear(h, [wd[i]], gate=h, config=cfg),
                "down+gate+res": lambda i: small_linear(h, [wd[i]], gate=h, residual=r, config=cfg),
                "o": lambda i: small_linear(x, [wo[i]], config=cfg),
                "o+res": lambda i: small_linear(x, [wo[i]], residual=r, config=cfg),
                "cublas o": lambda i: x @ wo[i].T,
                "cublas down": lambda i: h @ wd[i].T,
            }

        def run(name, fn, cfg_label):
            us = timed([lambda i=i: fn(i) for i in range(LAYERS)])
            shape = name.split("+")[0].removeprefix("cublas ")
            row = dict(rows=m, case=name, config=cfg_label, us=round(us, 2),
                       tbps=round(mbytes[shape] / us, 2))
            rows.append(row)
            return row

        line = {name: run(name, fn, "default")["us"] for name, fn in cases().items()}
        print(m, "default", line, flush=True)
        if args.sweep and m == 1:
            for block_n, block_k, warps in itertools.product((4, 8, 16), (1024, 2048), (4, 8)):
                cfg = LinearConfig(block_n=block_n, block_k=block_k, num_warps=warps)
                label = f"{block_n}x{block_k}/{warps}w"
                line = {name: run(name, fn, label)["us"] for name, fn in cases(cfg).items()
                        if "+" in name}
                print(m, label, line, flush=True)
    print("defaults at one row:", {k: default_linear_config(1, n, kk) for k, (n, kk) in
                                   {"qkv": (3072, 2048), "gu": (16384, 2048), "down": (2048, 8192),
                                    "o": (2048, 2048)}.items()})
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_linear_fusions.json").write_text(
            json.dumps(dict(gpu=torch.cuda.get_device_name(), layers=LAYERS, repeats=REPEATS, rows=rows), indent=1))


if __name__ == "__main__":
    main()
