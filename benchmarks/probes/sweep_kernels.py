"""Sweep the attention kernel's tile table on the GPU (the data behind `default_config` and
`decode_splits`; see benchmarks/NOTES.md).

    python benchmarks/probes/sweep_kernels.py [--only decode,prefill] [--out DIR]

Decode: every (block_n, warps, stages) in DECODE x split factors per batch, at 8k and
32k context. Prefill: every (rows, block_n, warps, stages) in PREFILL on a 16k causal
prefill, 16k with two 256-token image ranges, 4k causal, and the mixed batch. Writes
sweep.json (rows with the config and the median ms) under --out.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from graphrt.bench import kernels as kb
from graphrt.bench.common import default_out, time_ms, write
from graphrt.kernels import KernelConfig, paged_attention, split_workspace

# decode: (block_n, warps, stages); split factors per batch
DECODE = [(128, 4, 2), (128, 4, 3), (64, 4, 2)]
SPLITS = {1: (16, 32, 64), 8: (4, 8), 64: (1, 2), 256: (1,)}
# prefill / mixed: (rows, block_n, warps, stages, short_block_n)
PREFILL = [(128, 64, 4, 3, 128), (128, 128, 8, 3, 128), (128, 64, 8, 3, 128), (256, 64, 8, 3, 128),
           (128, 64, 4, 3, 64), (128, 64, 4, 2, 128)]


def _case(q_lens, ctx_lens, ranges):
    meta, nblk = kb.make_meta(q_lens, ctx_lens, ranges)
    kc, vc = kb._caches(nblk)
    q = torch.randn(sum(q_lens), kb.HQ, kb.D, device=kb.DEV, dtype=kb.DT)
    return meta, kc, vc, q, torch.empty_like(q)


def _time(case, cfg, splits, iters):
    meta, kc, vc, q, out = case
    ws = split_workspace(q.shape[0], kb.HQ, kb.D, splits, kb.DEV) if splits > 1 else None
    try:
        return time_ms(lambda: paged_attention(q, kc, vc, out, meta, num_splits=splits, workspace=ws, config=cfg),
                       iters=iters)
    except Exception as exc:                  # e.g. out of shared memory for a config
        print(f"  {cfg} splits={splits}: {type(exc).__name__}: {str(exc)[:120]}")
        return None


def sweep_decode(rows, env, contexts=(8192, 32768)):
    for ctx in contexts:
        for batch, split_opts in SPLITS.items():
            case = _case([1] * batch, [ctx - 1] * batch, [[]] * batch)
            nbytes = 2 * batch * ctx * kb.HKV * kb.D * kb.DT.itemsize
            best = None
            for bn, warps, stages in DECODE:
                for splits in split_opts:
                    cfg = KernelConfig(block_q=4, block_n=bn, num_warps=warps, num_stages=stages)
                    ms = _time(case, cfg, splits, 30)
                    if ms is None:
                        continue
                    of_copy = nbytes / ms / 1e9 / env["copy_tbps"]
                    rows.append(dict(bench="decode", batch=batch, context=ctx, block_n=bn, warps=warps,
                                     stages=stages, splits=splits, ms=ms, of_copy=of_copy))
                    best = max(best or rows[-1], rows[-1], key=lambda r: r["of_copy"])
            print(f"decode batch={batch:3d} ctx={ctx}: best {best}", flush=True)
            del case
            torch.cuda.empty_cache()


def sweep_prefill(rows, env):
    cases = {
        "prefill_16k": ([16384], [0], [[]]),
        "prefill_ranges_16k": ([16384], [0], [[(4096, 4352), (8192, 8448)]]),
        "prefill_4k": ([4096], [0], [[]]),
        "mixed": ([512] * 4 + [1] * 60, [0] * 4 + [4095] * 60, [[]] * 64),
    }
    flops = {"prefill_16k": 4 * kb.HQ * kb.D * kb.causal_pairs(16384),
             "prefill_ranges_16k": 4 * kb.HQ * kb.D * kb.causal_pairs(16384, [(4096, 4352), (8192, 8448)]),
             "prefill_4k": 4 * kb.HQ * kb.D * kb.causal_pairs(4096)}
    for name, spec in cases.items():
        case = _case(*spec)
        for rws, bn, warps, stages, short_n in PREFILL:
            cfg = KernelConfig(block_q=rws // 4, block_n=bn, num_warps=warps, num_stages=stages, short_block_n=short_n)
            ms = _time(case, cfg, 1, 10)
            if ms is None:
                continue
            row = dict(bench=name, rows=rws, block_n=bn, warps=warps, stages=stages, short_block_n=short_n, ms=ms)
            if name in flops:
                row["tflops"] = flops[name] / ms / 1e9
            rows.append(row)
            print(f"{name:20s} rows={rws:3d} bn={bn:3d} w={warps} s={stages} short={short_n}: {ms:8.4f} ms "
                  f"{row.get('tflops', 0):6.1f} TFLOP/s", flush=True)
        del case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="decode,prefill")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    t0 = time.time()
    env = kb.ceilings(False)
    print(f"ceilings: {env}", flush=True)
    rows: list[dict] = []
    only = set(args.only.split(","))
    try:
        if "prefill" in only:
            sweep_prefill(rows, env)
        if "decode" in only:
            sweep_decode(rows, env)
    finally:                                  # keep what was measured when stopped (SIGINT)
        print(f"wrote {write(args.out or default_out(), 'sweep', rows, env)} after {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
