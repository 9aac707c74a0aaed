"""Registers, spills and SASS instruction counts of graphrt's attention kernel for one
tile configuration, compiled for a GPU target on a machine without a GPU (Triton ships
ptxas and cuobjdump). Compare two source trees, or two configurations, at a glance.

    python benchmarks/probes/sass_stats.py [--tree DIR] [--window] [--fp8] [--block-q 4 --block-n 128 ...]

The launch is specialised as the runtime's decode bucket of 256 (``--seqs``) sequences would be (bf16,
32/8 heads, head_dim 128, KV block 16, block table column-major). Results depend on the
Triton version (the H200 image has 3.6: install it beside, e.g. ``pip install --target
/tmp/t36 triton==3.6.0`` and run with ``PYTHONPATH=/tmp/t36``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[2],
                        help="a graphrt source tree (its kernels/ is compiled)")
    parser.add_argument("--window", action="store_true")
    parser.add_argument("--fp8", action="store_true", help="an e4m3 cache")
    parser.add_argument("--q-dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-q", type=int, default=4)
    parser.add_argument("--block-n", type=int, default=128)
    parser.add_argument("--short-q", type=int, default=0)
    parser.add_argument("--short-block-n", type=int, default=0)
    parser.add_argument("--splits", type=int, default=1)
    parser.add_argument("--merge-launch", action="store_true", help="with --splits, the merge as a second launch "
                        "(KernelConfig.fuse_merge=False)")
    parser.add_argument("--merge-rows", type=int, default=64, help="the fused merge's rows per round of loads")
    parser.add_argument("--mixed", action="store_true", help="a mixed launch's program mapping (a search per program)")
    parser.add_argument("--pdl", action="store_true", help="launched as a programmatic dependent")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--offsets-64", action="store_true", help="64-bit cache offsets (a cache past 2**31 elements)")
    parser.add_argument("--maxnreg", type=int, default=None, help="a register cap (KernelConfig.maxnreg)")
    parser.add_argument("--write-kv", action="store_true",
                        help="the launch writes the new K/V (paged_attention's new_kv)")
    parser.add_argument("--read-new", action="store_true",
                        help="a prefill launch given new_kv: the new keys from k/v through tensor descriptors")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--max-ranges", type=int, default=8, help="prefix-range slots (0: ranges off)")
    parser.add_argument("--seqs", type=int, default=256, help="the decode bucket's sequences")
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp) / "graphrt_kernels_under_test"
        shutil.copytree(args.tree / "kernels", package)
        sys.path.insert(0, tmp)
        fn = importlib.import_module(package.name + ".paged_attention")._attn_kernel
        names = fn.arg_names
        const = dict(HEAD_DIM=args.head_dim, HEAD_DIM_PAD=1 << (args.head_dim - 1).bit_length(), KV_BLOCK_SIZE=16,
                     QPK=4, QPK_PAD=4, BLOCK_Q=args.block_q,
                     BLOCK_N=args.block_n, SHORT_Q=args.short_q, SHORT_BLOCK_N=args.short_block_n, MAX_RANGES=args.max_ranges,
                     USE_WINDOW=args.window, WINDOW_RULE=0, USE_RANGES=args.max_ranges > 0, USE_SOFTCAP=False,
                     SPLIT=args.splits > 1, NUM_SPLITS=args.splits, IEEE_DOT=False, KV_FP8=args.fp8,
                     KV_OFF32=not args.offsets_64,
                     FUSE_MERGE=args.splits > 1 and not args.merge_launch,
                     MERGE_ROWS=args.merge_rows, DECODE_MAP=not args.mixed, WRITE_KV=args.write_kv, ROUND_E4M3=False,
                     READ_NEW=args.read_new, PDL=args.pdl)
        # the values the runtime passes for a 256-sequence decode bucket (what Triton
        # specialises on: == 1, divisible by 16)
        ints = dict(stride_q_tok=4096, stride_q_head=128, stride_k_blk=16384, stride_k_tok=1024, stride_k_head=128,
                    stride_v_blk=16384, stride_v_tok=1024, stride_v_head=128, stride_o_tok=4096, stride_o_head=128,
                    stride_bt_seq=1, stride_bt_blk=args.seqs, stride_po_tok=4096, stride_po_head=128, stride_po_split=0,
                    stride_pl_tok=4096, stride_pl_head=128, stride_kn_tok=1024, stride_kn_head=128,
                    stride_vn_tok=1024, stride_vn_head=128, window=32, max_num_seqs=args.seqs, num_q_rows=args.seqs,
                    num_blocks=18432, max_blocks_per_seq=68, merge_now=0 if args.merge_launch else 1)
        fixed = {n for i, n in enumerate(names) if i in fn.do_not_specialize or n in fn.do_not_specialize}
        signature, attrs = {}, {}
        for i, n in enumerate(names):
            if n in const:
                signature[n] = "constexpr"
            elif n in ("k_cache_ptr", "v_cache_ptr"):
                signature[n] = "*fp8e4nv" if args.fp8 else "*" + args.q_dtype
            elif n in ("k_desc", "v_desc"):
                signature[n] = (f"tensordesc<{args.q_dtype}[{args.block_n}, {const['HEAD_DIM_PAD']}]>" if args.read_new
                                else "*" + args.q_dtype)
            elif n in ("q_ptr", "out_ptr", "k_new_ptr", "v_new_ptr"):
                signature[n] = "*" + args.q_dtype
            elif n in ("part_o_ptr", "part_lse_ptr", "k_scale_ptr", "v_scale_ptr"):
                signature[n] = "*fp32"
            elif n == "slot_mapping_ptr":
                signature[n] = "*i64"
            elif n.endswith("_ptr"):
                signature[n] = "*i32"
            elif n in ("scale_log2e", "softcap"):
                signature[n] = "fp32"
            elif n in fixed:                      # do_not_specialize: a plain i32
                signature[n] = "i32"
            elif ints.get(n) == 1:
                signature[n], const[n] = "constexpr", 1
            else:
                signature[n] = "i32"
            pointer = signature[n].startswith("*") and n not in ("k_desc", "v_desc")
            if pointer or (n in ints and n not in fixed and ints[n] % 16 == 0 and signature[n] != "constexpr"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        constexprs = {(names.index(k),): v for k, v in const.items() if k in names}
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                target=GPUTarget("cuda", args.arch, 32),
                                options=dict(num_warps=args.warps, num_stages=args.stages,
                                             **({"maxnreg": args.maxnreg} if args.maxnreg else {})))
        if os.environ.get("GRAPHRT_DUMP_IR"):          # a directory: write the TTGIR and PTX there
            dump = Path(os.environ["GRAPHRT_DUMP_IR"])
            dump.mkdir(parents=True, exist_ok=True)
            for ext in ("ttir", "ttgir", "ptx"):
                if ext in kernel.asm:
                    (dump / f"attn.{ext}").write_text(kernel.asm[ext])
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True,
                               text=True).stdout
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True).stdout
    if os.environ.get("GRAPHRT_DUMP_IR"):
        (Path(os.environ["GRAPHRT_DUMP_IR"]) / "attn.sass").write_text(sass)
    lines = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]

    def count(pattern: str) -> int:
        return sum(bool(re.search(pattern, line)) for line in lines)

    resources = " ".join(re.findall(r"REG:\d+ STACK:\d+", usage))
    resources += f" dynamic shared {kernel.metadata.shared} B"      # Triton's pipelining buffers live here
    loads, mma, conversions = count(r"LDG"), count(r"MMA"), count(r"F2F|F2FP|I2F|PRMT")
    local = count(r"\b(STL|LDL)")
    lds, sts, ldsm, ldgsts = count(r"\bLDS\b|\bLDS\."), count(r"\bSTS\b|\bSTS\."), count(r"LDSM"), count(r"LDGSTS")
    shared = f"shared: {ldgsts} async copies, {ldsm} ldmatrix, {lds} loads, {sts} stores"
    print(f"triton {triton.__version__}, sm_{args.arch}, tree {args.tree}: {resources}; {len(lines)} instructions, "
          f"{loads} global loads, {mma} MMA, {conversions} conversions, {local} local (spill) loads/stores; {shared}")


if __name__ == "__main__":
    main()
