"""graphrt.kernels.write_kv against the reference write, on random slots."""

from __future__ import annotations

import pytest
import torch

from _cases import fresh_seed, rngs
from graphrt.kernels import reference, write_kv

WRITE_DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),   # a copy, no tl.dot: fine in the interpreter too
]


@pytest.mark.parametrize("dtype", WRITE_DTYPES)
@pytest.mark.parametrize("num_tokens,num_kv_heads,head_dim,block_size", [
    (1, 1, 64, 16), (17, 2, 64, 16), (63, 8, 128, 16), (40, 3, 80, 32), (9, 1, 256, 8),
], ids=["one-token", "odd-17", "gqa8-63", "heads3-dim80", "dim256"])
def test_write_kv(dtype, num_tokens, num_kv_heads, head_dim, block_size, device):
    seed = fresh_seed()
    rng, gen = rngs(seed)
    num_blocks = num_tokens // block_size + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    slots = torch.from_numpy(rng.permutation(num_blocks * block_size)[:num_tokens]).long()
    slots[torch.from_numpy(rng.random(num_tokens) < 0.25)] = -1    # padding rows: skipped
    slots = slots.to(device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(k, v, k_ref, v_ref, slots)

    write_kv(k, v, k_cache, v_cache, slots)

    # bit-exact: written rows equal the inputs, every other slot keeps its old value
    assert torch.equal(k_cache, k_ref), f"k_cache differs from the reference write (seed={seed})"
    assert torch.equal(v_cache, v_ref), f"v_cache differs from the reference write (seed={seed})"


def test_write_kv_strided_inputs(device):
    """k and v as views of a fused qkv projection output (non-contiguous token stride)."""
    seed = fresh_seed()
    _, gen = rngs(seed)
    qkv = torch.randn(10, 4 + 2 + 2, 64, generator=gen).to(device)
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    k_cache = torch.zeros(2, 16, 2, 64, device=device)
    v_cache = torch.zeros(2, 16, 2, 64, device=device)
    slots = torch.arange(10, device=device) + 5
    write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 2, 64)[5:15], k) and torch.equal(v_cache.view(-1, 2, 64)[5:15], v)
    assert not k_cache.view(-1, 2, 64)[:5].any() and not k_cache.view(-1, 2, 64)[15:].any()
