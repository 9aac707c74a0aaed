"""A few decode launches, eagerly, for Nsight Compute to read (``ncu`` wraps this script):

    ncu --clock-control none --kernel-name regex:_attn_kernel --launch-skip 1 --launch-count 1 \
        --section WarpStateStats ... python3 benchmarks/probes/probe_decode_ncu.py --batch 8 --context 1024

Shapes as ``graphrt bench kernels`` (bf16, 32/8 heads, head_dim 128, KV block 16, random
block placement); the split factor is ``decode_splits``' unless ``--splits`` is given.
Each launch runs three times (the first compiles)."""

from __future__ import annotations

import argparse
import dataclasses

from graphrt.bench.kernels import HKV, _caches, make_meta


def main() -> None:
    import torch

    from graphrt.kernels import decode_splits, default_config, paged_attention, split_workspace
    from graphrt.bench.kernels import D, DEV, DT, HQ

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--splits", type=int, default=None)
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--merge", choices=("auto", "fused", "launch"), default="auto",
                        help="the split-KV merge: as the config decides, inside the attention launch, or a "
                             "second launch")
    args = parser.parse_args()
    b, ctx = args.batch, args.context
    meta, nblk = make_meta([1] * b, [ctx - 1] * b, [[]] * b)
    kc, vc = _caches(nblk, args.fp8)
    scales = dict(k_scale=torch.ones(HKV, device=DEV), v_scale=torch.ones(HKV, device=DEV)) if args.fp8 else {}
    q = torch.randn(b, HQ, D, device=DEV, dtype=DT)
    out = torch.empty_like(q)
    splits = args.splits or decode_splits(b, HKV, DEV)
    ws = split_workspace(b, HQ, D, splits, DEV) if splits > 1 else None
    cfg = dataclasses.replace(default_config(D, DT, HQ // HKV, max_query_len=1),
                              fuse_merge={"auto": None, "fused": True, "launch": False}[args.merge])
    for _ in range(3):
        paged_attention(q, kc, vc, out, meta, num_splits=splits, workspace=ws, max_query_len=1, config=cfg, **scales)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print(f"batch {b} context {ctx} splits {splits} fp8 {args.fp8} merge {args.merge}: done")


if __name__ == "__main__":
    main()
