"""KV-cache write: the step's new K/V rows into their cache slots (slot -1 = skip; so is any
slot outside the cache, checked on the device, so that hand-built metadata cannot write
past the cache)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_runnable, check_shape, check_tensor
from .metadata import AttentionMetadata


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_kc_blk, stride_kc_tok, stride_kc_head,
    stride_vc_blk, stride_vc_tok, stride_vc_head,
    num_slots,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
):
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
    p_kc = k_cache_ptr + i_blk * stride_kc_blk + i_off * stride_kc_tok + o_h[:, None] * stride_kc_head + o_d[None, :]
    p_vc = v_cache_ptr + i_blk * stride_vc_blk + i_off * stride_vc_tok + o_h[:, None] * stride_vc_head + o_d[None, :]
    tl.store(p_kc, b_k, mask=m)
    tl.store(p_vc, b_v, mask=m)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata | torch.Tensor) -> None:
    """Copy new K/V rows into the paged cache in place.

    k, v:    [T, Hkv, D], T = the metadata's token capacity (one row per token slot; rows
             past the step's tokens have slot -1).
    k_cache, v_cache: [num_blocks, block_size, Hkv, D], same dtype as k.
    meta:    AttentionMetadata, or its ``slot_mapping`` alone: [T] int64, a cache slot
             (block * block_size + offset) per token, -1 to skip the token. Slots past the
             cache are skipped too (checked on the device: no host read).
    """
    slot_mapping = meta.slot_mapping if isinstance(meta, AttentionMetadata) else meta
    check_tensor("slot_mapping", slot_mapping, dim=1, dtypes=(torch.int64,))
    device = slot_mapping.device
    check_runnable(device)
    check_tensor("k", k, dim=3, device=device)
    check_tensor("v", v, dim=3, dtypes=(k.dtype,), device=device)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if isinstance(t, torch.Tensor) and t.dtype != k.dtype:
            raise TypeError(f"{name} is {t.dtype} but k is {k.dtype}: k, v and the caches share one dtype")
    check_tensor("k_cache", k_cache, dim=4, device=device)
    check_tensor("v_cache", v_cache, dim=4, device=device)
    check_shape("v", v, k.shape)
    check_shape("v_cache", v_cache, k_cache.shape)
    num_tokens, num_kv_heads, head_dim = k.shape
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k_cache heads/head_dim {tuple(k_cache.shape[2:])} != k's {(num_kv_heads, head_dim)}")
    if k_cache.shape[1] < 1:
        raise ValueError(f"k_cache blocks must hold at least one token, got shape {tuple(k_cache.shape)}")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"k has {num_tokens} rows, slot_mapping {slot_mapping.shape[0]} entries (the metadata's "
                         f"token slots): k and v need one row per token slot")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_cache.shape[0] * k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        KV_BLOCK_SIZE=k_cache.shape[1],
        num_warps=4,
    )
