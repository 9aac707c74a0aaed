"""The Triton kernels of paged attention (``paged_attention`` launches them; its module doc
says what they do). This module imports Triton alone, so that the processes that compile
its kernels before a capture (``graphrt.capture.precompile``) start without torch."""

import triton
import triton.language as tl

from ._kv_write_jit import _to_e4m3_values

# Window rules (paged_attention.WINDOW_RULES, in that order)
RULE_CLIP: tl.constexpr = tl.constexpr(0)
RULE_TWO_SIDED: tl.constexpr = tl.constexpr(1)
RULE_RANGES_UNCLIPPED: tl.constexpr = tl.constexpr(2)


@triton.jit
def _attend_key_tile(
    acc, l_i, m_i, kt,
    b_q, q_pos, r_start, r_end, seq_len, window, scale_log2e, softcap,
    p_bt, stride_bt_blk, last_blk, k_head_ptr, v_head_ptr,
    stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
    o_d, m_d, k_desc, v_desc, new_row0, new_col, new_pos0, k_sc, v_sc,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, WINDOW_RULE: tl.constexpr, USE_RANGES: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    KV_OFF32: tl.constexpr, MASKED: tl.constexpr, NEW: tl.constexpr, KV_FP8: tl.constexpr, ROUND_E4M3: tl.constexpr,
):
    """Online-softmax update of (acc, l_i, m_i) with key tile kt. MASKED=False is for tiles
    every row of the query tile sees in full (all keys causal, inside the window and
    before seq_len): no mask is built and no load is masked by position. NEW: tile kt of
    the step's new keys instead (positions new_pos0 + kt * BLOCK_N on, rows new_row0 +
    kt * BLOCK_N on of k_new/v_new), through tensor descriptors (one bulk copy each of K
    and V; rows outside the tensors read as zeros); for fp8 caches rounded to the codes
    the cache gets for them, so that they count as they will when read back."""
    if NEW:
        k_pos = new_pos0 + kt * BLOCK_N + tl.arange(0, BLOCK_N)
        m_k = k_pos < seq_len
        b_k = k_desc.load([new_row0 + kt * BLOCK_N, new_col]).T   # [HEAD_DIM_PAD, BLOCK_N]
        b_v = v_desc.load([new_row0 + kt * BLOCK_N, new_col])
        # What the copies bring in besides this head's keys must reach no output, whatever
        # it holds (inf, NaN: p = 0 and q's padded columns = 0 do not cancel those): rows
        # past seq_len (other sequences' tokens, rows of no token) in the masked tiles, and
        # a padded head dim's columns (the next head's).
        if MASKED:
            b_v = tl.where(m_k[:, None], b_v, 0.0)
        if HEAD_DIM != HEAD_DIM_PAD:
            b_k = tl.where(m_d[:, None], b_k, 0.0)
        if KV_FP8:
            b_k = _to_e4m3_values(b_k, k_sc, ROUND_E4M3).to(tl.float8e4nv)
            b_v = _to_e4m3_values(b_v, v_sc, ROUND_E4M3).to(tl.float8e4nv)
    else:
        k_pos = kt * BLOCK_N + tl.arange(0, BLOCK_N)          # [BLOCK_N]
        if MASKED:
            m_k = k_pos < seq_len
            i_blk = tl.load(p_bt + (k_pos // KV_BLOCK_SIZE) * stride_bt_blk, mask=m_k, other=0)
        else:
            i_blk = tl.load(p_bt + (k_pos // KV_BLOCK_SIZE) * stride_bt_blk)
        # A block id outside the cache (hand-built metadata) reads the last block instead of
        # past the cache: garbage in, but never an out-of-bounds access. One unsigned 32-bit
        # min does it (a negative id is a huge unsigned one), before any widening.
        # (tl.cast, not .to: an int argument equal to 1 reaches the kernel as a Python int,
        # since Triton specialises it into a constant.)
        i_blk = tl.minimum(i_blk.to(tl.uint32, bitcast=True), tl.cast(last_blk, tl.uint32))
        # Offsets into the caches in 32 bits where every element's offset fits (KV_OFF32, the
        # launch checks the caches' sizes and strides), else 64; the token offsets in a key tile
        # repeat every block, so that they do not depend on the tile when it holds whole
        # blocks. Together a third fewer instructions per key tile (sm_90, Triton 3.6: 410
        # against 593 per warp for a 128-key decode tile).
        if KV_OFF32:
            i_blk = i_blk.to(tl.int32, bitcast=True)       # <= last_blk < 2**31
        else:
            i_blk = i_blk.to(tl.int64)
        if BLOCK_N % KV_BLOCK_SIZE == 0:
            i_off = tl.arange(0, BLOCK_N) % KV_BLOCK_SIZE      # key tiles start at multiples of BLOCK_N
        else:
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
    acc, l_i, m_i, s_lo, s_hi, f_lo, f_hi,
    b_q, q_pos, r_start, r_end, seq_len, window, scale_log2e, softcap,
    p_bt, stride_bt_blk, last_blk, k_head_ptr, v_head_ptr,
    stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
    o_d, m_d, k_desc, v_desc, new_row0, new_col, new_pos0, k_sc, v_sc,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, WINDOW_RULE: tl.constexpr, USE_RANGES: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    KV_OFF32: tl.constexpr, NEW: tl.constexpr, KV_FP8: tl.constexpr, ROUND_E4M3: tl.constexpr,
):
    """(acc, l_i, m_i) over key tiles [s_lo, s_hi) (of the cache, or with NEW of the new
    keys), of which [f_lo, f_hi) every row sees in full: three runs, masked, full, masked.
    The two masked runs share one loop (one copy of the code to compile); the full tiles
    keep a plain counted loop, which the software pipeliner handles best."""
    lo_end = tl.minimum(f_lo, s_hi)
    hi_start = tl.maximum(f_hi, s_lo)
    a_count = tl.maximum(lo_end - s_lo, 0)
    for j in range(0, a_count + tl.maximum(s_hi - hi_start, 0)):
        kt = tl.where(j < a_count, s_lo + j, hi_start + (j - a_count))
        acc, l_i, m_i = _attend_key_tile(
            acc, l_i, m_i, kt, b_q, q_pos, r_start, r_end, seq_len, window, scale_log2e, softcap,
            p_bt, stride_bt_blk, last_blk, k_head_ptr, v_head_ptr,
            stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
            o_d, m_d, k_desc, v_desc, new_row0, new_col, new_pos0, k_sc, v_sc,
            HEAD_DIM, HEAD_DIM_PAD, KV_BLOCK_SIZE, BLOCK_N, USE_WINDOW, WINDOW_RULE, USE_RANGES, USE_SOFTCAP, IEEE_DOT,
            KV_OFF32, True,
            NEW, KV_FP8, ROUND_E4M3)
    full_start = tl.maximum(f_lo, s_lo)
    for kt in range(full_start, full_start + tl.maximum(tl.minimum(f_hi, s_hi) - full_start, 0)):
        acc, l_i, m_i = _attend_key_tile(
            acc, l_i, m_i, kt, b_q, q_pos, r_start, r_end, seq_len, window, scale_log2e, softcap,
            p_bt, stride_bt_blk, last_blk, k_head_ptr, v_head_ptr,
            stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
            o_d, m_d, k_desc, v_desc, new_row0, new_col, new_pos0, k_sc, v_sc,
            HEAD_DIM, HEAD_DIM_PAD, KV_BLOCK_SIZE, BLOCK_N, USE_WINDOW, WINDOW_RULE, USE_RANGES, USE_SOFTCAP, IEEE_DOT,
            KV_OFF32, False,
            NEW, KV_FP8, ROUND_E4M3)
    return acc, l_i, m_i


@triton.jit
def _rotate_loads(p_x, m_rows, o_tok, o_d, cos_ptr, sin_ptr, stride_cs_tok, ROPE_DIM: tl.constexpr):
    """The loads of ``_rotate`` (its other operands: the pair column of each of x's columns,
    cos and sin), apart, so that a launch can issue them early and rotate later."""
    HALF: tl.constexpr = ROPE_DIM // 2
    m_rot = o_d < ROPE_DIM
    m = m_rows[:, None] & m_rot[None, :]
    pair = tl.where(o_d < HALF, o_d + HALF, o_d - HALF)
    b_pair = tl.load(p_x + (pair - o_d)[None, :], mask=m, other=0.0)
    o_cs = o_tok.to(tl.int64)[:, None] * stride_cs_tok + o_d[None, :]
    b_cos = tl.load(cos_ptr + o_cs, mask=m, other=1.0)
    b_sin = tl.load(sin_ptr + o_cs, mask=m, other=0.0)
    return b_pair, b_cos, b_sin


@triton.jit
def _rotate_apply(b_x, b_pair, b_cos, b_sin, o_d, ROPE_DIM: tl.constexpr):
    """``_rotate`` on operands ``_rotate_loads`` brought in."""
    HALF: tl.constexpr = ROPE_DIM // 2
    sign = tl.where(o_d < HALF, -1.0, 1.0)
    return (b_x.to(tl.float32) * b_cos.to(tl.float32)
            + b_pair.to(tl.float32) * sign[None, :] * b_sin.to(tl.float32)).to(b_x.dtype)


@triton.jit
def _rotate(b_x, p_x, m_rows, o_tok, o_d, cos_ptr, sin_ptr, stride_cs_tok, ROPE_DIM: tl.constexpr):
    """Rotary embedding of the rows b_x ([rows, HEAD_DIM_PAD], loaded from p_x under the row
    mask m_rows), rotate-half form over its first ROPE_DIM columns (the rest pass through):
    ``x * cos + rotate_half(x) * sin`` with rotate_half(x)[d] = -x[d + R/2] below R/2 and
    x[d - R/2] from there, cos and sin the rows o_tok of [T, >= ROPE_DIM] tables; in fp32,
    rounded once to x's dtype (what Inductor's fused kernel of that expression computes)."""
    b_pair, b_cos, b_sin = _rotate_loads(p_x, m_rows, o_tok, o_d, cos_ptr, sin_ptr, stride_cs_tok, ROPE_DIM)
    return _rotate_apply(b_x, b_pair, b_cos, b_sin, o_d, ROPE_DIM)


@triton.jit
def _write_new_kv(k_new_ptr, v_new_ptr, slot_mapping_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                  i_kvh, q_start, ctx_len, w_lo, w_hi, num_q_rows, num_slots,
                  stride_kn_tok, stride_kn_head, stride_vn_tok, stride_vn_head,
                  stride_k_blk, stride_k_tok, stride_k_head, stride_v_blk, stride_v_tok, stride_v_head,
                  o_d, m_d, cos_ptr, sin_ptr, stride_cs_tok,
                  KV_BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr, ROUND_E4M3: tl.constexpr,
                  ROWS: tl.constexpr, ROPE_DIM: tl.constexpr):
    """KV head i_kvh of the sequence's new keys at positions [w_lo, w_hi) (>= ctx_len: key
    p is token q_start + p - ctx_len) into the caches at their ``slot_mapping`` slots, as
    ``write_kv`` writes them (slots outside the cache and tokens outside q's rows skipped);
    with ROPE_DIM the keys rotated first (``_rotate``, the token's cos/sin rows)."""
    for w in range(w_lo, w_hi, ROWS):
        o_p = w + tl.arange(0, ROWS)
        o_t = q_start + (o_p - ctx_len)
        m_t = (o_p < w_hi) & (o_t >= 0) & (o_t < num_q_rows)
        # the new rows' loads under the row mask alone, beside the slots' (not after them:
        # one round trip fewer); a row whose slot is outside the cache is loaded, not stored
        slot = tl.load(slot_mapping_ptr + o_t, mask=m_t, other=-1)
        m = m_t[:, None] & m_d[None, :]
        o_t = o_t.to(tl.int64)
        p_kn = k_new_ptr + o_t[:, None] * stride_kn_tok + i_kvh * stride_kn_head + o_d[None, :]
        b_k = tl.load(p_kn, mask=m)
        if ROPE_DIM > 0:
            b_k = _rotate(b_k, p_kn, m_t, o_t, o_d, cos_ptr, sin_ptr, stride_cs_tok, ROPE_DIM)
        b_v = tl.load(v_new_ptr + o_t[:, None] * stride_vn_tok + i_kvh * stride_vn_head + o_d[None, :], mask=m)
        m_t = m_t & (slot >= 0) & (slot < num_slots)
        m = m_t[:, None] & m_d[None, :]
        if KV_FP8:
            b_k = _to_e4m3_values(b_k, tl.load(k_scale_ptr + i_kvh), ROUND_E4M3)
            b_v = _to_e4m3_values(b_v, tl.load(v_scale_ptr + i_kvh), ROUND_E4M3)
        i_blk = slot // KV_BLOCK_SIZE
        i_off = slot % KV_BLOCK_SIZE
        o_kc = i_blk * stride_k_blk + i_off * stride_k_tok + i_kvh * stride_k_head
        o_vc = i_blk * stride_v_blk + i_off * stride_v_tok + i_kvh * stride_v_head
        p_kc = k_cache_ptr + o_kc[:, None] + o_d[None, :]
        p_vc = v_cache_ptr + o_vc[:, None] + o_d[None, :]
        tl.store(p_kc, b_k.to(k_cache_ptr.dtype.element_ty), mask=m)
        tl.store(p_vc, b_v.to(v_cache_ptr.dtype.element_ty), mask=m)


@triton.jit
def _merge_tile(out_ptr, part_o_ptr, part_lse_ptr, counter_ptr, p_out, p_po, p_pl, m_row, m_out, num_active,
                stride_po_split, BLOCK_M: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MERGE_ROWS: tl.constexpr):
    """The split-KV merge inside the attention launch: every active split of a query tile
    (split 0 alone when none is) counts itself in the tile's counter once its partial
    output and log-sum-exp are stored; the one that counts last merges the tile's partials
    into ``out`` and sets the counter back to 0 for the next launch. Every split of the
    tile computes the same ``num_active`` from the same metadata. The counter is the
    launch's (program_id(0), KV head) slot, so no metadata can make two tiles share one;
    no program waits on another."""
    # every thread's partial stores come before the count (the barrier), and the count
    # releases them to the GPU; the merging program's count acquires the others'
    tl.debug_barrier()
    p_count = counter_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    done = tl.atomic_add(p_count, 1, sem="acq_rel", scope="gpu")
    if done == tl.maximum(num_active, 1) - 1:
        tl.store(p_count, 0)
        # Online log-sum-exp over the active splits, UNROLL at a time so that their loads
        # are in flight together (from L2: .cg, not this SM's L1, which did not see the
        # other programs' stores).
        UNROLL: tl.constexpr = MERGE_ROWS // BLOCK_M if BLOCK_M < MERGE_ROWS else 1
        m_s = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_s = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        zero_m = tl.zeros([BLOCK_M], dtype=tl.int32)
        for first in range(0, num_active, UNROLL):
            for j in tl.static_range(UNROLL):
                s = first + j
                m_live = m_row & (s + zero_m < num_active)     # (vector compares: the interpreter
                lse = tl.load(p_pl + s, mask=m_live, other=float("-inf"), cache_modifier=".cg")
                b_o = tl.load(p_po + s * stride_po_split, mask=m_out & m_live[:, None], other=0.0,
                              cache_modifier=".cg")           # takes no scalar in a mask)
                m_new = tl.maximum(m_s, lse)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # no keys in any split so far
                alpha = tl.exp2(m_s - m_safe)
                w = tl.exp2(lse - m_safe)
                acc = acc * alpha[:, None] + b_o * w[:, None]
                l_s = l_s * alpha + w
                m_s = m_new
        b_out = acc / tl.where(l_s > 0.0, l_s, 1.0)[:, None]
        tl.store(p_out, b_out.to(out_ptr.dtype.element_ty), mask=m_out)


@triton.jit
def _attend_tile(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    prefix_ranges_ptr, block_table_ptr, k_scale_ptr, v_scale_ptr, counter_ptr,
    k_new_ptr, v_new_ptr, slot_mapping_ptr, k_desc, v_desc, cos_ptr, sin_ptr, stride_cs_tok,
    i_seq, i_qblk, i_kvh, i_split, q_start, q_len, seq_len, num_q_rows, last_blk, merge_now, num_slots,
    stride_q_tok, stride_q_head,
    stride_k_blk, stride_k_tok, stride_k_head,
    stride_v_blk, stride_v_tok, stride_v_head,
    stride_o_tok, stride_o_head,
    stride_bt_seq, stride_bt_blk,
    stride_po_tok, stride_po_head, stride_po_split,
    stride_pl_tok, stride_pl_head,
    stride_kn_tok, stride_kn_head, stride_vn_tok, stride_vn_head,
    scale_log2e, softcap, window,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    QPK: tl.constexpr, QPK_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    MAX_RANGES: tl.constexpr,
    USE_WINDOW: tl.constexpr, WINDOW_RULE: tl.constexpr, USE_RANGES: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    SPLIT: tl.constexpr, IEEE_DOT: tl.constexpr, KV_FP8: tl.constexpr, KV_OFF32: tl.constexpr, FUSE_MERGE: tl.constexpr,
    MERGE_ROWS: tl.constexpr, WRITE_KV: tl.constexpr, ROUND_E4M3: tl.constexpr, READ_NEW: tl.constexpr,
    ROPE_DIM: tl.constexpr,
):
    """One query tile (BLOCK_Q tokens x the QPK query heads of KV head i_kvh) of one
    sequence over this split's share of its visible key tiles; writes the output, or the
    partial output and log-sum-exp of its split (for ``_merge_kernel``, or with FUSE_MERGE
    for the tile's last split to finish, which merges them, see ``_merge_tile``). With
    WRITE_KV it first writes the new tokens' K/V that its key tiles hold into the caches.
    With READ_NEW it reads the new keys from k_new/v_new (descriptors k_desc, v_desc) and
    writes its own tokens' K/V into the caches. With ROPE_DIM (WRITE_KV only) the queries
    and the new keys are rotated as they are loaded (``_rotate``)."""
    tl.static_assert(ROPE_DIM == 0 or (WRITE_KV and not READ_NEW), "rotary embedding in WRITE_KV launches only")
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
    c_end = seq_len              # the cache's keys end here
    if READ_NEW:
        # Keys below ctx_len from the cache, the new ones from k_new/v_new in tiles counted
        # from ctx_len (new tile j: new tokens j * BLOCK_N on), so that the causal diagonal
        # and the full tiles below it fall as in a fresh prefill. Every context key is
        # causal for every row (ctx_len <= first_pos).
        c_end = ctx_len
        kt_hi = tl.maximum(tl.cdiv(tl.minimum(k_hi, ctx_len), BLOCK_N), kt_lo)
        ft_lo = tl.minimum(ft_lo, kt_hi)
        nt_lo = tl.maximum(k_lo - ctx_len, 0) // BLOCK_N
        nt_hi = tl.maximum(tl.cdiv(k_hi - ctx_len, BLOCK_N), nt_lo)
        # At most the tiles of seq_len keys (the table's length at most), as the cache's
        # run is: metadata holding arbitrary values can wrap k_lo - ctx_len past int32 and
        # leave ~2**31 / BLOCK_N tiles between these bounds.
        nt_hi = tl.minimum(nt_hi, nt_lo + tl.cdiv(seq_len, BLOCK_N) + 1)
        nf_lo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(full_lo - ctx_len, 0), BLOCK_N), nt_lo), nt_hi)
        nf_hi = tl.minimum(tl.maximum((i_qblk * BLOCK_Q + 1) // BLOCK_N, nf_lo), nt_hi)
        ns_lo = nt_lo
        ns_hi = nt_hi
    # (and below c_end: metadata holding arbitrary values can put first_pos past it, and
    # these tiles' block-table loads are not masked)
    ft_hi = tl.minimum(tl.maximum(tl.minimum(first_pos + 1, c_end) // BLOCK_N, ft_lo), kt_hi)
    st_lo = kt_lo
    st_hi = kt_hi
    m_q = m_row
    per_split = kt_hi - kt_lo
    if SPLIT and READ_NEW:   # the split count is the grid's third dimension: one variant serves any
        # splits share the cache's tiles and then the new ones, counted as one run
        num_all = kt_hi - kt_lo + nt_hi - nt_lo
        per_split = tl.cdiv(num_all, tl.num_programs(2))
        v_lo = i_split * per_split
        v_hi = tl.minimum(v_lo + per_split, num_all)
        st_lo = kt_lo + tl.minimum(v_lo, kt_hi - kt_lo)
        st_hi = kt_lo + tl.minimum(v_hi, kt_hi - kt_lo)
        ns_lo = nt_lo + tl.maximum(v_lo - (kt_hi - kt_lo), 0)
        ns_hi = nt_lo + tl.maximum(v_hi - (kt_hi - kt_lo), 0)
        num_active = tl.where(num_all > 0, tl.cdiv(num_all, tl.maximum(per_split, 1)), 0)
        if FUSE_MERGE and merge_now != 0 and i_split >= tl.maximum(num_active, 1):
            return
        m_q = m_row & (v_lo + o_m * 0 < v_hi)
    elif SPLIT:
        per_split = tl.cdiv(kt_hi - kt_lo, tl.num_programs(2))
        st_lo = kt_lo + i_split * per_split
        st_hi = tl.minimum(st_lo + per_split, kt_hi)
        # Splits that run key tiles: the first cdiv(kt_hi - kt_lo, per_split) (none when the
        # tile sees no key).
        num_active = tl.where(kt_hi > kt_lo, tl.cdiv(kt_hi - kt_lo, tl.maximum(per_split, 1)), 0)
        # An idle split (a context shorter than the launch's split count in key tiles):
        # - merged in place, it does nothing: the tile's merge counts its active splits
        #   only (split 0 stands for them when there are none, and writes zeros);
        # - merged by a second launch, it runs no key tile and loads no query; its
        #   log-sum-exp comes out -inf, which tells that merge so.
        if FUSE_MERGE and merge_now != 0 and i_split >= tl.maximum(num_active, 1):
            return
        m_q = m_row & (st_lo + o_m * 0 < st_hi)    # (a vector compare: the interpreter takes no scalar in a mask)
    # [BLOCK_M, HEAD_DIM_PAD]; loaded (with what rotating it takes) before the new K/V are
    # written: no store of the launch reaches q, and its loads then overlap the write's
    p_q = q_ptr + o_row.to(tl.int64)[:, None] * stride_q_tok + i_qh[:, None] * stride_q_head + o_d[None, :]
    b_q = tl.load(p_q, mask=m_q[:, None] & m_d[None, :], other=0.0)
    if ROPE_DIM > 0:
        q_pair, q_cos, q_sin = _rotate_loads(p_q, m_q, o_row, o_d, cos_ptr, sin_ptr, stride_cs_tok, ROPE_DIM)
    if WRITE_KV:
        # The launch writes the step's new K/V (a decode launch: one token per sequence, in
        # the last key tile). Each program writes those its own key tiles hold, from
        # position ctx_len up to seq_len (past k_hi too: the tile loads them), then reads
        # them back from the cache after the barrier; programs whose tiles overlap write the
        # same values to the same slots. Every new key lies in the key tiles of the query
        # tile that holds its token (the diagonal), so every one is written.
        _write_new_kv(k_new_ptr, v_new_ptr, slot_mapping_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                      i_kvh, q_start, ctx_len, tl.maximum(st_lo * BLOCK_N, ctx_len),
                      tl.minimum(st_hi * BLOCK_N, seq_len), num_q_rows, num_slots,
                      stride_kn_tok, stride_kn_head, stride_vn_tok, stride_vn_head,
                      stride_k_blk, stride_k_tok, stride_k_head, stride_v_blk, stride_v_tok, stride_v_head,
                      o_d, m_d, cos_ptr, sin_ptr, stride_cs_tok, KV_BLOCK_SIZE, KV_FP8, ROUND_E4M3, BLOCK_Q,
                      ROPE_DIM)
        tl.debug_barrier()

    if ROPE_DIM > 0:
        b_q = _rotate_apply(b_q, q_pair, q_cos, q_sin, o_d, ROPE_DIM)
    if KV_FP8:       # K = codes * k_scale: folded into the logit scale; V's scale into the output
        scale_log2e = scale_log2e * tl.load(k_scale_ptr + i_kvh)
        if q_ptr.dtype.element_ty == tl.bfloat16:
            # e4m3 -> fp16 is one conversion per two values and exact (e4m3 fits in fp16),
            # e4m3 -> bf16 goes through fp32: so both dots run in fp16. q goes there scaled
            # by a power of two (exact) that puts its largest |value| in [2**14, 2**15): no
            # overflow, and more significand bits than bf16 had. The factor joins the scale.
            # Finite values only: an inf or NaN in one row would set it for the tile's other
            # rows (heads, tokens) and flush their values to zero.
            b_qf = b_q.to(tl.float32)
            b_qa = tl.abs(b_qf)
            q_max = tl.max(tl.max(tl.where(b_qa < float("inf"), b_qa, 0.0), axis=1), axis=0)
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
    k_sc = 1.0
    v_sc = 1.0
    if READ_NEW and KV_FP8:
        k_sc = tl.load(k_scale_ptr + i_kvh)
        v_sc = tl.load(v_scale_ptr + i_kvh)
    new_col = i_kvh * HEAD_DIM
    # This split's share of the cache's tiles [st_lo, st_hi), then of the new keys' tiles
    acc, l_i, m_i = _attend_span(
        acc, l_i, m_i, st_lo, st_hi, ft_lo, ft_hi,
        b_q, q_pos, r_start, r_end, c_end, window, scale_log2e, softcap,
        p_bt, stride_bt_blk, last_blk, k_head_ptr, v_head_ptr, stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
        o_d, m_d, k_desc, v_desc, q_start, new_col, ctx_len, k_sc, v_sc,
        HEAD_DIM, HEAD_DIM_PAD, KV_BLOCK_SIZE, BLOCK_N, USE_WINDOW, WINDOW_RULE, USE_RANGES, USE_SOFTCAP, IEEE_DOT,
        KV_OFF32, False, KV_FP8, ROUND_E4M3)
    if READ_NEW:
        acc, l_i, m_i = _attend_span(
            acc, l_i, m_i, ns_lo, ns_hi, nf_lo, nf_hi,
            b_q, q_pos, r_start, r_end, seq_len, window, scale_log2e, softcap,
            p_bt, stride_bt_blk, last_blk, k_head_ptr, v_head_ptr,
            stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
            o_d, m_d, k_desc, v_desc, q_start, new_col, ctx_len, k_sc, v_sc,
            HEAD_DIM, HEAD_DIM_PAD, KV_BLOCK_SIZE, BLOCK_N, USE_WINDOW, WINDOW_RULE, USE_RANGES, USE_SOFTCAP, IEEE_DOT,
            KV_OFF32, True, KV_FP8, ROUND_E4M3)
        # No program of this launch reads the new keys from the caches: split 0 of each
        # query tile writes its own tokens' K/V there, for the steps after this one.
        if i_split == 0:
            _write_new_kv(k_new_ptr, v_new_ptr, slot_mapping_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                          i_kvh, q_start, ctx_len, first_pos, tl.minimum(first_pos + BLOCK_Q, seq_len), num_q_rows,
                          num_slots, stride_kn_tok, stride_kn_head, stride_vn_tok, stride_vn_head,
                          stride_k_blk, stride_k_tok, stride_k_head, stride_v_blk, stride_v_tok, stride_v_head,
                          o_d, m_d, cos_ptr, sin_ptr, stride_cs_tok, KV_BLOCK_SIZE, KV_FP8, ROUND_E4M3, BLOCK_Q,
                          0)

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
        if FUSE_MERGE and merge_now != 0:
            _merge_tile(out_ptr, part_o_ptr, part_lse_ptr, counter_ptr, p_out, p_po, p_pl, m_row, m_out,
                        num_active, stride_po_split, BLOCK_M, HEAD_DIM_PAD, MERGE_ROWS)


# Sizes and strides that differ between buckets without changing the code worth having:
# not specialised (Triton would compile one variant for == 1, one for multiples of 16 and
# one for the rest), so that capture compiles fewer variants.
# (The block table is column-major in the runtime: its column stride is the bucket's
# sequence count.) ``merge_now``: whether a split launch with FUSE_MERGE merges in place
# (0: a second launch merges), so that buckets on either side of the split limit share a
# variant.
# ``max_blocks_per_seq`` too: a one-column block table specialised to the constant 1 made
# the prefill descriptor path's PTX (bf16, head_dim 128, 16 x 64 tile, 3 stages) crash
# ptxas 12.8.93, Triton 3.6's (SIGSEGV, on the H200 and on a CPU machine alike).
_PER_BUCKET = ["max_num_seqs", "num_q_rows", "stride_bt_blk", "stride_po_tok", "stride_po_head", "stride_po_split",
               "stride_pl_tok", "stride_pl_head", "merge_now", "max_blocks_per_seq"]


@triton.jit(do_not_specialize=_PER_BUCKET)
def _attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr, prefix_ranges_ptr, k_scale_ptr, v_scale_ptr, counter_ptr,
    k_new_ptr, v_new_ptr, slot_mapping_ptr, k_desc, v_desc, cos_ptr, sin_ptr, stride_cs_tok,
    stride_q_tok, stride_q_head,
    stride_k_blk, stride_k_tok, stride_k_head,
    stride_v_blk, stride_v_tok, stride_v_head,
    stride_o_tok, stride_o_head,
    stride_bt_seq, stride_bt_blk,
    stride_po_tok, stride_po_head, stride_po_split,
    stride_pl_tok, stride_pl_head,
    stride_kn_tok, stride_kn_head, stride_vn_tok, stride_vn_head,
    scale_log2e, softcap, window,
    max_num_seqs, num_q_rows, num_blocks, max_blocks_per_seq, merge_now,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    QPK: tl.constexpr, QPK_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SHORT_Q: tl.constexpr, SHORT_BLOCK_N: tl.constexpr,
    MAX_RANGES: tl.constexpr,
    USE_WINDOW: tl.constexpr, WINDOW_RULE: tl.constexpr, USE_RANGES: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    SPLIT: tl.constexpr, IEEE_DOT: tl.constexpr, KV_FP8: tl.constexpr, KV_OFF32: tl.constexpr, FUSE_MERGE: tl.constexpr,
    MERGE_ROWS: tl.constexpr, DECODE_MAP: tl.constexpr, WRITE_KV: tl.constexpr, ROUND_E4M3: tl.constexpr,
    READ_NEW: tl.constexpr, PDL: tl.constexpr, ROPE_DIM: tl.constexpr,
):
    if PDL:
        # launched as a programmatic dependent of the kernel before it: wait for that one
        # (and so for everything before it) before any load, then let the next launch start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    i_kvh = tl.program_id(1)
    i_split = tl.program_id(2)
    if DECODE_MAP:
        # A decode launch (grid max_num_seqs + num_tokens // BLOCK_Q): program p < max_num_seqs
        # takes sequence p's first query tile with no search, so its three metadata loads go
        # out together. Sequence i's further tiles (a longer chunk in hand-built metadata),
        # tiles 1 .. cdiv(q_len, BLOCK_Q) - 1, are the programs from max_num_seqs +
        # query_start_loc[i] // BLOCK_Q on: floor((a + b) / Q) >= floor(a / Q) + cdiv(b, Q) - 1
        # keeps sequences' runs apart, and they end by num_tokens // BLOCK_Q when
        # query_start_loc[-1] <= num_tokens. Search for the last run start <= the program.
        i_prog = tl.program_id(0)
        if i_prog < max_num_seqs:
            i_seq = i_prog
            i_qblk = i_prog * 0
        else:
            i_extra = i_prog - max_num_seqs
            lo = i_prog * 0
            hi = lo + max_num_seqs
            while lo < hi:
                mid = (lo + hi) // 2
                if tl.load(query_start_loc_ptr + mid) // BLOCK_Q <= i_extra:
                    lo = mid + 1
                else:
                    hi = mid
            i_seq = tl.maximum(lo - 1, 0)
            i_qblk = 1 + i_extra - tl.load(query_start_loc_ptr + i_seq) // BLOCK_Q
        q_start = tl.load(query_start_loc_ptr + i_seq)
        q_len = tl.load(query_start_loc_ptr + i_seq + 1) - q_start
    else:
        # Tiles in reverse order: a sequence's last query tiles see the most keys (causal), so
        # they start first and the short ones fill the tail of the launch.
        i_tile = tl.num_programs(0) - 1 - tl.program_id(0)
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
    num_slots = tl.cast(num_blocks, tl.int64) * KV_BLOCK_SIZE

    if SHORT_Q > 0 and q_len <= SHORT_Q:
        # A decode (or short chunk) inside a launch tiled for prefills: a tile of SHORT_Q
        # tokens and longer key tiles, so it costs what it would in a decode launch.
        _attend_tile(
            q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr,
            prefix_ranges_ptr, block_table_ptr, k_scale_ptr, v_scale_ptr, counter_ptr,
            k_new_ptr, v_new_ptr, slot_mapping_ptr, k_desc, v_desc, cos_ptr, sin_ptr, stride_cs_tok,
            i_seq, 0, i_kvh, i_split, q_start, q_len, seq_len, num_q_rows, last_blk, merge_now, num_slots,
            stride_q_tok, stride_q_head, stride_k_blk, stride_k_tok, stride_k_head,
            stride_v_blk, stride_v_tok, stride_v_head, stride_o_tok, stride_o_head,
            stride_bt_seq, stride_bt_blk, stride_po_tok, stride_po_head, stride_po_split,
            stride_pl_tok, stride_pl_head, stride_kn_tok, stride_kn_head, stride_vn_tok, stride_vn_head,
            scale_log2e, softcap, window,
            HEAD_DIM, HEAD_DIM_PAD, KV_BLOCK_SIZE, QPK, QPK_PAD, SHORT_Q, SHORT_BLOCK_N, MAX_RANGES,
            USE_WINDOW, WINDOW_RULE, USE_RANGES, USE_SOFTCAP, SPLIT, IEEE_DOT, KV_FP8, KV_OFF32, FUSE_MERGE, MERGE_ROWS,
            WRITE_KV or READ_NEW, ROUND_E4M3, False,   # (short tiles write then read back, as decode launches)
            ROPE_DIM)
    else:
        _attend_tile(
            q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr,
            prefix_ranges_ptr, block_table_ptr, k_scale_ptr, v_scale_ptr, counter_ptr,
            k_new_ptr, v_new_ptr, slot_mapping_ptr, k_desc, v_desc, cos_ptr, sin_ptr, stride_cs_tok,
            i_seq, i_qblk, i_kvh, i_split, q_start, q_len, seq_len, num_q_rows, last_blk, merge_now, num_slots,
            stride_q_tok, stride_q_head, stride_k_blk, stride_k_tok, stride_k_head,
            stride_v_blk, stride_v_tok, stride_v_head, stride_o_tok, stride_o_head,
            stride_bt_seq, stride_bt_blk, stride_po_tok, stride_po_head, stride_po_split,
            stride_pl_tok, stride_pl_head, stride_kn_tok, stride_kn_head, stride_vn_tok, stride_vn_head,
            scale_log2e, softcap, window,
            HEAD_DIM, HEAD_DIM_PAD, KV_BLOCK_SIZE, QPK, QPK_PAD, BLOCK_Q, BLOCK_N, MAX_RANGES,
            USE_WINDOW, WINDOW_RULE, USE_RANGES, USE_SOFTCAP, SPLIT, IEEE_DOT, KV_FP8, KV_OFF32, FUSE_MERGE, MERGE_ROWS,
            WRITE_KV, ROUND_E4M3, READ_NEW, ROPE_DIM)


@triton.jit
def _merge_kernel(
    out_ptr, part_o_ptr, part_lse_ptr, query_start_loc_ptr,
    stride_o_tok, stride_o_head,
    stride_po_tok, stride_po_head, stride_po_split,
    stride_pl_tok, stride_pl_head,
    max_num_seqs,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:          # the attention launch before it wrote the partials (see _attn_kernel)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    i_tok = tl.program_id(0)
    i_head = tl.program_id(1)
    # The token count, the log-sum-exps and the partials are loaded together (the workspace
    # has a row for every token slot, so the loads stay inside it); rows of padding tokens
    # are computed on whatever is there and not stored.
    num_tokens = tl.load(query_start_loc_ptr + max_num_seqs)
    o_s = tl.arange(0, SPLITS_PAD)
    o_d = tl.arange(0, HEAD_DIM_PAD)
    m_s = o_s < NUM_SPLITS
    m_d = o_d < HEAD_DIM
    base_l = part_lse_ptr + i_tok.to(tl.int64) * stride_pl_tok + i_head * stride_pl_head
    b_lse = tl.load(base_l + o_s, mask=m_s, other=float("-inf"))   # [SPLITS_PAD]
    base_o = part_o_ptr + i_tok.to(tl.int64) * stride_po_tok + i_head * stride_po_head
    # [SPLITS_PAD, HEAD_DIM_PAD]
    b_o = tl.load(base_o + o_s[:, None] * stride_po_split + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0)
    lse_max = tl.max(b_lse, axis=0)                                 # finite for a token: the diagonal key is in some split
    w = tl.exp2(b_lse - lse_max)
    w = w / tl.sum(w, axis=0)
    # an idle split (log-sum-exp -inf, weight 0) wrote no partial output: what is there
    # (NaN, say) must not reach the sum
    b_out = tl.sum(tl.where(w[:, None] > 0.0, b_o * w[:, None], 0.0), axis=0)
    p_out = out_ptr + i_tok.to(tl.int64) * stride_o_tok + i_head * stride_o_head + o_d
    tl.store(p_out, b_out.to(out_ptr.dtype.element_ty), mask=m_d & (i_tok + o_d * 0 < num_tokens))
