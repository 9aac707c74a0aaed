"""A probe, not a graphrt kernel: how fast causal prefill runs on Hopper when every key is
one of the step's new tokens, so that K and V come from the step's contiguous ``k``/``v``
([T, Hkv, D]) through tensor descriptors (TMA) instead of the paged cache, with and
without Triton's warp specialization of the key loop. It decides whether a contiguous
path for a launch's new keys is worth building into the attention kernel.

    python benchmarks/probes/probe_prefill_tma.py [--out DIR] [--sizes 4096 16384]
    python benchmarks/probes/probe_prefill_tma.py --compile-only     # sm_90 SASS figures, no GPU

On a GPU: for each size, torch SDPA (causal, GQA), graphrt's paged kernel (the table's
tile) and each probe config, in one run, with the probe's largest error against SDPA's
output; writes ``probe_prefill_tma.json``. Without a GPU (the interpreter): a small case
against a float64 reference, which must match. ``--compile-only`` compiles each config for
sm_90 with the installed Triton (the timed configs and the warp-specialized ones) and prints
registers, spills and whether the compiler split the loop into warp partitions.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
import triton.language as tl

def _cfg(block_m, block_n, num_warps, num_stages, ws=False, device_desc=False, one_loop=False, paged=False) -> dict:
    return dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages, ws=ws,
                device_desc=device_desc, one_loop=one_loop, paged=paged)


# ws: the key loop warp-specialized; device_desc: descriptors made on the device; one_loop:
# one loop masking every key tile; paged: K/V from a paged cache whose blocks hold a key
# tile each, found through a block table (graphrt's kernel gathers 16-token blocks with
# per-thread loads, which Triton 3.6 does not warp-specialize: its pass fails). Triton 3.6
# (sm_90) builds warp partitions for a kernel of one loop only: with the full and diagonal
# loops apart its pass fails with 4 warps and leaves the loop alone with 8
# (--compile-only shows it).
CONFIGS = [_cfg(64, 64, 4, 3), _cfg(128, 64, 4, 3), _cfg(128, 64, 8, 3), _cfg(128, 128, 8, 2),
           _cfg(128, 128, 8, 2, device_desc=True), _cfg(128, 128, 4, 2, device_desc=True, one_loop=True),
           _cfg(128, 128, 4, 2, ws=True, device_desc=True, one_loop=True),
           _cfg(128, 64, 4, 3, ws=True, device_desc=True, one_loop=True),
           _cfg(128, 128, 4, 3, ws=True, device_desc=True, one_loop=True),
           # keys from a paged cache of BLOCK_N-token blocks (one TMA load per key tile)
           _cfg(128, 64, 8, 3, device_desc=True, one_loop=True, paged=True),
           _cfg(128, 64, 4, 3, ws=True, device_desc=True, one_loop=True, paged=True),
           _cfg(128, 128, 4, 2, ws=True, device_desc=True, one_loop=True, paged=True)]
WS_TWO_LOOPS = [_cfg(128, 128, 4, 2, ws=True, device_desc=True), _cfg(128, 128, 8, 2, ws=True, device_desc=True)]
SIZES = [4096, 16384]


@triton.jit
def _online_update(acc, l_i, m_i, b_s, b_v, IEEE: tl.constexpr):
    """The online softmax's step for one key tile of logits b_s (log2 scale, masked keys
    -inf; every row sees its own key, so the running maximum is finite)."""
    m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
    b_p = tl.exp2(b_s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(b_p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(b_p, b_v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
    return acc, l_i, m_new


@triton.jit
def _key_tile(acc, l_i, m_i, b_q, k_desc, v_desc, n0, i_kvh, o_m, scale_log2e, block_table_ptr,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr,
              PAGED: tl.constexpr):
    if PAGED:                                                # the tile's block, one TMA load each of K and V
        i_blk = tl.load(block_table_ptr + n0 // BLOCK_N)
        b_k = k_desc.load([i_blk, 0, i_kvh * HEAD_DIM]).reshape(BLOCK_N, HEAD_DIM)
        b_v = v_desc.load([i_blk, 0, i_kvh * HEAD_DIM]).reshape(BLOCK_N, HEAD_DIM)
    else:
        b_k = k_desc.load([n0, i_kvh * HEAD_DIM])           # [BLOCK_N, D]
        b_v = v_desc.load([n0, i_kvh * HEAD_DIM])
    if IEEE:
        b_s = tl.dot(b_q, b_k.T, input_precision="ieee")
    else:
        b_s = tl.dot(b_q, b_k.T)
    b_s = b_s * scale_log2e
    if MASKED:                                               # causal: key <= query
        b_s = tl.where((n0 + tl.arange(0, BLOCK_N))[None, :] <= o_m[:, None], b_s, float("-inf"))
    return _online_update(acc, l_i, m_i, b_s, b_v, IEEE)


@triton.jit
def _causal_rows(q_desc, k_desc, v_desc, o_desc, num_tokens, scale_log2e,
                 QPK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 WS: tl.constexpr, IEEE: tl.constexpr, ONE_LOOP: tl.constexpr, block_table_ptr=None,
                 PAGED: tl.constexpr = False):
    """One query head's BLOCK_M rows of one sequence of ``num_tokens`` new tokens (q, k, v
    viewed [T, heads * D]); the keys below the rows' first one in full tiles (no mask),
    then the diagonal tiles masked; with ONE_LOOP, one loop masking every tile (Triton
    3.6's Hopper warp specialization handles a kernel of one loop only). BLOCK_M is a
    multiple of BLOCK_N."""
    i_m = tl.num_programs(0) - 1 - tl.program_id(0)         # the rows that see the most keys first
    i_h = tl.program_id(1)
    i_kvh = i_h // QPK
    row0 = i_m * BLOCK_M
    o_m = row0 + tl.arange(0, BLOCK_M)
    b_q = q_desc.load([row0, i_h * HEAD_DIM])               # rows past num_tokens read as zeros
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if ONE_LOOP:
        for n0 in tl.range(0, tl.minimum(row0 + BLOCK_M, num_tokens), BLOCK_N, warp_specialize=WS):
            acc, l_i, m_i = _key_tile(acc, l_i, m_i, b_q, k_desc, v_desc, n0, i_kvh, o_m, scale_log2e,
                                      block_table_ptr, HEAD_DIM, BLOCK_N, True, IEEE, PAGED)
    else:
        for n0 in tl.range(0, row0, BLOCK_N, warp_specialize=WS):
            acc, l_i, m_i = _key_tile(acc, l_i, m_i, b_q, k_desc, v_desc, n0, i_kvh, o_m, scale_log2e,
                                      block_table_ptr, HEAD_DIM, BLOCK_N, False, IEEE, False)
        for n0 in range(row0, tl.minimum(row0 + BLOCK_M, num_tokens), BLOCK_N):
            acc, l_i, m_i = _key_tile(acc, l_i, m_i, b_q, k_desc, v_desc, n0, i_kvh, o_m, scale_log2e,
                                      block_table_ptr, HEAD_DIM, BLOCK_N, True, IEEE, False)
    o_desc.store([row0, i_h * HEAD_DIM], (acc / l_i[:, None]).to(o_desc.dtype))   # rows past T: not stored


@triton.jit
def _tma_causal_kernel(q_desc, k_desc, v_desc, o_desc, num_tokens, scale_log2e,
                       QPK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       WS: tl.constexpr, IEEE: tl.constexpr, ONE_LOOP: tl.constexpr):
    """Descriptors made on the host (``TensorDescriptor``)."""
    _causal_rows(q_desc, k_desc, v_desc, o_desc, num_tokens, scale_log2e, QPK, HEAD_DIM, BLOCK_M, BLOCK_N, WS, IEEE,
                 ONE_LOOP)


@triton.jit
def _tma_causal_kernel_dev(q_ptr, k_ptr, v_ptr, o_ptr, num_tokens, scale_log2e,
                           QPK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           WS: tl.constexpr, IEEE: tl.constexpr, ONE_LOOP: tl.constexpr, HQ: tl.constexpr,
                           HKV: tl.constexpr):
    """Descriptors made on the device (Triton's Hopper warp specialization takes these;
    needs ``triton.set_allocator`` for their scratch)."""
    q_desc = tl.make_tensor_descriptor(q_ptr, [num_tokens, HQ * HEAD_DIM], [HQ * HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    o_desc = tl.make_tensor_descriptor(o_ptr, [num_tokens, HQ * HEAD_DIM], [HQ * HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(k_ptr, [num_tokens, HKV * HEAD_DIM], [HKV * HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(v_ptr, [num_tokens, HKV * HEAD_DIM], [HKV * HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
    _causal_rows(q_desc, k_desc, v_desc, o_desc, num_tokens, scale_log2e, QPK, HEAD_DIM, BLOCK_M, BLOCK_N, WS, IEEE,
                 ONE_LOOP)


@triton.jit
def _paged_tma_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, o_ptr, num_tokens, num_blocks, scale_log2e,
                      QPK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      WS: tl.constexpr, IEEE: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr):
    """K/V from caches [num_blocks, BLOCK_N, Hkv, D] (a block per key tile) through 3-d
    descriptors made on the device; one loop masking every tile."""
    q_desc = tl.make_tensor_descriptor(q_ptr, [num_tokens, HQ * HEAD_DIM], [HQ * HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    o_desc = tl.make_tensor_descriptor(o_ptr, [num_tokens, HQ * HEAD_DIM], [HQ * HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    # (the lists inline: Triton 3.6 takes no list held in a variable here)
    k_desc = tl.make_tensor_descriptor(k_cache_ptr, [num_blocks, BLOCK_N, HKV * HEAD_DIM],
                                       [BLOCK_N * HKV * HEAD_DIM, HKV * HEAD_DIM, 1], [1, BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(v_cache_ptr, [num_blocks, BLOCK_N, HKV * HEAD_DIM],
                                       [BLOCK_N * HKV * HEAD_DIM, HKV * HEAD_DIM, 1], [1, BLOCK_N, HEAD_DIM])
    _causal_rows(q_desc, k_desc, v_desc, o_desc, num_tokens, scale_log2e, QPK, HEAD_DIM, BLOCK_M, BLOCK_N, WS, IEEE,
                 True, block_table_ptr, True)


@triton.jit
def _ptr_key_tile(acc, l_i, m_i, b_q, k_ptr, v_ptr, block_table_ptr, j, o_tok, o_d, i_kvh, num_tokens, scale_log2e,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, HKV: tl.constexpr, PAGE: tl.constexpr,
                  IEEE: tl.constexpr, MASKED: tl.constexpr, k_desc=None, v_desc=None, TMA: tl.constexpr = False):
    k_pos = j * BLOCK_N + tl.arange(0, BLOCK_N)
    m_k = k_pos < num_tokens
    if TMA:                   # rows past the tensor read as zeros; past num_tokens, masked below
        b_k = k_desc.load([j * BLOCK_N, i_kvh * HEAD_DIM]).T
        b_v = v_desc.load([j * BLOCK_N, i_kvh * HEAD_DIM])
    elif PAGE > 0:
        row = tl.load(block_table_ptr + k_pos // PAGE, mask=m_k, other=0) * PAGE + k_pos % PAGE
    else:
        row = k_pos
    if not TMA:
        row = row.to(tl.int64) * HKV + i_kvh
        if MASKED:
            b_k = tl.load(k_ptr + row[None, :] * HEAD_DIM + o_d[:, None], mask=m_k[None, :], other=0.0)
            b_v = tl.load(v_ptr + row[:, None] * HEAD_DIM + o_d[None, :], mask=m_k[:, None], other=0.0)
        else:
            b_k = tl.load(k_ptr + row[None, :] * HEAD_DIM + o_d[:, None])
            b_v = tl.load(v_ptr + row[:, None] * HEAD_DIM + o_d[None, :])
    if IEEE:
        b_s = tl.dot(b_q, b_k, input_precision="ieee")
    else:
        b_s = tl.dot(b_q, b_k)
    b_s = b_s * scale_log2e
    if MASKED:
        b_s = tl.where(k_pos[None, :] <= o_tok[:, None], b_s, float("-inf"))
    return _online_update(acc, l_i, m_i, b_s, b_v, IEEE)


@triton.jit
def _ptr_causal_kernel(q_ptr, k_ptr, v_ptr, o_ptr, block_table_ptr, num_tokens, scale_log2e,
                       QPK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                       HQ: tl.constexpr, HKV: tl.constexpr, PACKED: tl.constexpr, PAGE: tl.constexpr,
                       IEEE: tl.constexpr, k_desc=None, v_desc=None, TMA: tl.constexpr = False):
    """The same causal prefill through plain pointer loads: K/V rows contiguous (PAGE 0) or
    gathered from a cache of PAGE-token blocks through a block table (graphrt's layout); a
    program holds one query head's BLOCK_Q tokens, or with PACKED the QPK heads of one KV
    head (BLOCK_Q tokens x QPK rows, graphrt's tiles). Full key tiles unmasked, then the
    diagonal ones masked. With TMA, K/V (contiguous) through host descriptors instead
    (queries and outputs still through pointers)."""
    i_m = tl.num_programs(0) - 1 - tl.program_id(0)
    o_r = tl.arange(0, BLOCK_Q * (QPK if PACKED else 1))
    if PACKED:
        i_kvh = tl.program_id(1)
        o_tok = i_m * BLOCK_Q + o_r // QPK
        o_h = i_kvh * QPK + o_r % QPK
    else:
        o_h = tl.program_id(1) + o_r * 0
        i_kvh = tl.program_id(1) // QPK
        o_tok = i_m * BLOCK_Q + o_r
    o_d = tl.arange(0, HEAD_DIM)
    m_q = o_tok < num_tokens
    p_q = q_ptr + (o_tok.to(tl.int64) * HQ + o_h)[:, None] * HEAD_DIM + o_d[None, :]
    b_q = tl.load(p_q, mask=m_q[:, None], other=0.0)
    m_i = tl.full([BLOCK_Q * (QPK if PACKED else 1)], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros_like(m_i)
    acc = tl.zeros([BLOCK_Q * (QPK if PACKED else 1), HEAD_DIM], dtype=tl.float32)
    first = i_m * BLOCK_Q
    last = tl.minimum(first + BLOCK_Q, num_tokens) - 1
    full_hi = (first + 1) // BLOCK_N
    for j in range(0, full_hi):
        acc, l_i, m_i = _ptr_key_tile(acc, l_i, m_i, b_q, k_ptr, v_ptr, block_table_ptr, j, o_tok, o_d, i_kvh,
                                      num_tokens, scale_log2e, HEAD_DIM, BLOCK_N, HKV, PAGE, IEEE, False,
                                      k_desc, v_desc, TMA)
    for j in range(full_hi, tl.cdiv(last + 1, BLOCK_N)):
        acc, l_i, m_i = _ptr_key_tile(acc, l_i, m_i, b_q, k_ptr, v_ptr, block_table_ptr, j, o_tok, o_d, i_kvh,
                                      num_tokens, scale_log2e, HEAD_DIM, BLOCK_N, HKV, PAGE, IEEE, True,
                                      k_desc, v_desc, TMA)
    p_o = o_ptr + (o_tok.to(tl.int64) * HQ + o_h)[:, None] * HEAD_DIM + o_d[None, :]
    tl.store(p_o, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=m_q[:, None])


def ptr_causal(q, k, v, out, *, block_q: int, block_n: int, num_warps: int, num_stages: int, packed: bool,
               page: int, caches=None):
    """``tma_causal`` through ``_ptr_causal_kernel``; with ``page`` > 0, K/V from ``caches`` =
    (k_cache, v_cache, block_table) of ``paged_cache(k, page)``; page -1: K/V through TMA."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    t, hq, d = q.shape
    hkv = k.shape[1]
    kk, vv, table = caches if page > 0 else (k, v, k)
    descs = {}
    if page < 0:
        descs = dict(k_desc=TensorDescriptor.from_tensor(k.view(t, -1), [block_n, d]),
                     v_desc=TensorDescriptor.from_tensor(v.view(t, -1), [block_n, d]), TMA=True)
    _ptr_causal_kernel[(triton.cdiv(t, block_q), hkv if packed else hq)](
        q, kk, vv, out, table, t, d ** -0.5 * 1.4426950408889634, QPK=hq // hkv, HEAD_DIM=d, BLOCK_Q=block_q,
        BLOCK_N=block_n, HQ=hq, HKV=hkv, PACKED=packed, PAGE=max(page, 0), IEEE=q.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages, **descs)
    return out


# Pointer-load configs: (block_q tokens, block_n, warps, stages, packed, page: 0 contiguous, -1 TMA)
PTR_CONFIGS = [(64, 64, 4, 3, False, 0), (64, 64, 4, 3, False, 16), (64, 64, 4, 3, False, -1),
               (16, 64, 4, 3, True, 0), (16, 64, 4, 3, True, 16), (16, 64, 4, 3, True, -1), (16, 64, 4, 4, True, -1),
               (32, 64, 8, 3, True, -1), (32, 128, 8, 2, True, -1), (64, 64, 8, 3, True, -1)]


def ptr_label(cfg) -> str:
    block_q, block_n, warps, stages, packed, page = cfg
    return (f"ptr {block_q}{'x' + 'QPK' if packed else ''}x{block_n} w{warps} s{stages} "
            + (f"paged{page}" if page > 0 else "TMA" if page < 0 else "contiguous"))


def paged_cache(k, block_n: int, generator=None):
    """(cache [num_blocks, block_n, Hkv, D] holding k's rows in blocks placed at random, with
    two spare blocks; int32 block table)."""
    import torch

    t = k.shape[0]
    used = triton.cdiv(t, block_n)
    perm = torch.randperm(used + 2, generator=generator)[:used].to(k.device)
    cache = torch.zeros(used + 2, block_n, *k.shape[1:], dtype=k.dtype, device=k.device)
    rows = torch.zeros(used * block_n, *k.shape[1:], dtype=k.dtype, device=k.device)
    rows[:t] = k
    cache[perm] = rows.view(used, block_n, *k.shape[1:])
    return cache, perm.to(torch.int32)


def tma_causal(q, k, v, out, *, block_m: int, block_n: int, num_warps: int, num_stages: int, ws: bool = False,
               device_desc: bool = False, one_loop: bool = False, paged: bool = False, caches=None):
    """out[T, Hq, D] = causal attention of q over k, v ([T, Hkv, D], contiguous); with
    ``paged``, over ``caches`` = (k_cache, v_cache, block_table) from ``paged_cache``."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    t, hq, d = q.shape
    hkv = k.shape[1]
    if paged:
        k_cache, v_cache, table = caches
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=q.device))
        _paged_tma_kernel[(triton.cdiv(t, block_m), hq)](
            q, k_cache, v_cache, table, out, t, k_cache.shape[0], d ** -0.5 * 1.4426950408889634, QPK=hq // hkv,
            HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, WS=ws, IEEE=q.dtype == torch.float32, HQ=hq, HKV=hkv,
            num_warps=num_warps, num_stages=num_stages)
        return out
    if device_desc:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=q.device))
        _tma_causal_kernel_dev[(triton.cdiv(t, block_m), hq)](
            q, k, v, out, t, d ** -0.5 * 1.4426950408889634, QPK=hq // hkv, HEAD_DIM=d, BLOCK_M=block_m,
            BLOCK_N=block_n, WS=ws, IEEE=q.dtype == torch.float32, ONE_LOOP=one_loop, HQ=hq, HKV=hkv,
            num_warps=num_warps,
            num_stages=num_stages)
        return out
    desc = lambda x, rows: TensorDescriptor.from_tensor(x.view(t, -1), [rows, d])  # noqa: E731
    _tma_causal_kernel[(triton.cdiv(t, block_m), hq)](
        desc(q, block_m), desc(k, block_n), desc(v, block_n), desc(out, block_m), t, d ** -0.5 * 1.4426950408889634,
        QPK=hq // hkv, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, WS=ws, IEEE=q.dtype == torch.float32,
        ONE_LOOP=one_loop,
        num_warps=num_warps, num_stages=num_stages)
    return out


def label_of(cfg: dict) -> str:
    return (f"{cfg['block_m']}x{cfg['block_n']} w{cfg['num_warps']} s{cfg['num_stages']}"
            + "".join(f" {word}" for word, on in (("ws", cfg["ws"]), ("dev", cfg["device_desc"]),
                                                   ("one-loop", cfg["one_loop"]), ("paged", cfg["paged"])) if on))


def compile_only() -> None:
    """sm_90 SASS figures of each config (bf16, 32/8 heads, head_dim 128)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for cfg in CONFIGS + WS_TWO_LOOPS:
        rows, block_n, warps, stages = cfg["block_m"], cfg["block_n"], cfg["num_warps"], cfg["num_stages"]
        const = dict(QPK=4, HEAD_DIM=128, BLOCK_M=rows, BLOCK_N=block_n, WS=cfg["ws"], IEEE=False,
                     ONE_LOOP=cfg["one_loop"])
        attrs = {}
        if cfg["paged"]:
            fn = _paged_tma_kernel
            const = {k: v for k, v in const.items() if k != "ONE_LOOP"}
            const.update(HQ=32, HKV=8)
            signature = dict(q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", block_table_ptr="*i32",
                             o_ptr="*bf16", num_tokens="i32", num_blocks="i32", scale_log2e="fp32")
            attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}
        elif cfg["device_desc"]:
            fn = _tma_causal_kernel_dev
            const.update(HQ=32, HKV=8)
            signature = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", o_ptr="*bf16", num_tokens="i32",
                             scale_log2e="fp32")
            attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
        else:
            fn = _tma_causal_kernel
            desc = lambda r: f"tensordesc<bf16[{r}, 128]>"  # noqa: E731
            signature = dict(q_desc=desc(rows), k_desc=desc(block_n), v_desc=desc(block_n), o_desc=desc(rows),
                             num_tokens="i32", scale_log2e="fp32")
        signature.update({k: "constexpr" for k in const})
        names = fn.arg_names
        label = label_of(cfg)
        try:
            kernel = triton.compile(ASTSource(fn=fn, signature=signature, attrs=attrs,
                                              constexprs={(names.index(k),): v for k, v in const.items()}),
                                    target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
        except Exception as exc:                      # a config this Triton cannot build: say so, go on
            print(f"{label}: does not compile: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / "k.cubin"
            cubin.write_bytes(kernel.asm["cubin"])
            tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
            usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True,
                                   text=True).stdout
            sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)], capture_output=True,
                                  text=True).stdout
        regs = re.search(r"REG:(\d+)", usage)
        stack = re.search(r"STACK:(\d+)", usage)
        print(f"{label}: {regs.group(1) if regs else '?'} registers, stack {stack.group(1) if stack else '?'} B, "
              f"{kernel.asm['ttgir'].count('ttg.warp_specialize')} warp-specialized regions, "
              f"{len(re.findall(r'UTMALDG', sass))} TMA loads, {len(re.findall(r'HGMMA', sass))} wgmma, "
              f"{len(kernel.asm['ptx'])} B of PTX")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200"))
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    if args.compile_only:
        compile_only()
        return

    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():           # the interpreter: correctness of a small case
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("no CUDA device: run with TRITON_INTERPRET=1 (set before triton is imported)")
        g = torch.Generator().manual_seed(0)
        t, hq, hkv, d = 80, 4, 2, 16
        q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
        qd, kd, vd = (x.double().transpose(0, 1) for x in (q, k.repeat_interleave(hq // hkv, 1),
                                                           v.repeat_interleave(hq // hkv, 1)))
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        want = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask).transpose(0, 1)
        k_cache, table = paged_cache(k, 16, torch.Generator().manual_seed(1))
        v_cache, _ = paged_cache(v, 16, torch.Generator().manual_seed(1))      # the same placement
        caches = (k_cache, v_cache, table)
        for cfg in (_cfg(32, 16, 4, 2), _cfg(32, 16, 4, 2, device_desc=True),
                    _cfg(32, 16, 4, 2, ws=True, device_desc=True, one_loop=True),
                    _cfg(32, 16, 4, 2, ws=True, device_desc=True, one_loop=True, paged=True)):
            out = torch.full_like(q, float("nan"))
            tma_causal(q, k, v, out, **cfg, caches=caches)
            err = float((out.double() - want).abs().max())
            print(f"interpreter, {t} tokens, {label_of(cfg)}: max |err| {err:.2e}")
            assert err < 1e-4, err
        for block_q, packed in ((16, False), (8, True)):
            for page in (0, 16, -1):
                out = torch.full_like(q, float("nan"))
                ptr_causal(q, k, v, out, block_q=block_q, block_n=16, num_warps=4, num_stages=2, packed=packed,
                           page=page, caches=caches)
                err = float((out.double() - want).abs().max())
                print(f"interpreter, {t} tokens, pointers, packed={packed} page={page}: max |err| {err:.2e}")
                assert err < 1e-4, err
        return

    from graphrt.bench.common import time_ms, write
    from graphrt.bench.kernels import D, DT, HKV, HQ, _attend, causal_pairs

    rows = []
    for n in args.sizes:
        flops = 4 * HQ * D * causal_pairs(n)
        q, k, v = (torch.randn(n, h, D, device="cuda", dtype=DT) for h in (HQ, HKV, HKV))
        qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        want = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        sdpa = time_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True), iters=20)
        paged, _ = _attend([n], [0], [[]], decode=False, iters=20)
        rows += [dict(impl="sdpa", tokens=n, ms=sdpa, tflops=flops / sdpa / 1e9, of_sdpa=1.0),
                 dict(impl="graphrt_paged", tokens=n, ms=paged, tflops=flops / paged / 1e9, of_sdpa=sdpa / paged)]
        print(f"n={n:6d} sdpa {sdpa:.3f} ms ({flops / sdpa / 1e9:.0f} TFLOP/s); graphrt paged {paged:.3f} ms = "
              f"{sdpa / paged:.2f} x SDPA", flush=True)
        paged = {}                                 # block_n -> (k_cache, v_cache, block table)
        for cfg in CONFIGS:
            out = torch.empty_like(q)
            label = label_of(cfg)
            caches = None
            if cfg["paged"]:
                if cfg["block_n"] not in paged:
                    k_cache, table = paged_cache(k, cfg["block_n"], torch.Generator().manual_seed(n))
                    v_cache, _ = paged_cache(v, cfg["block_n"], torch.Generator().manual_seed(n))
                    paged[cfg["block_n"]] = (k_cache, v_cache, table)
                caches = paged[cfg["block_n"]]
            try:
                tma_causal(q, k, v, out, **cfg, caches=caches)
                ms = time_ms(lambda: tma_causal(q, k, v, out, **cfg, caches=caches), iters=20)
            except Exception as exc:              # a config that does not build or run: recorded, not fatal
                print(f"n={n} {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                rows.append(dict(impl="tma_probe", tokens=n, config=label, error=f"{type(exc).__name__}"))
                continue
            err = float((out.float() - want.float()).abs().max())
            rows.append(dict(impl="tma_probe", tokens=n, config=label, ms=ms, tflops=flops / ms / 1e9,
                             of_sdpa=sdpa / ms, max_err_vs_sdpa=err))
            print(f"n={n:6d} {label:18s} {ms:.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s = {sdpa / ms:.2f} x SDPA "
                  f"(max |err| vs SDPA {err:.1e})", flush=True)
        k16, table16 = paged_cache(k, 16, torch.Generator().manual_seed(n))
        v16, _ = paged_cache(v, 16, torch.Generator().manual_seed(n))
        for cfg in PTR_CONFIGS:
            out = torch.empty_like(q)
            block_q, block_n, warps, stages, packed, page = cfg
            run = lambda: ptr_causal(q, k, v, out, block_q=block_q, block_n=block_n, num_warps=warps,  # noqa: E731
                                     num_stages=stages, packed=packed, page=page, caches=(k16, v16, table16))
            run()
            ms = time_ms(run, iters=20)
            err = float((out.float() - want.float()).abs().max())
            rows.append(dict(impl="ptr_probe", tokens=n, config=ptr_label(cfg), ms=ms, tflops=flops / ms / 1e9,
                             of_sdpa=sdpa / ms, max_err_vs_sdpa=err))
            print(f"n={n:6d} {ptr_label(cfg):30s} {ms:.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s = {sdpa / ms:.2f} x "
                  f"SDPA (max |err| vs SDPA {err:.1e})", flush=True)
        del q, k, v, qs, ks, vs, want, paged, k16, v16
    print(f"wrote {write(args.out, 'probe_prefill_tma', rows)}")


if __name__ == "__main__":
    main()
