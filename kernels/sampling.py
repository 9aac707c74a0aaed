"""Sampling next tokens from logits on the device, with per-row settings read from device
tensors: temperature (0 = greedy), top-k, top-p, min-p, and a seed with a counter that
decide the draw. Nothing is a Python number per step, so a launch captures in a CUDA
graph once and replays for any settings.

One program a row walks the row's logits a few times, never sorting them:
1. the maximum m and the first index holding it (greedy's answer);
2. top-k's threshold, the k-th largest logit, found exactly by a radix select over the
   logits' 32-bit order-preserving keys: eight passes of four bits, each counting the
   candidates per digit (ties at the threshold are all kept, as transformers'
   ``TopKLogitsWarper`` keeps them);
3. the top-k set's softmax mass Z (at temperature T: w = exp((logit - m) / T));
4. top-p's threshold, the same radix select weighted by w: the largest logit whose
   top set holds at least p Z (the smallest top set reaching p, as
   ``TopPLogitsWarper`` keeps);
5. min-p: w >= min_p (p_i >= min_p * p_max, as ``MinPLogitsWarper``), and the draw:
   Gumbel-max, the argmax of (logit - m) / T + g over the kept tokens, with
   g = -log(-log(u)) and u uniform from Philox keyed by the row's seed, its counter and
   the token's index. That is an exact draw from the kept set's renormalised softmax, and
   the same (seed, counter) gives the same token in any batch, in a replay or eagerly.

Passes a setting does not need (top-k off or >= the vocabulary, top-p = 1) are skipped.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ._checks import check_runnable, check_tensor

DIGIT_BITS = 4               # radix select: 8 passes of 16 bins over the 32-bit keys


@triton.jit
def _keys(b_l):
    """Order-preserving keys of fp32 values, as int64 in [0, 2**32)."""
    bits = b_l.to(tl.int32, bitcast=True).to(tl.int64)      # sign-extended
    return tl.where(bits < 0, ~bits, bits | 0x80000000) & 0xFFFFFFFF


@triton.jit
def _load_row(p_row, o_v, V):
    """fp32 logits of one chunk; NaN and the lanes past V read as -inf, -0.0 as +0.0 (one key
    for one value)."""
    b_l = tl.load(p_row + o_v, mask=o_v < V, other=float("-inf")).to(tl.float32)
    return tl.where(b_l != b_l, float("-inf"), b_l) + 0.0


@triton.jit
def _radix_digit(p_row, V, m, inv_t, floor_key, need, prefix, SHIFT: tl.constexpr, WEIGHTED: tl.constexpr,
                 BLOCK: tl.constexpr):
    """One level of ``_radix_select``: the digit at SHIFT of the selected key, given the
    digits above it (``prefix``). Returns (need left below it, prefix with the digit)."""
    HIGH: tl.constexpr = (0xFFFFFFFF << (SHIFT + 4)) & 0xFFFFFFFF       # the digits above this one
    o_b = tl.arange(0, 16)
    if WEIGHTED:
        b_h = tl.zeros([16], dtype=tl.float32)
    else:
        b_h = tl.zeros([16], dtype=tl.int32)
    for start in range(0, V, BLOCK):
        o_v = start + tl.arange(0, BLOCK)
        # [BLOCK]
        b_l = _load_row(p_row, o_v, V)
        b_k = _keys(b_l)
        m_c = ((b_k & HIGH) == prefix) & (b_k >= floor_key) & (o_v < V)
        b_d = (b_k >> SHIFT) & 15
        # [BLOCK, 16]: one-hot digit of each candidate
        m_hit = (b_d[:, None] == o_b[None, :]) & m_c[:, None]
        if WEIGHTED:
            b_w = tl.exp((b_l - m) * inv_t)
            b_h += tl.sum(tl.where(m_hit, b_w[:, None], 0.0), axis=0)
        else:
            b_h += tl.sum(m_hit.to(tl.int32), axis=0)
    # [16]: what the candidates with digit >= d hold
    b_ge = tl.sum(tl.where(o_b[None, :] >= o_b[:, None], b_h[None, :], 0), axis=1)
    d = tl.maximum(tl.max(tl.where(b_ge >= need, o_b, -1), axis=0), 0)
    need = need - tl.sum(tl.where(o_b > d, b_h, 0), axis=0)
    return need, prefix | (d.to(tl.int64) << SHIFT)


@triton.jit
def _radix_select(p_row, V, m, inv_t, floor_key, need, WEIGHTED: tl.constexpr, BLOCK: tl.constexpr):
    """The largest key t such that the candidates (keys >= floor_key) with keys >= t hold at
    least ``need``: a count of tokens, or (WEIGHTED) a softmax mass. Rounding can leave the
    total below ``need``; then the digit is the lowest (everything stays). Eight levels of
    four bits, unrolled (a constexpr shift each: a loop may not reassign a constexpr)."""
    prefix = floor_key * 0
    need, prefix = _radix_digit(p_row, V, m, inv_t, floor_key, need, prefix, 28, WEIGHTED, BLOCK)
    need, prefix = _radix_digit(p_row, V, m, inv_t, floor_key, need, prefix, 24, WEIGHTED, BLOCK)
    need, prefix = _radix_digit(p_row, V, m, inv_t, floor_key, need, prefix, 20, WEIGHTED, BLOCK)
    need, prefix = _radix_digit(p_row, V, m, inv_t, floor_key, need, prefix, 16, WEIGHTED, BLOCK)
    need, prefix = _radix_digit(p_row, V, m, inv_t, floor_key, need, prefix, 12, WEIGHTED, BLOCK)
    need, prefix = _radix_digit(p_row, V, m, inv_t, floor_key, need, prefix, 8, WEIGHTED, BLOCK)
    need, prefix = _radix_digit(p_row, V, m, inv_t, floor_key, need, prefix, 4, WEIGHTED, BLOCK)
    need, prefix = _radix_digit(p_row, V, m, inv_t, floor_key, need, prefix, 0, WEIGHTED, BLOCK)
    return prefix


@triton.jit
def _sample_kernel(logits_ptr, stride_row, V, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, counter_ptr,
                   out_ptr, lowest_ptr, HAS_LOWEST: tl.constexpr, BLOCK: tl.constexpr):
    i_s = tl.program_id(0)
    p_row = logits_ptr + i_s.to(tl.int64) * stride_row
    # 1. the maximum and its first index
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    i_m = tl.program_id(0) * 0
    for start in range(0, V, BLOCK):
        o_v = start + tl.arange(0, BLOCK)
        b_l = _load_row(p_row, o_v, V)
        c_m = tl.max(b_l, axis=0)
        c_i = tl.min(tl.where(b_l == c_m, o_v, V), axis=0)      # the chunk's first maximum
        take = c_m > m
        i_m = tl.where(take, c_i, i_m)
        m = tl.where(take, c_m, m)
    t = tl.load(temp_ptr + i_s)
    if (t > 0) & (m > float("-inf")):
        inv_t = 1.0 / t
        k = tl.load(top_k_ptr + i_s)
        p = tl.load(top_p_ptr + i_s)
        min_p = tl.load(min_p_ptr + i_s)
        floor_key = _keys(m) * 0
        # 2. top-k: the k-th largest logit's key
        if (k > 0) & (k < V):
            floor_key = _radix_select(p_row, V, m, inv_t, floor_key, k, False, BLOCK)
        # 3.-4. top-p over the top-k set
        if p < 1.0:
            z = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), axis=0)
            for start in range(0, V, BLOCK):
                o_v = start + tl.arange(0, BLOCK)
                b_l = _load_row(p_row, o_v, V)
                z += tl.sum(tl.where(_keys(b_l) >= floor_key, tl.exp((b_l - m) * inv_t), 0.0), axis=0)
            floor_key = tl.maximum(floor_key, _radix_select(p_row, V, m, inv_t, floor_key, p * z, True, BLOCK))
        # 5. min-p and the draw
        seed = tl.load(seed_ptr + i_s)
        counter = tl.load(counter_ptr + i_s).to(tl.int64)
        c_lo = (counter & 0xFFFFFFFF).to(tl.uint32)
        c_hi = ((counter >> 32) & 0xFFFFFFFF).to(tl.uint32)
        best = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
        lowest = m
        for start in range(0, V, BLOCK):
            o_v = start + tl.arange(0, BLOCK)
            b_l = _load_row(p_row, o_v, V)
            b_x = (b_l - m) * inv_t
            m_keep = (_keys(b_l) >= floor_key) & (tl.exp(b_x) >= min_p) & (o_v < V) & (b_l > float("-inf"))
            r0, _, _, _ = tl.philox(seed, o_v.to(tl.uint32), c_lo + o_v.to(tl.uint32) * 0,
                                    c_hi + o_v.to(tl.uint32) * 0, o_v.to(tl.uint32) * 0)
            b_u = tl.uint_to_uniform_float(r0)
            b_g = b_x - tl.log(-tl.log(b_u))
            b_g = tl.where(m_keep, b_g, float("-inf"))
            c_best = tl.max(b_g, axis=0)
            c_i = tl.min(tl.where(b_g == c_best, o_v, V), axis=0)
            take = c_best > best
            i_m = tl.where(take, c_i, i_m)
            best = tl.where(take, c_best, best)
            lowest = tl.minimum(lowest, tl.min(tl.where(m_keep, b_l, float("inf")), axis=0))
        tl.store(out_ptr + i_s, i_m.to(tl.int64))
        if HAS_LOWEST:
            tl.store(lowest_ptr + i_s, lowest)
    else:
        tl.store(out_ptr + i_s, i_m.to(tl.int64))
        if HAS_LOWEST:
            tl.store(lowest_ptr + i_s, m)


def default_block(vocab: int) -> int:
    """Logits a program reads at a time: the whole row up to 1024, else chunks of 1024."""
    return min(1024, max(16, triton.next_power_of_2(vocab)))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor, *, out: torch.Tensor | None = None,
           lowest: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's next token id, drawn from ``logits`` [S, V] with that row's settings.

    temperature [S] float32: 0 = greedy (the first maximum), else the softmax's temperature.
    top_k [S] int32: keep the k largest logits (ties at the k-th all kept); 0 = off.
    top_p [S] float32 in (0, 1]: then keep the smallest top set holding p of the mass.
    min_p [S] float32 in [0, 1): then keep tokens of probability >= min_p * the largest.
    seed [S] int64, counter [S] int64 or int32 (a sequence's length, say): the draw's key
    (the same pair draws the same token).
    out [S] int64 (given: written in place). lowest [S] float32 (given: receives the
    smallest logit kept, what the tests compare the kept set by).

    The settings are not checked here (they are device tensors; ``SamplingParams`` checks
    them on the host before they are staged): a temperature below 0 acts as 0, top_p >= 1
    and top_k outside (0, V) as off. NaN logits count as -inf; a row of only -inf gives 0.
    """
    check_tensor("logits", logits, dim=2)
    check_runnable(logits.device)
    s, v = logits.shape
    if v < 1:
        raise ValueError("logits must have at least one column")
    if v >= 2 ** 31:
        raise ValueError(f"logits has {v} columns; at most 2**31 - 1 fit the kernel's int32 indices")
    for name, t, dtype in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int32),
                           ("top_p", top_p, torch.float32), ("min_p", min_p, torch.float32),
                           ("seed", seed, torch.int64), ("counter", counter, (torch.int64, torch.int32))):
        check_tensor(name, t, dim=1, dtypes=dtype if isinstance(dtype, tuple) else (dtype,), device=logits.device)
        if t.shape[0] != s:
            raise ValueError(f"{name} must have one entry per row of logits ({s}), got {t.shape[0]}")
    if out is None:
        out = torch.empty(s, dtype=torch.int64, device=logits.device)
    else:
        check_tensor("out", out, dim=1, dtypes=(torch.int64,), device=logits.device)
        if out.shape[0] != s:
            raise ValueError(f"out must have {s} entries, got {out.shape[0]}")
    if lowest is not None:
        check_tensor("lowest", lowest, dim=1, dtypes=(torch.float32,), device=logits.device)
        if lowest.shape[0] != s:
            raise ValueError(f"lowest must have {s} entries, got {lowest.shape[0]}")
    if s == 0:
        return out
    _sample_kernel[(s,)](logits, logits.stride(0), v, temperature, top_k, top_p, min_p, seed, counter, out,
                         lowest if lowest is not None else out, HAS_LOWEST=lowest is not None,
                         BLOCK=default_block(v), num_warps=4)
    return out


@triton.jit
def _uniform_kernel(seed_ptr, counter_ptr, out_ptr, N, BLOCK: tl.constexpr):
    i_s = tl.program_id(0)
    seed = tl.load(seed_ptr + i_s)
    counter = tl.load(counter_ptr + i_s).to(tl.int64)
    c_lo = (counter & 0xFFFFFFFF).to(tl.uint32)
    c_hi = ((counter >> 32) & 0xFFFFFFFF).to(tl.uint32)
    for start in range(0, N, BLOCK):
        o_n = start + tl.arange(0, BLOCK)
        zero = o_n.to(tl.uint32) * 0
        r0, _, _, _ = tl.philox(seed, o_n.to(tl.uint32), c_lo + zero, c_hi + zero, zero)
        tl.store(out_ptr + i_s.to(tl.int64) * N + o_n, tl.uint_to_uniform_float(r0), mask=o_n < N)


def uniforms(seed: torch.Tensor, counter: torch.Tensor, n: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """[S, n] float32 uniforms in [0, 1): row i's j-th is Philox keyed by (seed[i],
    counter[i], index j), the stream ``sample`` draws its Gumbel noise from (so a caller
    keeps its draws apart by its counters). seed [S] int64, counter [S] int64 or int32."""
    check_tensor("seed", seed, dim=1, dtypes=(torch.int64,))
    check_runnable(seed.device)
    check_tensor("counter", counter, dim=1, dtypes=(torch.int64, torch.int32), device=seed.device)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < 2 ** 31:
        raise ValueError(f"n must be an int in [1, 2**31), got {n!r}")
    s = seed.shape[0]
    if counter.shape[0] != s:
        raise ValueError(f"counter must have one entry per seed ({s}), got {counter.shape[0]}")
    if out is None:
        out = torch.empty(s, n, dtype=torch.float32, device=seed.device)
    else:
        check_tensor("out", out, dim=2, dtypes=(torch.float32,), device=seed.device)
        if tuple(out.shape) != (s, n) or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous [{s}, {n}] tensor, got {list(out.shape)}")
    if s:
        _uniform_kernel[(s,)](seed, counter, out, n, BLOCK=min(1024, max(16, triton.next_power_of_2(n))))
    return out


def kept_probs(logits: torch.Tensor, temperature: torch.Tensor, lowest: torch.Tensor) -> torch.Tensor:
    """[S, V] float32: the distribution ``sample`` draws row i from, given the smallest
    logit it kept (``sample(..., lowest=)``): the softmax at temperature[i] over the logits
    >= lowest[i], zero elsewhere (every filter keeps a top set, so the kept set is the
    logits at or above the lowest kept); a greedy row (temperature <= 0) is one-hot at its
    first maximum, as is a row with nothing finite (``sample`` gives it token 0). Plain tensor ops: capturable, no
    host read."""
    x = logits.float().nan_to_num(nan=float("-inf"), neginf=float("-inf"))
    hot = torch.zeros_like(x).scatter_(1, x.argmax(dim=1, keepdim=True), 1.0)
    t = torch.where(temperature > 0, temperature, 1.0)[:, None]
    m = x.amax(dim=1, keepdim=True)
    w = torch.where((x >= lowest[:, None]) & (x > float("-inf")), torch.exp((x - m) / t), 0.0)
    w = torch.where(temperature[:, None] > 0, w, hot)
    total = w.sum(dim=1, keepdim=True)
    return torch.where(total > 0, w / total.clamp_min(1e-30), hot)


def philox_uniform(seed: int, counter: int, index: np.ndarray) -> np.ndarray:
    """The kernel's uniforms in numpy (the reference draws with them): Philox 4x32, ten
    rounds, key = the seed's two halves, counter = (index, counter's low and high halves, 0),
    the first word to a float in [0, 1) as ``tl.uint_to_uniform_float``."""
    mask = np.uint64(0xFFFFFFFF)
    seed = np.uint64(seed & 0xFFFFFFFFFFFFFFFF)
    k0, k1 = seed & mask, seed >> np.uint64(32)
    c0 = index.astype(np.uint64) & mask
    c1 = np.full_like(c0, np.uint64(counter & 0xFFFFFFFF))
    c2 = np.full_like(c0, np.uint64((counter >> 32) & 0xFFFFFFFF))
    c3 = np.zeros_like(c0)
    a, b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(10):
        p0, p2 = a * c0, b * c2                     # 64-bit products of 32-bit words
        c0, c1, c2, c3 = ((p2 >> np.uint64(32)) ^ c1 ^ k0) & mask, p2 & mask, \
            ((p0 >> np.uint64(32)) ^ c3 ^ k1) & mask, p0 & mask
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    x = c0.astype(np.uint32).view(np.int32)
    x = np.where(x < 0, ~x, x)
    return (x.astype(np.float32) * np.float32(4.6566127342e-10)).astype(np.float32)
