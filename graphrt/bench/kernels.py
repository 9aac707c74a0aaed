"""Kernel throughput, timed as CUDA graph replays, beside ceilings measured in the same run.

decode:   KV bytes read / time, against the device-to-device copy bandwidth (read + write);
          also with an fp8 (e4m3) cache, as time against the bf16 cache's (``of_bf16``).
prefill:  attention TFLOP/s (4 * heads * head_dim * visible (q, k) pairs), against the
          bf16 matmul rate; torch SDPA (causal) and compiled flex_attention beside it.
mixed:    4 fresh 512-token prefills + 60 decodes at 4k in one launch, against the sum of
          the decode-only and prefill-only launches.
bf16, 32 query heads, 8 KV heads, head_dim 128, KV block 16 (small shapes with --quick).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from graphrt.bench.common import default_out, plot, progress, sdpa_backend, time_ms, write

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# The GPU shapes of the targets; the CPU (--quick) keeps the kernels honest only.
HQ, HKV, D, BS = (32, 8, 128, 16) if CUDA else (4, 2, 64, 16)
DT = torch.bfloat16 if CUDA else torch.float32


def ceilings(quick: bool) -> dict:
    """Device-to-device copy bandwidth (bytes read + written; the best of a memcpy and a
    copy kernel) and the matmul rate, both on random data."""
    n = 2 * 1024 ** 3 if CUDA and not quick else 16 * 1024 ** 2
    src = torch.empty(n, dtype=DT, device=DEV).normal_()
    dst = torch.empty_like(src)
    nbytes = 2 * src.numel() * src.element_size()
    copy_tbps = max(nbytes / time_ms(lambda: dst.copy_(src), iters=20) / 1e9,
                    nbytes / time_ms(lambda: torch.mul(src, 1, out=dst), iters=20) / 1e9)
    del src, dst
    m = 8192 if CUDA and not quick else 256
    a = torch.randn(m, m, device=DEV, dtype=DT)
    b = torch.randn(m, m, device=DEV, dtype=DT)
    return dict(copy_tbps=copy_tbps, matmul_tflops=2 * m ** 3 / time_ms(lambda: a @ b, iters=20) / 1e9)


def make_meta(q_lens, ctx_lens, ranges):
    """Metadata for a batch through graphrt's own step path, every sequence's blocks at
    random places in the cache. Returns (meta, number of blocks)."""
    import numpy as np

    from graphrt import RuntimeConfig, Step, build_metadata

    seq_lens = np.add(q_lens, ctx_lens)
    per = -(-seq_lens // BS)
    table = np.zeros((len(q_lens), int(per.max())), np.int64)
    table[np.arange(per.max()) < per[:, None]] = np.random.permutation(int(per.sum()))
    padded = np.zeros((len(q_lens), 2, 2), np.int64)
    for i, rs in enumerate(ranges):
        if rs:
            padded[i, : len(rs)] = rs
    step = Step.from_arrays(q_lens=q_lens, context_lens=ctx_lens, block_table=table, block_counts=per,
                            prefix_ranges=padded, range_counts=[len(r) for r in ranges])
    cfg = RuntimeConfig(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS, num_blocks=int(per.sum()),
                        max_num_seqs=len(q_lens), max_num_tokens=step.num_tokens, max_model_len=int(seq_lens.max()),
                        max_prefix_ranges=2, dtype=DT)
    meta, _ = build_metadata(step, cfg, DEV)
    return meta, int(per.sum())


def _caches(nblk: int, fp8: bool = False):
    kc = torch.empty(nblk, BS, HKV, D, device=DEV, dtype=DT).normal_()
    vc = torch.empty_like(kc).normal_()
    if fp8:
        return kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    return kc, vc


# Small decode launches are timed as one of several calls in one graph, each over its own
# cache (as the layers of a model step): a lone replay's time is mostly the graph launch's
# own latency, and the same cache read again would come from L2 (50 MiB on the H200). Up to
# this many calls, until the caches add up to COLD_BYTES.
MAX_CALLS_PER_GRAPH = 32
COLD_BYTES = 128 * 2 ** 20


def calls_per_graph(kv_bytes: int) -> int:
    """Calls in one timed graph for a launch reading ``kv_bytes`` of cache (1 for large ones)."""
    return max(1, min(MAX_CALLS_PER_GRAPH, -(-COLD_BYTES // max(kv_bytes, 1)))) if CUDA else 1


def _attend(q_lens, ctx_lens, ranges, *, decode: bool, iters: int = 50, fp8: bool = False, config=None,
            splits: int | None = None, calls: int = 1, new_kv: bool = False):
    """(ms, splits) of one paged_attention launch over fresh random data; ``config``: a
    ``KernelConfig`` instead of the table's; ``splits``: a split factor instead of
    ``decode_splits``'; ``calls``: launches in the timed graph, each with its own cache and
    query (ms is per launch); ``new_kv``: the launch is given the new tokens' K/V, writes
    them into the cache and attends over them (a layer's whole attention)."""
    from graphrt.kernels import decode_splits, paged_attention, split_workspace

    meta, nblk = make_meta(q_lens, ctx_lens, ranges)
    scales = dict(k_scale=torch.ones(HKV, device=DEV), v_scale=torch.ones(HKV, device=DEV)) if fp8 else {}
    if splits is None:
        splits = decode_splits(len(q_lens), HKV, DEV) if decode else 1
    layers = []
    for _ in range(calls):
        kc, vc = _caches(nblk, fp8)
        q = torch.randn(sum(q_lens), HQ, D, device=DEV, dtype=DT)
        ws = split_workspace(q.shape[0], HQ, D, splits, DEV) if splits > 1 else None
        kv = {}
        if new_kv:
            kv["new_kv"] = tuple(torch.randn(q.shape[0], HKV, D, device=DEV, dtype=DT) for _ in range(2))
        layers.append((q, kc, vc, torch.empty_like(q), ws, kv))

    def run():
        for q, kc, vc, out, ws, kv in layers:
            paged_attention(q, kc, vc, out, meta, num_splits=splits, workspace=ws,
                            max_query_len=1 if decode else None, config=config, **scales, **kv)

    return time_ms(run, iters=iters) / calls, splits


def kv_bytes(batch: int, ctx: int, itemsize: int = 2) -> int:
    """Cache bytes a decode launch reads (K and V)."""
    return 2 * batch * ctx * HKV * D * itemsize


def _tile(**kwargs) -> dict:
    """The table's tile for a launch (``default_config``'s keywords), for the JSON:
    rows (tokens x query heads per KV head) x keys, warps, stages."""
    import triton

    from graphrt.kernels import default_config

    c = default_config(D, DT, HQ // HKV, **kwargs)
    rows = c.block_q * triton.next_power_of_2(HQ // HKV)
    return {"tile": f"{rows}x{c.block_n} w{c.num_warps} s{c.num_stages}"}


def bench_decode(rows, env, batches, contexts, quiet):
    for ctx in contexts:
        for batch in progress(batches, f"decode ctx={ctx}", quiet):
            decode = ([1] * batch, [ctx - 1] * batch, [[]] * batch)
            calls = calls_per_graph(kv_bytes(batch, ctx))
            ms, splits = _attend(*decode, decode=True, calls=calls)
            tbps = kv_bytes(batch, ctx) / ms / 1e9
            rows.append(dict(bench="decode", impl="graphrt", batch=batch, context=ctx, splits=splits, ms=ms,
                             calls_per_graph=calls, tbps=tbps, of_copy=tbps / env["copy_tbps"],
                             **_tile(max_query_len=1)))
            calls8 = calls_per_graph(kv_bytes(batch, ctx, 1))
            ms8, _ = _attend(*decode, decode=True, fp8=True, calls=calls8)
            tbps8 = kv_bytes(batch, ctx, 1) / ms8 / 1e9             # one byte an element
            rows.append(dict(bench="decode", impl="graphrt_fp8", batch=batch, context=ctx, splits=splits, ms=ms8,
                             calls_per_graph=calls8, tbps=tbps8, of_copy=tbps8 / env["copy_tbps"], of_bf16=ms8 / ms,
                             **_tile(max_query_len=1)))


def causal_pairs(n: int, ranges=()) -> int:
    """Visible (query, key) pairs of an n-token causal prefill; each range of length L adds
    the L * (L - 1) / 2 later keys its tokens also see."""
    return n * (n + 1) // 2 + sum((e - s) * (e - s - 1) // 2 for s, e in ranges)


def _flex_ms(n: int, ranges) -> float | None:
    """Compiled flex_attention on the same mask (None where it does not run)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    range_id = torch.full((n,), -1, dtype=torch.int32, device=DEV)
    for i, (s, e) in enumerate(ranges):
        range_id[s:e] = i

    def mask(b, h, qi, ki):
        return (qi >= ki) | ((range_id[qi] == range_id[ki]) & (range_id[qi] >= 0))

    block_mask = create_block_mask(mask, None, None, n, n, device=DEV)
    flex = torch.compile(flex_attention, dynamic=False)
    qs = torch.randn(1, HQ, n, D, device=DEV, dtype=DT)
    ks = torch.randn(1, HKV, n, D, device=DEV, dtype=DT)
    vs = torch.randn(1, HKV, n, D, device=DEV, dtype=DT)
    return time_ms(lambda: flex(qs, ks, vs, block_mask=block_mask, enable_gqa=True), iters=20, graph=False)


def bench_prefill(rows, env, sizes, flex: bool, quiet):
    import torch.nn.functional as F

    for n in progress(sizes, "prefill", quiet):
        for name, ranges in (("prefill", []), ("prefill_ranges", [(n // 4, n // 4 + min(256, n // 8)), (n // 2, n // 2 + min(256, n // 8))])):
            flops = 4 * HQ * D * causal_pairs(n, ranges)
            # graphrt: the launch given the new K/V (writes them, reads the new keys from them
            # in bulk copies); graphrt_cache: attention alone over a cache that holds them
            ms, _ = _attend([n], [0], [ranges], decode=False, iters=20, new_kv=True)
            ms_cache, _ = _attend([n], [0], [ranges], decode=False, iters=20)
            timings = {"graphrt": ms, "graphrt_cache": ms_cache}
            if not ranges:
                qs = torch.randn(1, HQ, n, D, device=DEV, dtype=DT)
                ks = torch.randn(1, HKV, n, D, device=DEV, dtype=DT)
                vs = torch.randn(1, HKV, n, D, device=DEV, dtype=DT)
                timings["sdpa"] = time_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                                                   enable_gqa=True), iters=20)
            if flex and CUDA:
                try:
                    timings["flex"] = _flex_ms(n, ranges)
                except Exception as exc:       # reported, not fatal: a peer that does not run here
                    print(f"flex_attention failed at n={n}: {type(exc).__name__}: {exc}"[:300])
            for impl, t in timings.items():
                if t is not None:
                    rows.append(dict(bench=name, impl=impl, tokens=n, ms=t, tflops=flops / t / 1e9,
                                     of_matmul=flops / t / 1e9 / env["matmul_tflops"],
                                     **(_tile(num_tokens=n) if impl.startswith("graphrt") else {})))


def record_sdpa_backends(rows: list[dict]) -> None:
    """Name on each SDPA row what torch ran for its shape (``sdpa_backend``; on CUDA the
    kernels, from the profiler). Called after every timing: the profiler's CUDA tracing
    should not sit under any figure."""
    for r in rows:
        if r.get("impl") == "sdpa":
            n = r["tokens"]
            qs, ks, vs = (torch.randn(1, h, n, D, device=DEV, dtype=DT) for h in (HQ, HKV, HKV))
            r.update(sdpa_backend(qs, ks, vs, is_causal=True, enable_gqa=True))


def bench_mixed(rows, env, prefills: int, prefill_len: int, decodes: int, ctx: int):
    """One launch for the mix against the decode-only and prefill-only launches."""
    q_lens = [prefill_len] * prefills + [1] * decodes
    ctx_lens = [0] * prefills + [ctx - 1] * decodes
    mixed, _ = _attend(q_lens, ctx_lens, [[]] * len(q_lens), decode=False, new_kv=True)
    dec, _ = _attend([1] * decodes, [ctx - 1] * decodes, [[]] * decodes, decode=True, new_kv=True)
    pre, _ = _attend([prefill_len] * prefills, [0] * prefills, [[]] * prefills, decode=False, new_kv=True)
    common = dict(bench="mixed", prefills=prefills, prefill_len=prefill_len, decodes=decodes, context=ctx)
    rows.append(dict(impl="graphrt", ms=mixed, of_parts=mixed / (dec + pre), **common,
                     **_tile(num_tokens=sum(q_lens))))
    rows.append(dict(impl="graphrt_decode_only", ms=dec, **common))
    rows.append(dict(impl="graphrt_prefill_only", ms=pre, **common))


def report(rows: list[dict], env: dict) -> None:
    print(f"ceilings: copy {env['copy_tbps']:.2f} TB/s, matmul {env['matmul_tflops']:.0f} TFLOP/s")
    for r in rows:
        if r["bench"] == "decode":
            fp8 = f" = {r['of_bf16']:.2f} x the {str(DT)[6:]} cache's time" if "of_bf16" in r else ""
            print(f"decode {'fp8 ' if 'of_bf16' in r else '    '}batch={r['batch']:4d} ctx={r['context']:6d} "
                  f"splits={r['splits']:2d}: {1e3 * r['ms']:9.1f} us {r['tbps']:5.2f} TB/s = {r['of_copy']:.2f} x copy"
                  f"{fp8}")
        elif r["bench"].startswith("prefill"):
            print(f"{r['bench']:15s} {r['impl']:13s} tokens={r['tokens']:6d}: {r['ms']:8.3f} ms {r['tflops']:6.1f} "
                  f"TFLOP/s = {r['of_matmul']:.2f} x matmul")
        elif r["bench"] == "mixed":
            extra = f" = {r['of_parts']:.2f} x (decode-only + prefill-only)" if "of_parts" in r else ""
            print(f"mixed    {r['impl']:21s}: {1e3 * r['ms']:9.1f} us{extra}")


def _plot(rows: list[dict], env: dict, path: Path) -> None:
    """Decode TB/s against the copy ceiling, prefill TFLOP/s against the matmul rate;
    ``env`` is the run's JSON env (gpu name and the ceilings)."""
    dec = [r for r in rows if r["bench"] == "decode" and r["impl"] == "graphrt"]
    series = {}
    for ctx in sorted({r["context"] for r in dec}):
        pts = sorted((r["batch"], r["tbps"]) for r in dec if r["context"] == ctx)
        series[f"context {ctx}"] = ([p[0] for p in pts], [p[1] for p in pts])
    pre = [r for r in rows if r["bench"].startswith("prefill")]
    pseries = {}
    for key in sorted({(r["bench"], r["impl"]) for r in pre}):
        pts = sorted((r["tokens"], r["tflops"]) for r in pre if (r["bench"], r["impl"]) == key)
        pseries[f"{key[1]} {key[0]}"] = ([p[0] for p in pts], [p[1] for p in pts])
    plot(path, f"graphrt kernels ({env.get('gpu') or 'cpu'})", [
        dict(title="decode", xlabel="batch", ylabel="TB/s (KV bytes / time)", series=series, logx=True,
             hline=(env["copy_tbps"], "D2D copy")),
        dict(title="prefill", xlabel="tokens", ylabel="TFLOP/s", series=pseries, logx=True,
             hline=(env["matmul_tflops"], "bf16 matmul")),
    ])


def run(*, quick: bool, out: Path, only: set[str] | None = None, flex: bool = True, quiet: bool = False) -> list[dict]:
    parts = {"decode", "prefill", "mixed"}
    only = only or parts
    if only - parts:
        raise ValueError(f"graphrt bench kernels: unknown part(s) {sorted(only - parts)}; choose from {sorted(parts)}")
    env = ceilings(quick)
    rows: list[dict] = []
    small = quick or not CUDA
    if "decode" in only:
        bench_decode(rows, env, [1, 4] if small else [1, 8, 64, 256], [64] if small else [1024, 8192, 32768], quiet)
    if "prefill" in only:
        bench_prefill(rows, env, [64] if small else [4096, 16384], flex and not small, quiet)
    if "mixed" in only:
        bench_mixed(rows, env, *((2, 16, 3, 48) if small else (4, 512, 60, 4096)))
    record_sdpa_backends(rows)
    report(rows, env)
    path = write(out, "kernels" if not small else "kernels_quick", rows, env)
    if not quiet:
        print(f"wrote {path}")
    _plot(rows, json.loads(path.read_text())["env"], out / ("kernels.png" if not small else "kernels_quick.png"))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (what the CPU test runs)")
    parser.add_argument("--only", default="decode,prefill,mixed")
    parser.add_argument("--no-flex", action="store_true", help="skip compiled flex_attention")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    run(quick=args.quick, out=args.out or default_out(), only=set(args.only.split(",")), flex=not args.no_flex)


def replot(json_path: Path) -> None:
    """Redraw kernels.png beside a results JSON (e.g. one copied back from the GPU)."""
    data = json.loads(Path(json_path).read_text())
    _plot(data["rows"], data["env"], Path(json_path).with_suffix(".png"))
