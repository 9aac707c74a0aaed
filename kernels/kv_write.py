"""KV-cache write: the step's new K/V rows into their cache slots (slot -1 = skip; so is any
slot outside the cache, checked on the device, so that hand-built metadata cannot write
past the cache). An fp8 (e4m3) cache takes K / k_scale[h] and V / v_scale[h] per KV head,
saturated to +-448 and rounded to nearest even (``reference.quantize``)."""

from __future__ import annotations

import torch
import triton

from ._kv_write_jit import _round_to_e4m3, _write_kv_kernel  # noqa: F401
from ._checks import (CACHE_DTYPES, check_cache_dtypes, check_kv_scales, check_runnable, check_shape, check_tensor,
                      pdl_supported)
from .metadata import AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata | torch.Tensor, *, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Copy new K/V rows into the paged cache in place.

    k, v:    [T, Hkv, D], T = the metadata's token capacity (one row per token slot; rows
             past the step's tokens have slot -1).
    k_cache, v_cache: [num_blocks, block_size, Hkv, D], same dtype as k, or
             torch.float8_e4m3fn with ``k_scale`` / ``v_scale`` ([Hkv] float32 on the device,
             read on the device: they may change between replays).
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
    fp8 = check_cache_dtypes(k.dtype, "k", k_cache, v_cache)
    check_tensor("k_cache", k_cache, dim=4, dtypes=CACHE_DTYPES, device=device)
    check_tensor("v_cache", v_cache, dim=4, dtypes=CACHE_DTYPES, device=device)
    check_shape("v", v, k.shape)
    check_shape("v_cache", v_cache, k_cache.shape)
    num_tokens, num_kv_heads, head_dim = k.shape
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k_cache heads/head_dim {tuple(k_cache.shape[2:])} != k's {(num_kv_heads, head_dim)}")
    check_kv_scales(fp8, k_scale, v_scale, k_cache.shape[2], device)
    if k_cache.shape[1] < 1:
        raise ValueError(f"k_cache blocks must hold at least one token, got shape {tuple(k_cache.shape)}")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"k has {num_tokens} rows, slot_mapping {slot_mapping.shape[0]} entries (the metadata's "
                         f"token slots): k and v need one row per token slot")
    if num_tokens == 0:
        return
    pdl = pdl_supported(device)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale if fp8 else k, v_scale if fp8 else v,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_cache.shape[0] * k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        KV_BLOCK_SIZE=k_cache.shape[1], QUANTIZE=fp8, ROUND_E4M3=fp8 and device.type == "cpu", PDL=pdl,
        num_warps=4, launch_pdl=pdl,
    )
