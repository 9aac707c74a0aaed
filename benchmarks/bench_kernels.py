"""Kernel throughput on the GPU, timed as CUDA graph replays, beside measured ceilings.

    python benchmarks/bench_kernels.py [--quick] [--only decode,prefill]

decode:  KV bytes read / time, against the device-to-device copy bandwidth (read + write)
         measured in the same run.
prefill: attention TFLOP/s (4 * heads * head_dim * visible (q, k) pairs), against the bf16
         matmul rate measured in the same run; torch SDPA (flash, causal) beside it.
bf16, 32 query heads, 8 KV heads, head_dim 128, KV block 16.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import write  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
DT = torch.bfloat16


def replay_ms(fn, *, iters: int = 50) -> float:
    """Median ms of one call of ``fn`` as a graph replay (warm-up, capture, replay)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def ceilings() -> dict:
    """Device-to-device copy bandwidth (bytes read + written; the best of a memcpy and a
    copy kernel over 4 GiB) and the bf16 matmul rate on random data."""
    src = torch.empty(2 * 1024 ** 3, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    nbytes = 2 * src.numel() * src.element_size()
    copy_tbps = max(nbytes / replay_ms(lambda: dst.copy_(src), iters=20) / 1e9,
                    nbytes / replay_ms(lambda: torch.mul(src, 1, out=dst), iters=20) / 1e9)
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=DT)
    b = torch.randn(8192, 8192, device="cuda", dtype=DT)
    ms = replay_ms(lambda: a @ b, iters=20)
    return dict(copy_tbps=copy_tbps, matmul_tflops=2 * 8192 ** 3 / ms / 1e9)


def make_meta(q_lens, ctx_lens, ranges, max_ranges=2):
    from graphrt.kernels import AttentionMetadata

    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    blocks = [-(-s // BS) for s in seq_lens]
    width = max(blocks)
    perm = torch.randperm(sum(blocks), device="cuda", dtype=torch.int64).to(torch.int32)
    table = torch.zeros(len(q_lens), width, dtype=torch.int32, device="cuda")
    at = 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[at: at + n]
        at += n
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device="cuda")
    pr = torch.zeros(len(q_lens), max_ranges, 2, dtype=torch.int32)
    for i, rs in enumerate(ranges):
        for j, r in enumerate(rs):
            pr[i, j] = torch.tensor(r)
    meta = AttentionMetadata(query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
                             block_table=table, prefix_ranges=pr.cuda(),
                             slot_mapping=torch.full((sum(q_lens),), -1, dtype=torch.int64, device="cuda"))
    return meta, sum(blocks)


def splits_for(batch: int) -> int:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return max(1, min(16, (2 * sms) // (batch * HKV)))


def bench_decode(rows, env, batches, contexts):
    from graphrt.kernels import paged_attention, split_workspace

    for ctx in contexts:
        for batch in batches:
            meta, nblk = make_meta([1] * batch, [ctx - 1] * batch, [[]] * batch)
            kc = torch.empty(nblk, BS, HKV, D, device="cuda", dtype=DT).normal_()
            vc = torch.empty_like(kc).normal_()
            q = torch.randn(batch, HQ, D, device="cuda", dtype=DT)
            out = torch.empty_like(q)
            splits = splits_for(batch)
            ws = split_workspace(batch, HQ, D, splits, "cuda") if splits > 1 else None
            ms = replay_ms(lambda: paged_attention(q, kc, vc, out, meta, num_splits=splits, workspace=ws,
                                                   max_query_len=1))
            kv_bytes = 2 * batch * ctx * HKV * D * 2
            tbps = kv_bytes / ms / 1e9
            rows.append(dict(bench="decode", impl="graphrt", batch=batch, context=ctx, splits=splits, ms=ms,
                             tbps=tbps, of_copy=tbps / env["copy_tbps"]))
            print(f"decode batch={batch:4d} ctx={ctx:6d} splits={splits:2d}: {ms * 1e3:8.1f} us "
                  f"{tbps:5.2f} TB/s ({100 * tbps / env['copy_tbps']:.0f}% of copy)", flush=True)
            del kc, vc


def causal_pairs(n: int, ranges=()) -> int:
    """Visible (query, key) pairs of an n-token causal prefill; each range of length L adds
    the L * (L - 1) / 2 later keys its tokens also see."""
    return n * (n + 1) // 2 + sum((e - s) * (e - s - 1) // 2 for s, e in ranges)


def bench_prefill(rows, env, sizes):
    import torch.nn.functional as F

    from graphrt.kernels import paged_attention

    for n in sizes:
        for name, ranges in (("prefill", []), ("prefill_ranges", [(n // 4, n // 4 + 256), (n // 2, n // 2 + 256)])):
            meta, nblk = make_meta([n], [0], [ranges])
            kc = torch.empty(nblk, BS, HKV, D, device="cuda", dtype=DT).normal_()
            vc = torch.empty_like(kc).normal_()
            q = torch.randn(n, HQ, D, device="cuda", dtype=DT)
            out = torch.empty_like(q)
            ms = replay_ms(lambda: paged_attention(q, kc, vc, out, meta), iters=20)
            flops = 4 * HQ * D * causal_pairs(n, ranges)
            tflops = flops / ms / 1e9
            rows.append(dict(bench=name, impl="graphrt", tokens=n, ms=ms, tflops=tflops,
                             of_matmul=tflops / env["matmul_tflops"]))
            print(f"{name:15s} tokens={n:6d}: {ms:8.3f} ms {tflops:6.1f} TFLOP/s "
                  f"({100 * tflops / env['matmul_tflops']:.0f}% of matmul)", flush=True)
            if not ranges:
                qs = torch.randn(1, HQ, n, D, device="cuda", dtype=DT)
                ks = torch.randn(1, HKV, n, D, device="cuda", dtype=DT)
                vs = torch.randn(1, HKV, n, D, device="cuda", dtype=DT)
                ms = replay_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True),
                               iters=20)
                tflops = 4 * HQ * D * (n * (n + 1) // 2) / ms / 1e9
                rows.append(dict(bench=name, impl="sdpa", tokens=n, ms=ms, tflops=tflops,
                                 of_matmul=tflops / env["matmul_tflops"]))
                print(f"{name:15s} tokens={n:6d}: {ms:8.3f} ms {tflops:6.1f} TFLOP/s  torch SDPA", flush=True)
            del kc, vc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="decode,prefill")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU; nothing to measure here")
        return
    env = ceilings()
    print(f"ceilings: copy {env['copy_tbps']:.2f} TB/s, bf16 matmul {env['matmul_tflops']:.0f} TFLOP/s", flush=True)
    rows: list[dict] = []
    only = set(args.only.split(","))
    if "decode" in only:
        bench_decode(rows, env, [1, 8] if args.quick else [1, 8, 64, 256],
                     [1024] if args.quick else [1024, 8192, 32768])
    if "prefill" in only:
        bench_prefill(rows, env, [1024] if args.quick else [4096, 16384])
    print(f"wrote {write('kernels', rows, env)}")


if __name__ == "__main__":
    main()
