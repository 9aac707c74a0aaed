"""The Triton kernel of the KV-cache write (``kv_write.write_kv`` launches it). Imports
Triton alone (see ``_attention_jit``)."""

import triton
import triton.language as tl


@triton.jit
def _round_to_e4m3(x):
    """fp32 x (|x| <= 448, or NaN) rounded to the nearest e4m3 value, ties to even, still in fp32.
    Triton's interpreter converts fp32 to e4m3 dropping a carry into the exponent (31.9
    becomes 16, not 32); given a value it need not round, it is exact. On the GPU the
    hardware conversion rounds and this is not used."""
    bits = x.to(tl.int32, bitcast=True)
    negative = bits < 0                                  # the sign bit (-0.0 included)
    # normal e4m3 values keep 3 of fp32's 23 mantissa bits: round the low 20 to even
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    # NaN: the one of its sign whose top mantissa bits are set, which the interpreter's
    # conversion (it keeps the top bits) stores as e4m3's NaN of that sign (0x7F / 0xFF)
    bits = tl.where(x != x, tl.where(negative, -0x100000, 0x7FF00000), bits)
    # below 2**-6 e4m3 is subnormal, a multiple of 2**-9: adding 1.5 * 2**14 rounds there
    # (on |x|, so that the sign, zero included, stays x's)
    tiny = (tl.abs(x) + 24576.0) - 24576.0
    return tl.where(tl.abs(x) < 0.015625, tl.where(negative, -tiny, tiny), bits.to(tl.float32, bitcast=True))


@triton.jit
def _to_e4m3_values(x, scale, ROUND_E4M3: tl.constexpr):
    """What an fp8 cache stores for x: x / scale (IEEE division, as the reference),
    saturated to e4m3's range, in fp32; rounded to e4m3 here with ROUND_E4M3 (the
    interpreter), by the store's conversion otherwise. NaN stays NaN (e4m3 has one), as
    in a bf16 cache: min/max that drop it would store -448 * scale in its place."""
    x = tl.maximum(tl.div_rn(x.to(tl.float32), scale), -448.0, propagate_nan=tl.PropagateNan.ALL)
    x = tl.minimum(x, 448.0, propagate_nan=tl.PropagateNan.ALL)
    if ROUND_E4M3:
        x = _round_to_e4m3(x)
    return x


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_kc_blk, stride_kc_tok, stride_kc_head,
    stride_vc_blk, stride_vc_tok, stride_vc_head,
    num_slots,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr, QUANTIZE: tl.constexpr, ROUND_E4M3: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:          # a programmatic dependent launch: wait for the kernel before (see _attn_kernel)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    i_tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + i_tok)
    if (slot < 0) | (slot >= num_slots):
        return
    i_blk = slot // KV_BLOCK_SIZE
    i_off = slot % KV_BLOCK_SIZE
    o_h = tl.arange(0, HEADS_PAD)
    o_d = tl.arange(0, HEAD_DIM_PAD)
    m = (o_h < NUM_KV_HEADS)[:, None] & (o_d < HEAD_DIM)[None, :]
    # [HEADS_PAD, HEAD_DIM_PAD]
    b_k = tl.load(k_ptr + i_tok.to(tl.int64) * stride_k_tok + o_h[:, None] * stride_k_head + o_d[None, :], mask=m)
    b_v = tl.load(v_ptr + i_tok.to(tl.int64) * stride_v_tok + o_h[:, None] * stride_v_head + o_d[None, :], mask=m)
    if QUANTIZE:
        m_h = o_h < NUM_KV_HEADS
        b_k = _to_e4m3_values(b_k, tl.load(k_scale_ptr + o_h, mask=m_h, other=1.0)[:, None], ROUND_E4M3)
        b_v = _to_e4m3_values(b_v, tl.load(v_scale_ptr + o_h, mask=m_h, other=1.0)[:, None], ROUND_E4M3)
    p_kc = k_cache_ptr + i_blk * stride_kc_blk + i_off * stride_kc_tok + o_h[:, None] * stride_kc_head + o_d[None, :]
    p_vc = v_cache_ptr + i_blk * stride_vc_blk + i_off * stride_vc_tok + o_h[:, None] * stride_vc_head + o_d[None, :]
    tl.store(p_kc, b_k.to(k_cache_ptr.dtype.element_ty), mask=m)
    tl.store(p_vc, b_v.to(v_cache_ptr.dtype.element_ty), mask=m)
