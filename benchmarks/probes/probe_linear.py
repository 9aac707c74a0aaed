"""Question: at a decode step's few rows, how close do the linear layers of a Llama come to the
copy ceiling — cuBLAS (``F.linear``, one weight at a time as the model calls it, or the
weights that share an input concatenated), graphrt's ``small_linear`` (a small config sweep;
the shared-input weights in one launch), and for one row Inductor's own code for the
matmul written as a multiply and sum? Each shape is timed as a CUDA graph of calls over
enough weight copies to miss L2; then a whole step's linear layers (every layer's own
weights and the LM head) as one graph, per method. GB/s = weight bytes / time.

    python3 benchmarks/probes/probe_linear.py [--models llama-1b,llama-8b] [--rows 1,8,32] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# (name, output rows of each weight sharing the input, input columns), per layer; "lm" once
SHAPES = {
    "llama-1b": dict(layers=16, shapes=[("qkv", [2048, 512, 512], 2048), ("o", [2048], 2048),
                                        ("gate_up", [8192, 8192], 2048), ("down", [2048], 8192),
                                        ("lm", [128256], 2048)]),
    "llama-8b": dict(layers=32, shapes=[("qkv", [4096, 1024, 1024], 4096), ("o", [4096], 4096),
                                        ("gate_up", [14336, 14336], 4096), ("down", [4096], 14336),
                                        ("lm", [128256], 4096)]),
}
L2_MISS_BYTES = 256 << 20


def graph_us(calls, reps: int = 20) -> float:
    """Median µs of one replay of a graph that makes ``calls`` (a list of thunks) in order."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def copy_ceiling_gbs() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = graph_us([lambda: dst.copy_(src)])
    return 2 * src.numel() / us / 1e3


def configs(rows: int):
    from graphrt.kernels.linear import LinearConfig
    if rows == 1:
        grid = itertools.product((4, 8, 16), (512, 1024), (4, 8), (1, 3))
    else:
        grid = itertools.product((16, 32, 64), (128, 256), (4,), (1, 3))
    return [LinearConfig(block_n=n, block_k=k, num_warps=w, num_stages=s) for n, k, w, s in grid]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="llama-1b,llama-8b")
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--inductor", action="store_true", help="also Inductor's multiply-and-sum for one row")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from graphrt.kernels.linear import default_linear_config, small_linear

    dev, dt = torch.device("cuda"), torch.bfloat16
    ceiling = copy_ceiling_gbs()
    print(json.dumps(dict(gpu=torch.cuda.get_device_name(), copy_gbs=round(ceiling))), flush=True)
    rows_out, best = [], {}
    for model in args.models.split(","):
        spec = SHAPES[model]
        for name, ns, k in spec["shapes"]:
            nbytes = sum(ns) * k * 2
            copies = max(1, min(32, L2_MISS_BYTES // nbytes))
            ws = [[torch.randn(n, k, device=dev, dtype=dt) for n in ns] for _ in range(copies)]
            cat = [torch.cat(w) for w in ws]
            for rows in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(rows, k, device=dev, dtype=dt)
                res = dict(model=model, shape=name, n=ns, k=k, rows=rows, mbytes=nbytes / 1e6)
                res["cublas_us"] = graph_us([lambda wi=wi: F.linear(x, wi) for w in ws for wi in w]) / copies
                res["cublas_cat_us"] = graph_us([lambda c=c: F.linear(x, c) for c in cat]) / copies
                ref = F.linear(x.float(), cat[0].float())
                got = torch.cat(small_linear(x, ws[0]), dim=1).float()
                res["max_err"] = (got - ref).abs().max().item()
                res["cublas_err"] = (F.linear(x, cat[0]).float() - ref).abs().max().item()
                t0 = time.perf_counter()
                sweep = []
                for cfg in configs(rows):
                    try:
                        us = graph_us([lambda w=w: small_linear(x, w, config=cfg) for w in ws]) / copies
                    except Exception as exc:          # a config that does not compile is a result too
                        print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                        continue
                    sweep.append((us, cfg))
                sweep.sort(key=lambda t: t[0])
                res["sweep_s"] = time.perf_counter() - t0
                res["graphrt_best_us"], cfg = sweep[0]
                res["graphrt_best_cfg"] = [cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages]
                res["graphrt_top3"] = [[round(u, 2), [c.block_n, c.block_k, c.num_warps, c.num_stages]]
                                       for u, c in sweep[:3]]
                d = default_linear_config(rows, sum(ns), k)
                res["graphrt_default_us"] = graph_us([lambda w=w: small_linear(x, w, config=d) for w in ws]) / copies
                best[(model, name, rows)] = cfg
                if args.inductor and rows == 1 and len(ns) == 1:
                    torch._inductor.config.coordinate_descent_tuning = True
                    fn = torch.compile(lambda x, w: (x.float()[:, None, :] * w.float()[None]).sum(-1).to(x.dtype),
                                       dynamic=False)
                    fn(x, ws[0][0])
                    res["inductor_sum_us"] = graph_us([lambda w=w: fn(x, w[0]) for w in ws]) / copies
                for key in [k_ for k_ in list(res) if k_.endswith("_us")]:
                    res[key.replace("_us", "_gbs")] = nbytes / res[key] / 1e3
                rows_out.append(res)
                print(json.dumps({k_: (round(v, 2) if isinstance(v, float) else v) for k_, v in res.items()}),
                      flush=True)
            del ws, cat
            torch.cuda.empty_cache()
        # a whole step's linear layers: every layer's own weights, then the LM head
        layers = spec["layers"]
        for rows in [int(r) for r in args.rows.split(",")]:
            per_layer = [s for s in spec["shapes"] if s[0] != "lm"]
            weights = [[[torch.randn(n, k, device=dev, dtype=dt) for n in ns] for _, ns, k in per_layer]
                       for _ in range(layers)]
            _, lm_n, lm_k = spec["shapes"][-1]
            lm = torch.randn(lm_n[0], lm_k, device=dev, dtype=dt)
            xs = {k: torch.randn(rows, k, device=dev, dtype=dt) for _, _, k in spec["shapes"]}
            total = sum(sum(w.numel() for w in ws) for lw in weights for ws in lw) * 2 + lm.numel() * 2
            step = dict(model=model, shape="step", rows=rows, mbytes=total / 1e6)
            sep = [lambda x=xs[w.shape[1]], w=w: F.linear(x, w) for lw in weights for ws in lw for w in ws]
            step["cublas_us"] = graph_us(sep + [lambda: F.linear(xs[lm_k], lm)])
            cats = [torch.cat(ws) if len(ws) > 1 else ws[0] for lw in weights for ws in lw]
            step["cublas_cat_us"] = graph_us([lambda x=xs[c.shape[1]], c=c: F.linear(x, c) for c in cats] +
                                             [lambda: F.linear(xs[lm_k], lm)])
            del cats
            ours = [lambda x=xs[ws[0].shape[1]], ws=ws, c=best[(model, name, rows)]: small_linear(x, ws, config=c)
                    for lw in weights for (name, _, _), ws in zip(per_layer, lw)]
            step["graphrt_us"] = graph_us(ours + [lambda c=best[(model, "lm", rows)]: small_linear(xs[lm_k], [lm],
                                                                                                   config=c)])
            for key in [k_ for k_ in list(step) if k_.endswith("_us")]:
                step[key.replace("_us", "_gbs")] = total / step[key] / 1e3
                step[key.replace("_us", "_of_copy")] = total / step[key] / 1e3 / ceiling
            rows_out.append(step)
            print(json.dumps({k_: (round(v, 3) if isinstance(v, float) else v) for k_, v in step.items()}),
                  flush=True)
            del weights, lm
            torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_linear.json").write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(),
                                                                    copy_gbs=ceiling, rows=rows_out), indent=1))


if __name__ == "__main__":
    main()
