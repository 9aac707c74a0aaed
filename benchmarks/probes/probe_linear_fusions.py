"""Question: what does each of small_linear's prologues and epilogues (the linear pass's
fusions) cost per launch, at one row and at eight? Llama-1B's shapes in bf16 (q/k/v, gate/up,
down, o), each launch 50 times in one CUDA graph, µs a launch; cuBLAS's o and down beside.

    python3 benchmarks/probes/probe_linear_fusions.py
"""

import torch

from graphrt.kernels.linear import small_linear


def timed(f, n: int = 50) -> float:
    f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            f()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n * 1000


def main() -> None:
    d, bf = torch.device("cuda"), torch.bfloat16
    print(torch.cuda.get_device_name())
    for m in (1, 8):
        x, h = torch.randn(m, 2048, device=d, dtype=bf), torch.randn(m, 8192, device=d, dtype=bf)
        nw = torch.randn(2048, device=d, dtype=bf)
        wq, wk, wv = [torch.randn(n, 2048, device=d, dtype=bf) / 40 for n in (2048, 512, 512)]
        wg, wu = [torch.randn(8192, 2048, device=d, dtype=bf) / 40 for _ in range(2)]
        wd, wo = torch.randn(2048, 8192, device=d, dtype=bf) / 90, torch.randn(2048, 2048, device=d, dtype=bf) / 40
        r = torch.randn(m, 2048, device=d, dtype=bf)
        cases = {"qkv": lambda: small_linear(x, [wq, wk, wv]),
                 "qkv+norm": lambda: small_linear(x, [wq, wk, wv], norm_weight=nw),
                 "gu": lambda: small_linear(x, [wg, wu]), "gu+norm": lambda: small_linear(x, [wg, wu], norm_weight=nw),
                 "down": lambda: small_linear(h, [wd]), "down+gate": lambda: small_linear(h, [wd], gate=h),
                 "down+gate+res": lambda: small_linear(h, [wd], gate=h, residual=r),
                 "o": lambda: small_linear(x, [wo]), "o+res": lambda: small_linear(x, [wo], residual=r),
                 "cublas o": lambda: x @ wo.T, "cublas down": lambda: h @ wd.T}
        print(m, {k: round(timed(f), 1) for k, f in cases.items()}, flush=True)


if __name__ == "__main__":
    main()
