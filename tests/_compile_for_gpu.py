"""Compile graphrt's Triton kernels for an sm_90 GPU without one (Triton's own compiler
and the ptxas its wheel carries): what the interpreter accepts and a GPU's compiler
refuses (a constexpr reassigned in a loop, a loop-carried variable that changes type)
fails here. Run with TRITON_INTERPRET unset; prints one line per kernel variant and exits
1 if any failed.

    python tests/_compile_for_gpu.py                      # the sampling and speculative kernels
    python tests/_compile_for_gpu.py --launches L.json    # the launches _record_launches.py kept
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import graphrt.kernels.linear as klin
import graphrt.kernels.sampling as ks
import graphrt.kernels.speculative as kspec


def ptr(t: str) -> str:
    return "*" + t


def variants():
    """(kernel, signature, constexprs): every variant the sampling and speculative launchers
    make, with bf16 logits (the chunked passes with G, the chunks a program walks, also at 1,
    which a launch specialises), and small_linear's programmatic dependent launches (its
    first weight tile loaded before the wait, or after)."""
    for fn, signature, constexprs in _variants():
        yield fn, signature, constexprs
        if "G" in signature:
            yield fn, signature, {**constexprs, "G": 1}


def _variants():
    rows = {"logits_ptr": ptr("bf16"), "stride_row": "i32", "V": "i32", "CHUNK": "i32", "C": "i32", "G": "i32"}
    state = {"temp_ptr": ptr("fp32"), "top_k_ptr": ptr("i32"), "top_p_ptr": ptr("fp32")}
    for count in (True, False):     # (False: greedy's, its count pointer the indices')
        yield ks._max_kernel, {**rows, "pmax_ptr": ptr("fp32"), "pidx_ptr": ptr("i32"), "count_ptr": ptr("i32"),
                               "COUNT": "constexpr", "BLOCK": "constexpr"}, {"COUNT": count, "BLOCK": 1024}
    yield ks._collect_kernel, {**rows, "temp_ptr": ptr("fp32"), "top_k_ptr": ptr("i32"), "pmax_ptr": ptr("fp32"),
                               "pidx_ptr": ptr("i32"), "count_ptr": ptr("i32"), "cand_ptr": ptr("fp32"),
                               "CAP": "constexpr", "CP": "constexpr", "BLOCK": "constexpr"}, \
        {"CAP": ks.CANDIDATES, "CP": 128, "BLOCK": 1024}
    yield ks._select_kernel, {**state, "pmax_ptr": ptr("fp32"), "pidx_ptr": ptr("i32"), "count_ptr": ptr("i32"),
                              "cand_ptr": ptr("fp32"), "fast_ptr": ptr("i32"), "fthr_ptr": ptr("i64"), "V": "i32",
                              "C": "i32", "CAP": "constexpr", "CP": "constexpr"}, {"CAP": ks.CANDIDATES, "CP": 128}
    for weighted in (False, True):
        h = "fp32" if weighted else "i32"
        sig = {**rows, "S": "i32", **state, "pmax_ptr": ptr("fp32"), "pidx_ptr": ptr("i32"), "fast_ptr": ptr("i32"),
               "h_ptr": ptr(h),
               "key_ptr": ptr("i64"), "need_ptr": ptr(h), "kthr_ptr": ptr("i64"), "zpart_ptr": ptr("fp32"),
               "level": "i32", "WEIGHTED": "constexpr", "CP": "constexpr", "BLOCK": "constexpr"}
        yield ks._radix_kernel, sig, {"WEIGHTED": weighted, "CP": 128, "BLOCK": 1024}
        yield ks._radix_kernel, sig, {"WEIGHTED": weighted, "CP": 2, "BLOCK": 128, "level": 1}  # (1: specialised)
    yield ks._mass_kernel, {**rows, "S": "i32", **state, "pmax_ptr": ptr("fp32"), "pidx_ptr": ptr("i32"),
                            "fast_ptr": ptr("i32"), "hk_ptr": ptr("i32"), "kkey_ptr": ptr("i64"),
                            "kneed_ptr": ptr("i32"), "kthr_ptr": ptr("i64"), "zpart_ptr": ptr("fp32"), "CP": "constexpr",
                            "BLOCK": "constexpr"}, {"CP": 128, "BLOCK": 1024}
    for draw in (True, False):      # (False: kept_lowest, its seed and counter the temperatures' pointer)
        key = ptr("i64") if draw else ptr("fp32")
        yield ks._draw_kernel, {**rows, "S": "i32", **state, "min_p_ptr": ptr("fp32"), "seed_ptr": key,
                                "counter_ptr": key, "pmax_ptr": ptr("fp32"), "pidx_ptr": ptr("i32"),
                                "fast_ptr": ptr("i32"), "fthr_ptr": ptr("i64"), "kthr_ptr": ptr("i64"),
                                "hp_ptr": ptr("fp32"), "pkey_ptr": ptr("i64"), "pneed_ptr": ptr("fp32"),
                                "bestv_ptr": ptr("fp32"), "besti_ptr": ptr("i32"), "lowc_ptr": ptr("fp32"),
                                "DRAW": "constexpr", "CP": "constexpr", "BLOCK": "constexpr"}, \
            {"DRAW": draw, "CP": 128, "BLOCK": 1024}
    for draw, has_lowest in ((True, False), (True, True), (False, True)):
        yield ks._pick_kernel, {"temp_ptr": ptr("fp32"), "pmax_ptr": ptr("fp32"), "pidx_ptr": ptr("i32"),
                                "bestv_ptr": ptr("fp32"), "besti_ptr": ptr("i32"), "lowc_ptr": ptr("fp32"),
                                "out_ptr": ptr("i64") if draw else ptr("i32"), "lowest_ptr": ptr("fp32"), "C": "i32",
                                "DRAW": "constexpr", "HAS_LOWEST": "constexpr", "CP": "constexpr"}, \
            {"DRAW": draw, "HAS_LOWEST": has_lowest, "CP": 128}
    yield ks._first_max_kernel, {"pmax_ptr": ptr("fp32"), "pidx_ptr": ptr("i32"), "out_ptr": ptr("i64"), "C": "i32",
                                 "CP": "constexpr"}, {"CP": 128}
    yield ks._uniform_kernel, {"seed_ptr": ptr("i64"), "counter_ptr": ptr("i64"), "out_ptr": ptr("fp32"), "N": "i32",
                               "BLOCK": "constexpr"}, {"BLOCK": 16}
    # small_linear as a programmatic dependent launch (CompileOptions(pdl=True)), one row and 16
    lin = {name: ptr("bf16") for name in ("x_ptr", "g_ptr", "nw_ptr", "r_ptr", "w0_ptr", "w1_ptr", "w2_ptr",
                                          "b0_ptr", "b1_ptr", "b2_ptr", "y0_ptr", "y1_ptr", "y2_ptr")}
    lin["eps"] = "fp32"
    lin.update({name: "i32" for name in ("M", "N0", "N1", "N2", "K", "stride_xm", "stride_gm", "stride_rm",
                                          "stride_w0", "stride_w1", "stride_w2", "stride_y0", "stride_y1",
                                          "stride_y2")})
    lin.update({name: "constexpr" for name in ("NUM_W", "BLOCK_M", "BLOCK_N", "BLOCK_K", "HAS_BIAS",
                                               "DOT_PRECISION", "PDL", "PREFETCH", "GATED", "NORM",
                                               "RESIDUAL")})
    for block_m, block_n, block_k in ((1, 4, 1024), (16, 32, 256)):
        for gated in (0, 1, 2):      # normed (q/k/v), or gated (silu / gelu) + residual (a down projection)
            yield klin._linear_kernel, lin, {"NUM_W": 3, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                                             "HAS_BIAS": False, "DOT_PRECISION": "tf32", "PDL": True,
                                             "PREFETCH": gated != 0, "GATED": gated, "NORM": 0 if gated else 2,
                                             "RESIDUAL": gated != 0}
    for has_ids in (False, True):
        yield kspec._place_kernel, {"request_ptr": ptr("i32"), "offset_ptr": ptr("i32"), "length_ptr": ptr("i32"),
                                    "num_requests": "i32", "qsl_ptr": ptr("i32"), "seq_lens_ptr": ptr("i32"),
                                    "positions_ptr": ptr("i64"), "slot_ptr": ptr("i64"), "num_tokens": "i32",
                                    "bt_ptr": ptr("i32"), "stride_bt_s": "i32", "stride_bt_b": "i32",
                                    "max_blocks": "i32", "block_size": "i32", "ids_ptr": ptr("i64"),
                                    "tokens_ptr": ptr("i64"), "stride_tok": "i32", "tok_cols": "i32",
                                    "HAS_IDS": "constexpr", "BLOCK": "constexpr"}, {"HAS_IDS": has_ids, "BLOCK": 16}


def recorded(path: str):
    """(kernel, signature, constexprs) of each launch in a file of recorded launches
    (``_record_launches.py``): an int argument that was 1 a constant, as a launch
    specialises it, unless the kernel says not to."""
    import triton.language as tl

    for e in json.load(open(path)):
        fn = getattr(importlib.import_module(e["module"]), e["name"])
        signature, constexprs = {}, {}
        specialised = {p.name: not p.do_not_specialize for p in fn.params}
        for name, (ty, one) in e["params"].items():
            if one and specialised.get(name, True):
                signature[name], constexprs[name] = "constexpr", 1
            else:
                signature[name] = ty
        for name, value in e["constexprs"].items():
            if isinstance(value, dict) and "dtype" in value:
                value = getattr(tl, value["dtype"])
            signature[name], constexprs[name] = "constexpr", value
        yield fn, {p.name: signature[p.name] for p in fn.params}, constexprs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", help="a JSON of recorded launches (tests/_record_launches.py)")
    args = parser.parse_args()
    target = GPUTarget("cuda", 90, 32)
    failed = 0
    for fn, signature, constexprs in (recorded(args.launches) if args.launches else variants()):
        t0 = time.perf_counter()
        shown = {k: v for k, v in constexprs.items() if isinstance(v, bool) and v or k in ("BLOCK", "CP", "level", "G")}
        try:
            triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target)
            print(f"ok   {fn.__name__} {shown} ({time.perf_counter() - t0:.1f} s)", flush=True)
        except Exception as e:     # the compiler's own error, shown whole
            failed += 1
            print(f"FAIL {fn.__name__} {constexprs}: {type(e).__name__}: {e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
