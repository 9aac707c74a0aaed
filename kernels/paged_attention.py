"""Paged attention for a mixed batch (prefill chunks + decodes) in one launch.

Masks (DESIGN.md): causal, plus bidirectional attention among the tokens of one prefix
range (``ranges=False`` turns that off per call); optional logit soft-cap; GQA/MQA; an
optional sliding window, which combines with the ranges by one of three rules:

    clip              (causal | same_range) & (q - k < window)     the window clips ranges
    two_sided         (causal | same_range) & (|q - k| < window)   ... from both sides
    ranges_unclipped  (causal & (q - k < window)) | same_range     ranges reach past it

Model names are aliases for the rule their reference code uses (README has the table).

Work split: a program owns one KV head and a tile of BLOCK_Q consecutive new tokens of one
sequence, times the QPK query heads that share that KV head (so each K/V tile is loaded
once for all of them: BLOCK_M = BLOCK_Q * QPK_PAD rows). Programs find their sequence by a
binary search over ``query_start_loc`` on the device, so the grid depends only on the
capacities (tokens, sequences) and the same launch serves any step that fits. Sequences
of at most SHORT_Q new tokens (decodes in a mixed launch) take a 16-row tile with longer
key tiles instead, so prefill-sized tiles do not multiply their cost.

Key tiles that every row of a query tile sees in full (below the causal diagonal, inside
the window) skip the mask; only the tiles at the edges build it.

Split-KV (flash-decoding): with SPLIT each tile's visible key span is cut on the device
into as many equal runs of key tiles as the grid's third dimension has programs; each split
writes a partial output and its log-sum-exp, and ``_merge_kernel`` combines them. The split
count is fixed at launch, the split lengths follow each step's contexts on the device. The
count is not a compile-time constant of the attention kernel, so the decode buckets'
split factors (1 to 64) share two variants of it (split or not), which keeps capture's
compiles down (the merge kernel, small and quick to compile, keeps one per factor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._checks import (CACHE_DTYPES, check_cache_dtypes, check_head_dim, check_kv_scales, check_runnable,
                      check_same_dtype, check_shape, check_tensor)
from .metadata import AttentionMetadata

# How a sliding window and prefix ranges combine (see the module doc). The names say what
# the rule does; model names are aliases for the rule that model's reference code uses.
WINDOW_RULES = ("clip", "two_sided", "ranges_unclipped")
WINDOW_RULE_ALIASES = {"gemma3": "clip", "gemma4": "clip"}
RULE_CLIP: tl.constexpr = tl.constexpr(0)
RULE_TWO_SIDED: tl.constexpr = tl.constexpr(1)
RULE_RANGES_UNCLIPPED: tl.constexpr = tl.constexpr(2)
# scale and softcap must lie in this range: the kernel works in fp32, where the factors it
# derives from them (scale * log2(e) / softcap, softcap * log2(e)) stay finite and normal
# for any logits a model produces; real models use 0.01..100.
SCALAR_RANGE = (1e-6, 1e6)
# Windows at least this wide are clamped to it: the same mask for any sequence shorter than
# 2**30 tokens, and position arithmetic (q + window) stays inside int32.
MAX_WINDOW = 1 << 30


def window_rule_id(window_rule: str) -> int:
    """The kernel's code for a rule name or alias; ValueError naming the choices."""
    rule = WINDOW_RULE_ALIASES.get(window_rule, window_rule) if isinstance(window_rule, str) else None
    if rule not in WINDOW_RULES:
        raise ValueError(f"window_rule must be one of {WINDOW_RULES} (or an alias in {sorted(WINDOW_RULE_ALIASES)}), "
                         f"got {window_rule!r}")
    return WINDOW_RULES.index(rule)


@triton.jit
def _attend_key_tile(
    acc, l_i, m_i, kt,
    b_q, q_pos, r_start, r_end, seq_len, window, scale_log2e, softcap,
    p_bt, stride_bt_blk, last_blk, k_head_ptr, v_head_ptr,
    stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
    o_d, m_d,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, WINDOW_RULE: tl.constexpr, USE_RANGES: tl.constexpr, USE_SOFTCAP: tl.constexpr, IEEE_DOT: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Online-softmax update of (acc, l_i, m_i) with key tile kt. MASKED=False is for tiles
    every row of the query tile sees in full (all keys causal, inside the window and
    before seq_len): no mask is built and no load is masked by position."""
    k_pos = kt * BLOCK_N + tl.arange(0, BLOCK_N)          # [BLOCK_N]
    if MASKED:
        m_k = k_pos < seq_len
        i_blk = tl.load(p_bt + (k_pos // KV_BLOCK_SIZE) * stride_bt_blk, mask=m_k, other=0)
    else:
        i_blk = tl.load(p_bt + (k_pos // KV_BLOCK_SIZE) * stride_bt_blk)
    # A block id outside the cache (hand-built metadata) reads the last block instead of
    # past the cache: garbage in, but never an out-of-bounds access. One unsigned 32-bit
    # min does it (a negative id is a huge unsigned one), before the widening to int64.
    # (tl.cast, not .to: an int argument equal to 1 reaches the kernel as a Python int,
    # since Triton specialises it into a constant.)
    i_blk = tl.minimum(i_blk.to(tl.uint32, bitcast=True), tl.cast(last_blk, tl.uint32)).to(tl.int64)
    i_off = k_pos % KV_BLOCK_SIZE
    # K as [HEAD_DIM_PAD, BLOCK_N], V as [BLOCK_N, HEAD_DIM_PAD]
    p_k = k_head_ptr + (i_blk * stride_k_blk + i_off * stride_k_tok)[None, :] + o_d[:, None]
    p_v = v_head_ptr + (i_blk * stride_v_blk + i_off * stride_v_tok)[:, None] + o_d[None, :]
    if MASKED:
        b_k = tl.load(p_k, mask=m_k[None, :] & m_d[:, None], other=0.0)
        b_v = tl.load(p_v, mask=m_k[:, None] & m_d[None, :], other=0.0)
    elif HEAD_DIM == HEAD_DIM_PAD:
        b_k = tl.load(p_k)
        b_v = tl.load(p_v)
    else:
        b_k = tl.load(p_k, mask=m_d[:, None], other=0.0)
        b_v = tl.load(p_v, mask=m_d[None, :], other=0.0)

    b_k = b_k.to(b_q.dtype)       # fp8 caches: e4m3 codes to q's dtype (their scale is folded in elsewhere)
    b_v = b_v.to(b_q.dtype)
    if IEEE_DOT:     # fp32 operands, full-precision products (fp32 caches; bf16 in the interpreter)
        b_s = tl.dot(b_q.to(tl.float32), b_k.to(tl.float32), input_precision="ieee")
    else:
        b_s = tl.dot(b_q, b_k)
    if USE_SOFTCAP:
        # softcap * tanh(y), y = logit / softcap, through |y| so that exp never overflows;
        # below |y| = 0.1 a short series, since (1 - e) / (1 + e) cancels there (at a cap of
        # 1e4 the exp form alone was off by 7e-4 in fp32; the series' error is < 3e-7).
        b_y = b_s * (scale_log2e * 0.6931471805599453 / softcap)
        b_a = tl.abs(b_y)
        b_e = tl.exp(-2.0 * b_a)
        b_y2 = b_y * b_y
        b_t = tl.where(b_a < 0.1, b_a * (1.0 - b_y2 * (0.3333333333333333 - b_y2 * 0.13333333333333333)),
                       (1.0 - b_e) / (1.0 + b_e))
        b_s = tl.where(b_y < 0, -b_t, b_t) * (softcap * 1.4426950408889634)
    else:
        b_s = b_s * scale_log2e

    if MASKED:
        visible = k_pos[None, :] <= q_pos[:, None]                       # causal
        if USE_RANGES:
            same_range = (k_pos[None, :] >= r_start[:, None]) & (k_pos[None, :] < r_end[:, None])
        if USE_WINDOW:
            in_window = (q_pos[:, None] - k_pos[None, :]) < window
            if USE_RANGES:
                if WINDOW_RULE == RULE_RANGES_UNCLIPPED:
                    visible = (visible & in_window) | same_range
                else:
                    visible = (visible | same_range) & in_window
                    if WINDOW_RULE == RULE_TWO_SIDED:
                        visible = visible & ((k_pos[None, :] - q_pos[:, None]) < window)
            else:
                visible = visible & in_window
        elif USE_RANGES:
            visible = visible | same_range
        visible = visible & m_k[None, :]
        b_s = tl.where(visible, b_s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows with nothing visible yet
    else:
        m_new = tl.maximum(m_i, tl.max(b_s, axis=1))            # finite: every key is visible
        m_safe = m_new
    b_p = tl.exp2(b_s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(b_p, axis=1)
    if IEEE_DOT:
        acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype).to(tl.float32), b_v.to(tl.float32),
                                            input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
    m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attend_span(
    acc, l_i, m_i, a_start, a_count, b_start, b_count,
    b_q, q_pos, r_start, r_end, seq_len, window, scale_log2e, softcap,
    p_bt, stride_bt_blk, last_blk, k_head_ptr, v_head_ptr,
    stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
    o_d, m_d,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, WINDOW_RULE: tl.constexpr, USE_RANGES: tl.constexpr, USE_SOFTCAP: tl.constexpr, IEEE_DOT: tl.constexpr,
    MASKED: tl.constexpr,
):
    """(acc, l_i, m_i) over a_count key tiles from a_start, then b_count from b_start. The
    masked tiles' two runs share one loop (one copy of the code to compile); the full
    tiles (b_count 0) keep a plain counted loop, which the software pipeliner handles best."""
    if MASKED:
        for j in range(0, a_count + b_count):
            kt = tl.where(j < a_count, a_start + j, b_start + (j - a_count))
            acc, l_i, m_i = _attend_key_tile(
                acc, l_i, m_i, kt, b_q, q_pos, r_start, r_end, seq_len, window, scale_log2e, softcap,
                p_bt, stride_bt_blk, last_blk, k_head_ptr, v_head_ptr, stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
                o_d, m_d, HEAD_DIM, HEAD_DIM_PAD, KV_BLOCK_SIZE, BLOCK_N, USE_WINDOW, WINDOW_RULE, USE_RANGES, USE_SOFTCAP, IEEE_DOT, True)
    else:
        for kt in range(a_start, a_start + a_count):
            acc, l_i, m_i = _attend_key_tile(
                acc, l_i, m_i, kt, b_q, q_pos, r_start, r_end, seq_len, window, scale_log2e, softcap,
                p_bt, stride_bt_blk, last_blk, k_head_ptr, v_head_ptr, stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
                o_d, m_d, HEAD_DIM, HEAD_DIM_PAD, KV_BLOCK_SIZE, BLOCK_N, USE_WINDOW, WINDOW_RULE, USE_RANGES, USE_SOFTCAP, IEEE_DOT, False)
    return acc, l_i, m_i


@triton.jit
def _attend_tile(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    prefix_ranges_ptr, block_table_ptr, k_scale_ptr, v_scale_ptr,
    i_seq, i_qblk, i_kvh, i_split, q_start, q_len, seq_len, num_q_rows, last_blk,
    stride_q_tok, stride_q_head,
    stride_k_blk, stride_k_tok, stride_k_head,
    stride_v_blk, stride_v_tok, stride_v_head,
    stride_o_tok, stride_o_head,
    stride_bt_seq, stride_bt_blk,
    stride_po_tok, stride_po_head, stride_po_split,
    stride_pl_tok, stride_pl_head,
    scale_log2e, softcap, window,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    QPK: tl.constexpr, QPK_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    MAX_RANGES: tl.constexpr,
    USE_WINDOW: tl.constexpr, WINDOW_RULE: tl.constexpr, USE_RANGES: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    SPLIT: tl.constexpr, IEEE_DOT: tl.constexpr, KV_FP8: tl.constexpr,
):
    """One query tile (BLOCK_Q tokens x the QPK query heads of KV head i_kvh) of one
    sequence over this split's share of its visible key tiles; writes the output, or the
    partial output and log-sum-exp of its split for ``_merge_kernel``."""
    BLOCK_M: tl.constexpr = BLOCK_Q * QPK_PAD
    tl.static_assert(BLOCK_M >= 16, "tl.dot needs at least 16 rows")
    ctx_len = seq_len - q_len
    o_m = tl.arange(0, BLOCK_M)
    o_tok = i_qblk * BLOCK_Q + o_m // QPK_PAD            # token index within the sequence's new tokens
    o_head = o_m % QPK_PAD
    o_d = tl.arange(0, HEAD_DIM_PAD)
    m_d = o_d < HEAD_DIM
    # rows of this tile's tokens; also inside q/out (0 <= row < num_q_rows) whatever the
    # metadata says, so hand-built metadata cannot make the kernel write past out
    o_row = q_start + o_tok
    m_row = (o_tok < q_len) & (o_head < QPK) & (o_row >= 0) & (o_row < num_q_rows)
    q_pos = ctx_len + o_tok                               # [BLOCK_M] absolute positions
    i_qh = i_kvh * QPK + o_head                           # [BLOCK_M] query heads

    # [BLOCK_M, HEAD_DIM_PAD]
    p_q = q_ptr + o_row.to(tl.int64)[:, None] * stride_q_tok + i_qh[:, None] * stride_q_head + o_d[None, :]
    b_q = tl.load(p_q, mask=m_row[:, None] & m_d[None, :], other=0.0)

    # The prefix range holding each query row ([0, 0) when none): ranges never overlap.
    r_start = tl.zeros([BLOCK_M], dtype=tl.int32)
    r_end = tl.zeros([BLOCK_M], dtype=tl.int32)
    if USE_RANGES:
        p_ranges = prefix_ranges_ptr + i_seq.to(tl.int64) * (MAX_RANGES * 2)
        for r in tl.static_range(MAX_RANGES):
            s = tl.load(p_ranges + 2 * r)
            e = tl.load(p_ranges + 2 * r + 1)
            inside = (q_pos >= s) & (q_pos < e)
            r_start = tl.where(inside, s, r_start)
            r_end = tl.where(inside, e, r_end)

    # Keys any row of this tile can see: causal up to its last token, widened to the end
    # of every range that holds one of its queries (a two-sided window cuts that at
    # window - 1 past the last query); a window bounds it below, except that ranges the
    # window does not clip reach below it.
    first_pos = ctx_len + i_qblk * BLOCK_Q
    last_pos = tl.minimum(first_pos + BLOCK_Q, seq_len) - 1
    k_hi = tl.maximum(last_pos + 1, tl.max(tl.where(m_row, r_end, 0), axis=0))
    k_hi = tl.minimum(k_hi, seq_len)
    k_lo = 0
    full_lo = 0
    if USE_WINDOW:
        k_lo = tl.maximum(first_pos - window + 1, 0)
        full_lo = tl.maximum(last_pos - window + 1, 0)
        if USE_RANGES and WINDOW_RULE == RULE_RANGES_UNCLIPPED:
            in_range = m_row & (r_end > r_start)
            k_lo = tl.maximum(tl.minimum(k_lo, tl.min(tl.where(in_range, r_start, k_lo), axis=0)), 0)
        if USE_RANGES and WINDOW_RULE == RULE_TWO_SIDED:
            k_hi = tl.minimum(k_hi.to(tl.int64), last_pos.to(tl.int64) + window).to(tl.int32)
    kt_lo = k_lo // BLOCK_N
    kt_hi = tl.maximum(tl.cdiv(k_hi, BLOCK_N), kt_lo)      # no tiles (not fewer than none) for garbage metadata
    # Tiles every row sees in full: keys <= first_pos (causal for all rows) and, with a
    # window, >= last_pos - window + 1 (inside every row's window). They skip the mask.
    ft_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N), kt_lo), kt_hi)
    # (and below seq_len: metadata holding arbitrary values can put first_pos past it, and
    # these tiles' block-table loads are not masked)
    ft_hi = tl.minimum(tl.maximum(tl.minimum(first_pos + 1, seq_len) // BLOCK_N, ft_lo), kt_hi)
    st_lo = kt_lo
    st_hi = kt_hi
    if SPLIT:        # the split count is the grid's third dimension: one variant serves any
        per_split = tl.cdiv(kt_hi - kt_lo, tl.num_programs(2))
        st_lo = kt_lo + i_split * per_split
        st_hi = tl.minimum(st_lo + per_split, kt_hi)

    if KV_FP8:       # K = codes * k_scale: folded into the logit scale; V's scale into the output
        scale_log2e = scale_log2e * tl.load(k_scale_ptr + i_kvh)
        if q_ptr.dtype.element_ty == tl.bfloat16:
            # e4m3 -> fp16 is one conversion per two values and exact (e4m3 fits in fp16),
            # e4m3 -> bf16 goes through fp32: so both dots run in fp16. q goes there scaled
            # by a power of two (exact) that puts its largest |value| in [2**14, 2**15): no
            # overflow, and more significand bits than bf16 had. The factor joins the scale.
            b_qf = b_q.to(tl.float32)
            q_max = tl.max(tl.max(tl.abs(b_qf), axis=1), axis=0)
            shift = tl.maximum(((q_max.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 141, -126)
            q_div = ((shift + 127) << 23).to(tl.float32, bitcast=True)
            b_q = (b_qf / q_div).to(tl.float16)
            scale_log2e = scale_log2e * q_div
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    p_bt = block_table_ptr + i_seq.to(tl.int64) * stride_bt_seq
    k_head_ptr = k_cache_ptr + i_kvh * stride_k_head
    v_head_ptr = v_cache_ptr + i_kvh * stride_v_head
    # This split's share [st_lo, st_hi) of three runs: masked, full, masked (the two
    # masked runs go through one loop).
    lo_end = tl.minimum(ft_lo, st_hi)
    hi_start = tl.maximum(ft_hi, st_lo)
    acc, l_i, m_i = _attend_span(
        acc, l_i, m_i, st_lo, tl.maximum(lo_end - st_lo, 0), hi_start, tl.maximum(st_hi - hi_start, 0),
        b_q, q_pos, r_start, r_end, seq_len, window, scale_log2e, softcap,
        p_bt, stride_bt_blk, last_blk, k_head_ptr, v_head_ptr, stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
        o_d, m_d, HEAD_DIM, HEAD_DIM_PAD, KV_BLOCK_SIZE, BLOCK_N, USE_WINDOW, WINDOW_RULE, USE_RANGES, USE_SOFTCAP, IEEE_DOT, True)
    full_start = tl.maximum(ft_lo, st_lo)
    acc, l_i, m_i = _attend_span(
        acc, l_i, m_i, full_start, tl.maximum(tl.minimum(ft_hi, st_hi) - full_start, 0), 0, 0,
        b_q, q_pos, r_start, r_end, seq_len, window, scale_log2e, softcap,
        p_bt, stride_bt_blk, last_blk, k_head_ptr, v_head_ptr, stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
        o_d, m_d, HEAD_DIM, HEAD_DIM_PAD, KV_BLOCK_SIZE, BLOCK_N, USE_WINDOW, WINDOW_RULE, USE_RANGES, USE_SOFTCAP, IEEE_DOT, False)

    has_keys = l_i > 0.0
    b_o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if KV_FP8:
        b_o = b_o * tl.load(v_scale_ptr + i_kvh)
    o_tok_abs = o_row.to(tl.int64)
    m_out = m_row[:, None] & m_d[None, :]
    p_out = out_ptr + o_tok_abs[:, None] * stride_o_tok + i_qh[:, None] * stride_o_head + o_d[None, :]
    if not SPLIT:
        tl.store(p_out, b_o.to(out_ptr.dtype.element_ty), mask=m_out)
    else:
        p_po = part_o_ptr + o_tok_abs[:, None] * stride_po_tok + i_qh[:, None] * stride_po_head + o_d[None, :]
        p_pl = part_lse_ptr + o_tok_abs * stride_pl_tok + i_qh * stride_pl_head
        tl.store(p_po + i_split * stride_po_split, b_o, mask=m_out)
        tl.store(p_pl + i_split, tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf")),
                 mask=m_row)


# Sizes and strides that differ between buckets without changing the code worth having:
# not specialised (Triton would compile one variant for == 1, one for multiples of 16 and
# one for the rest), so that capture compiles fewer variants.
# (The block table is column-major in the runtime: its column stride is the bucket's
# sequence count.)
_PER_BUCKET = ["max_num_seqs", "num_q_rows", "stride_bt_blk", "stride_po_tok", "stride_po_head", "stride_po_split",
               "stride_pl_tok", "stride_pl_head"]


@triton.jit(do_not_specialize=_PER_BUCKET)
def _attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr, prefix_ranges_ptr, k_scale_ptr, v_scale_ptr,
    stride_q_tok, stride_q_head,
    stride_k_blk, stride_k_tok, stride_k_head,
    stride_v_blk, stride_v_tok, stride_v_head,
    stride_o_tok, stride_o_head,
    stride_bt_seq, stride_bt_blk,
    stride_po_tok, stride_po_head, stride_po_split,
    stride_pl_tok, stride_pl_head,
    scale_log2e, softcap, window,
    max_num_seqs, num_q_rows, num_blocks, max_blocks_per_seq,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    QPK: tl.constexpr, QPK_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SHORT_Q: tl.constexpr, SHORT_BLOCK_N: tl.constexpr,
    MAX_RANGES: tl.constexpr,
    USE_WINDOW: tl.constexpr, WINDOW_RULE: tl.constexpr, USE_RANGES: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    SPLIT: tl.constexpr, IEEE_DOT: tl.constexpr, KV_FP8: tl.constexpr,
):
    # Tiles in reverse order: a sequence's last query tiles see the most keys (causal), so
    # they start first and the short ones fill the tail of the launch.
    i_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    i_kvh = tl.program_id(1)
    i_split = tl.program_id(2)

    # Sequence of this tile: sequence i owns virtual tiles starting at
    # query_start_loc[i] // BLOCK_Q + i (strictly increasing in i), so search for the last
    # start <= i_tile. Over-allocated tiles fall past q_len and exit below.
    lo = i_tile * 0                                       # a tensor in compiled and interpreted mode
    hi = lo + max_num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        mid_start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if mid_start <= i_tile:
            lo = mid + 1
        else:
            hi = mid
    i_seq = tl.maximum(lo - 1, 0)       # -1 only when query_start_loc[0] > 0 (hand-built)
    q_start = tl.load(query_start_loc_ptr + i_seq)
    q_len = tl.load(query_start_loc_ptr + i_seq + 1) - q_start
    i_qblk = i_tile - (q_start // BLOCK_Q + i_seq)
    if (i_qblk < 0) | (i_qblk * BLOCK_Q >= q_len):
        return
    # keys past the block table's columns have no block: a longer seq_len (hand-built
    # metadata) is cut there rather than read past the table. One unsigned min, so a
    # negative one (a huge unsigned value) is cut there too; two signed ops (max with 0,
    # then min) cost 48 more registers in windowed decode tiles (sm_90, Triton 3.6).
    seq_len = tl.minimum(tl.load(seq_lens_ptr + i_seq).to(tl.uint32, bitcast=True),
                         tl.cast(max_blocks_per_seq * KV_BLOCK_SIZE, tl.uint32)).to(tl.int32, bitcast=True)
    last_blk = num_blocks - 1

    if SHORT_Q > 0 and q_len <= SHORT_Q:
        # A decode (or short chunk) inside a launch tiled for prefills: a tile of SHORT_Q
        # tokens and longer key tiles, so it costs what it would in a decode launch.
        _attend_tile(
            q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr,
            prefix_ranges_ptr, block_table_ptr, k_scale_ptr, v_scale_ptr,
            i_seq, 0, i_kvh, i_split, q_start, q_len, seq_len, num_q_rows, last_blk,
            stride_q_tok, stride_q_head, stride_k_blk, stride_k_tok, stride_k_head,
            stride_v_blk, stride_v_tok, stride_v_head, stride_o_tok, stride_o_head,
            stride_bt_seq, stride_bt_blk, stride_po_tok, stride_po_head, stride_po_split,
            stride_pl_tok, stride_pl_head, scale_log2e, softcap, window,
            HEAD_DIM, HEAD_DIM_PAD, KV_BLOCK_SIZE, QPK, QPK_PAD, SHORT_Q, SHORT_BLOCK_N, MAX_RANGES,
            USE_WINDOW, WINDOW_RULE, USE_RANGES, USE_SOFTCAP, SPLIT, IEEE_DOT, KV_FP8)
    else:
        _attend_tile(
            q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr,
            prefix_ranges_ptr, block_table_ptr, k_scale_ptr, v_scale_ptr,
            i_seq, i_qblk, i_kvh, i_split, q_start, q_len, seq_len, num_q_rows, last_blk,
            stride_q_tok, stride_q_head, stride_k_blk, stride_k_tok, stride_k_head,
            stride_v_blk, stride_v_tok, stride_v_head, stride_o_tok, stride_o_head,
            stride_bt_seq, stride_bt_blk, stride_po_tok, stride_po_head, stride_po_split,
            stride_pl_tok, stride_pl_head, scale_log2e, softcap, window,
            HEAD_DIM, HEAD_DIM_PAD, KV_BLOCK_SIZE, QPK, QPK_PAD, BLOCK_Q, BLOCK_N, MAX_RANGES,
            USE_WINDOW, WINDOW_RULE, USE_RANGES, USE_SOFTCAP, SPLIT, IEEE_DOT, KV_FP8)


@triton.jit
def _merge_kernel(
    out_ptr, part_o_ptr, part_lse_ptr, query_start_loc_ptr,
    stride_o_tok, stride_o_head,
    stride_po_tok, stride_po_head, stride_po_split,
    stride_pl_tok, stride_pl_head,
    max_num_seqs,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    i_tok = tl.program_id(0)
    i_head = tl.program_id(1)
    if i_tok >= tl.load(query_start_loc_ptr + max_num_seqs):   # padding past the step's tokens
        return
    o_s = tl.arange(0, SPLITS_PAD)
    o_d = tl.arange(0, HEAD_DIM_PAD)
    m_s = o_s < NUM_SPLITS
    m_d = o_d < HEAD_DIM
    base_l = part_lse_ptr + i_tok.to(tl.int64) * stride_pl_tok + i_head * stride_pl_head
    b_lse = tl.load(base_l + o_s, mask=m_s, other=float("-inf"))   # [SPLITS_PAD]
    lse_max = tl.max(b_lse, axis=0)                                 # finite: the diagonal key is in some split
    w = tl.exp2(b_lse - lse_max)
    w = w / tl.sum(w, axis=0)
    base_o = part_o_ptr + i_tok.to(tl.int64) * stride_po_tok + i_head * stride_po_head
    # [SPLITS_PAD, HEAD_DIM_PAD]
    b_o = tl.load(base_o + o_s[:, None] * stride_po_split + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0)
    b_out = tl.sum(b_o * w[:, None], axis=0)
    p_out = out_ptr + i_tok.to(tl.int64) * stride_o_tok + i_head * stride_o_head + o_d
    tl.store(p_out, b_out.to(out_ptr.dtype.element_ty), mask=m_d)


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape and launch options; chosen before capture, never from per-step values."""

    block_q: int        # new tokens per tile (times the query heads per KV head = tile rows)
    block_n: int        # keys per inner iteration
    num_warps: int = 4
    num_stages: int = 2
    # Key tile for sequences of at most 16 // next_pow2(queries per KV head) new tokens
    # (decodes inside a mixed launch); they get a 16-row tile instead of block_q tokens.
    # None: every sequence gets the main tile.
    short_block_n: int | None = None


# (head_dim <= 128, element bytes) -> (decode config (block_n, warps, stages), mixed
# config (rows, block_n, warps, stages, short_block_n), mixed config for launches of at
# least LARGE_LAUNCH tokens). 2-byte rows for head_dim <= 128 come from the H200 sweep
# (benchmarks/NOTES.md); the others keep shared memory per program under ~200 KB:
# stages x block_n x head_dim x 2 (K and V) x bytes.
_TABLE = {
    (True, 2): ((128, 4, 2), (64, 64, 4, 3, 128), (256, 64, 8, 3, 128)),
    (False, 2): ((64, 4, 2), (32, 32, 4, 2, 64), (64, 32, 4, 2, 64)),
    (True, 4): ((64, 4, 2), (64, 32, 4, 2, 64), (64, 32, 4, 2, 64)),
    (False, 4): ((32, 4, 2), (32, 16, 4, 2, 32), (32, 16, 4, 2, 32)),
}
# Split-KV factors allowed.
MAX_SPLITS = 64

# A launch with room for this many tokens is prefill-dominated (at most max_num_seqs of
# them can be decodes): its 8-warp 256-row tiles were ~20% faster on prefills and ~25%
# slower on the decodes beside them than 4-warp 128-row ones. Below it, the 4-warp 64-row
# tile: 12% faster than the 128-row one on a 4k prefill, where that one spills (H200
# sweep at cd8497a); 5% slower at 16k, which takes the large tile.
LARGE_LAUNCH = 8192


def default_config(head_dim: int, dtype: torch.dtype, queries_per_kv: int, *,
                   max_query_len: int | None = None, num_tokens: int | None = None) -> KernelConfig:
    """Static table per head_dim and dtype. ``max_query_len == 1`` (a decode-only launch)
    picks the smallest tile ``tl.dot`` accepts (16 rows), since a decode has one token;
    otherwise prefill-sized tiles (larger ones when the launch's token capacity
    ``num_tokens`` is at least LARGE_LAUNCH), with decodes in the launch on a 16-row path."""
    qpk_pad = triton.next_power_of_2(queries_per_kv)
    decode, mixed, large = _TABLE[(head_dim <= 128, 4 if dtype.itemsize >= 4 else 2)]
    if max_query_len == 1:
        return KernelConfig(block_q=max(1, 16 // qpk_pad), block_n=decode[0], num_warps=decode[1],
                            num_stages=decode[2])
    rows, block_n, warps, stages, short_n = large if (num_tokens or 0) >= LARGE_LAUNCH else mixed
    return KernelConfig(block_q=max(1, rows // qpk_pad), block_n=block_n, num_warps=warps, num_stages=stages,
                        short_block_n=short_n)


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device | str) -> int:
    """Split-KV factor for a decode launch of ``num_seqs`` sequences, fixed before capture:
    about two programs per SM (sequences x KV heads x splits), rounded down to a power of
    two, at most 64; the split lengths then follow each step's contexts on the device. 1
    off CUDA. (The power of two once bounded the kernel variants; the split count is now a
    launch dimension, so any factor is free: ``benchmarks/sweep_splits.py`` measures them.)"""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = max(1, min(64, (2 * sms) // (num_seqs * num_kv_heads)))
    return 1 << (want.bit_length() - 1)


def split_workspace(num_tokens: int, num_q_heads: int, head_dim: int, num_splits: int,
                    device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial outputs [T, Hq, splits, D] and log-sum-exps [T, Hq, splits], float32."""
    part_o = torch.empty(num_tokens, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    part_lse = torch.empty(num_tokens, num_q_heads, num_splits, dtype=torch.float32, device=device)
    return part_o, part_lse


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    meta: AttentionMetadata, *, scale: float | None = None, window: int | None = None,
                    window_rule: str = "clip", ranges: bool = True, softcap: float | None = None, num_splits: int = 1,
                    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                    max_query_len: int | None = None, config: KernelConfig | None = None,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the step's new tokens over their paged K/V; writes ``out`` in place.

    q:       [T, Hq, D] new-token queries (T = token capacity of this launch).
    k_cache, v_cache: [num_blocks, block_size, Hkv, D] with Hq % Hkv == 0; K/V of the new
             tokens must already be in the cache (see ``write_kv``). q's dtype, or
             torch.float8_e4m3fn with ``k_scale`` / ``v_scale``: [Hkv] float32 on the device,
             K = codes * k_scale[h] (likewise V), read on the device at each launch.
    out:     [T, Hq, D], same dtype as q. Rows of tokens past the step's count are untouched.
    meta:    the step's AttentionMetadata on the same device.
    scale:   logit scale in [1e-6, 1e6], default 1/sqrt(D).
    window:  keys with ``q - k < window`` (None: off; windows wider than 2**30 act as 2**30).
    window_rule: how a window and prefix ranges combine: "clip" (default), "two_sided" or
             "ranges_unclipped"; aliases "gemma3", "gemma4" (module doc).
    ranges:  False ignores the prefix ranges in this call (plain causal attention, as the
             global layers of some models use).
    softcap: ``softcap * tanh(logit / softcap)`` when set, in [1e-6, 1e6].
    num_splits: split-KV factor (1 = off). workspace: ``split_workspace(...)`` buffers, made
             here when None (pass them when capturing, so the graph owns fixed buffers).
    max_query_len: a capacity hint (1 for decode-only launches) that picks the tile shape.
    """
    check_tensor("meta", meta.seq_lens, dim=1, dtypes=(torch.int32,))
    device = meta.device
    check_runnable(device)
    check_tensor("q", q, dim=3, device=device)
    check_same_dtype(q, out=out)
    fp8 = check_cache_dtypes(q.dtype, "q", k_cache, v_cache)
    check_tensor("k_cache", k_cache, dim=4, dtypes=CACHE_DTYPES, device=device)
    check_tensor("v_cache", v_cache, dim=4, dtypes=CACHE_DTYPES, device=device)
    check_tensor("out", out, dim=3, device=device)
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    check_shape("v_cache", v_cache, k_cache.shape)
    check_shape("out", out, q.shape)
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache head_dim {k_cache.shape[3]} != q head_dim {head_dim}")
    check_head_dim(head_dim, "q.shape[2] (head_dim)")
    check_kv_scales(fp8, k_scale, v_scale, num_kv_heads, device)
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"k_cache must hold at least one block of at least one token, got shape {tuple(k_cache.shape)}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"q heads ({num_q_heads}) must be a multiple of k_cache heads ({num_kv_heads})")
    if num_tokens != meta.max_num_tokens:
        raise ValueError(f"q has {num_tokens} rows, the metadata {meta.max_num_tokens} token slots (the length of "
                         f"meta.slot_mapping): q and out need one row per token slot")
    rule = window_rule_id(window_rule)
    if not isinstance(ranges, bool):
        raise TypeError(f"ranges must be a bool, got {type(ranges).__name__}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    lo, hi = SCALAR_RANGE
    if softcap is not None and not (_is_real(softcap) and lo <= softcap <= hi):
        raise ValueError(f"softcap must be a number in [{lo:g}, {hi:g}] or None, got {softcap!r}")
    if scale is not None and not (_is_real(scale) and lo <= scale <= hi):
        raise ValueError(f"scale must be a number in [{lo:g}, {hi:g}] or None, got {scale!r}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    qpk = num_q_heads // num_kv_heads
    cfg = config or default_config(head_dim, q.dtype, qpk, max_query_len=max_query_len, num_tokens=num_tokens)
    qpk_pad = triton.next_power_of_2(qpk)
    if cfg.block_q * qpk_pad < 16:
        raise ValueError(f"config.block_q={cfg.block_q} gives {cfg.block_q * qpk_pad} tile rows, need >= 16")

    short_q = max(1, 16 // qpk_pad)
    short_block_n = cfg.short_block_n if cfg.short_block_n and short_q < cfg.block_q else 0

    max_num_seqs = meta.max_num_seqs
    num_tiles = num_tokens // cfg.block_q + max_num_seqs
    if num_splits > 1:
        if workspace is None:
            workspace = split_workspace(num_tokens, num_q_heads, head_dim, num_splits, device)
        part_o, part_lse = workspace
        check_tensor("workspace[0]", part_o, dim=4, dtypes=(torch.float32,), device=device)
        check_tensor("workspace[1]", part_lse, dim=3, dtypes=(torch.float32,), device=device)
        if part_o.shape[0] < num_tokens or tuple(part_o.shape[1:]) != (num_q_heads, num_splits, head_dim):
            raise ValueError(f"workspace[0] must be [>= {num_tokens}, {num_q_heads}, {num_splits}, {head_dim}], "
                             f"got {tuple(part_o.shape)}")
        if part_lse.shape[0] < num_tokens or tuple(part_lse.shape[1:]) != (num_q_heads, num_splits):
            raise ValueError(f"workspace[1] must be [>= {num_tokens}, {num_q_heads}, {num_splits}], "
                             f"got {tuple(part_lse.shape)}")
        if part_lse.stride(2) != 1:
            raise ValueError("workspace[1] needs a contiguous last dim")
    else:
        part_o, part_lse = out, out    # unused by the kernel without SPLIT

    head_dim_pad = triton.next_power_of_2(head_dim)
    _attn_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_o, part_lse,
        meta.query_start_loc, meta.seq_lens, meta.block_table, meta.prefix_ranges,
        k_scale if fp8 else out, v_scale if fp8 else out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        meta.block_table.stride(0), meta.block_table.stride(1),
        part_o.stride(0), part_o.stride(1), part_o.stride(2) if num_splits > 1 else 0,
        part_lse.stride(0), part_lse.stride(1),
        float(scale) * 1.4426950408889634, float(softcap or 1.0), min(window or 0, MAX_WINDOW),
        max_num_seqs, num_tokens, num_blocks, meta.block_table.shape[1],
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, KV_BLOCK_SIZE=block_size,
        QPK=qpk, QPK_PAD=qpk_pad, BLOCK_Q=cfg.block_q, BLOCK_N=cfg.block_n,
        SHORT_Q=short_q if short_block_n else 0, SHORT_BLOCK_N=short_block_n,
        MAX_RANGES=meta.max_prefix_ranges,
        USE_WINDOW=window is not None, WINDOW_RULE=rule, USE_RANGES=ranges and meta.max_prefix_ranges > 0,
        USE_SOFTCAP=softcap is not None,
        # bf16 dots are wrong under the interpreter: there they run in fp32 too
        SPLIT=num_splits > 1, IEEE_DOT=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and device.type == "cpu"),
        KV_FP8=fp8,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        _merge_kernel[(num_tokens, num_q_heads)](
            out, part_o, part_lse, meta.query_start_loc,
            out.stride(0), out.stride(1),
            part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            max_num_seqs,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
            num_warps=4,
        )
    return out
