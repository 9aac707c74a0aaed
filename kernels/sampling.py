"""Sampling next tokens from logits on the device, with per-row settings read from device
tensors: temperature (0 = greedy), top-k, top-p, min-p, and a seed with a counter that
decide the draw. Nothing is a Python number per step, so a launch captures in a CUDA
graph once and replays for any settings.

A row is cut into up to MAX_CHUNKS chunks (a cut that depends on the vocabulary only), and
twenty-two launches walk the chunks, never sorting a row; a program takes one chunk at small batches
(so that one row at batch 1 fills the GPU) and several at large ones (about PROGRAMS
programs a launch). Each launch's programs reduce what the last one left per chunk (in a
fixed order: the same result every run and in any batch). A chunk whose maximum is below
every candidate of a pass is not read in it, nor, in a radix select, a chunk that held
nothing in the digit the level before kept; a select's leading levels, whose digit its
candidates' bounds fix (below), read nothing. The passes:
1. the maximum m and the first index holding it (greedy's answer);
2. top-k's threshold, the k-th largest logit, found exactly by a radix select over the
   logits' 32-bit order-preserving keys: eight launches of four bits, each counting the
   candidates per digit in every chunk (ties at the threshold are all kept, as transformers'
   ``TopKLogitsWarper`` keeps them); where k is at most the number of chunks, the k-th
   largest chunk maximum bounds the threshold from below: the logits under it are not
   candidates;
3. the top-k set's softmax mass Z (at temperature T: w = exp((logit - m) / T));
4. top-p's threshold, the same radix select weighted by w over the top-k set (top-k's
   threshold its lower bound): the largest logit whose top set holds at least p Z (the
   smallest top set reaching p, as ``TopPLogitsWarper`` keeps);
5. min-p: w >= min_p (p_i >= min_p * p_max, as ``MinPLogitsWarper``), and the draw:
   Gumbel-max, the argmax of (logit - m) / T + g over the kept tokens, with
   g = -log(-log(u)) and u uniform from Philox keyed by the row's seed, its counter and
   the token's index. That is an exact draw from the kept set's renormalised softmax, and
   the same (seed, counter) gives the same token in any batch, in a replay or eagerly.

A short path replaces passes 2 to 4 for a row whose top-k bound exists (k at most the
chunk count) and leaves few candidates: the chunks copy the logits at or above the bound
into a row's list (at most CANDIDATES; one launch), and one program a row sorts the list
and reads both thresholds off it (top-k's: the k-th entry; top-p's: the first entry whose
running mass, in sorted order, reaches p Z). Its masses are summed in another order than
the radix path's, which could move top-p's threshold only at a mass within rounding of p
Z. A row with more candidates than the list holds, or no bound, takes the radix passes.

A row whose settings do not need a pass (greedy; top-k off or >= the vocabulary; top-p =
1; the radix passes where the short path served it) returns from it at once; every
launch is made (a captured graph serves any settings), except on CPU tensors, where the
interpreter's programs are slow and the settings are read to leave out passes no row
needs.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ._checks import check_runnable, check_tensor

DIGIT_BITS = 4               # radix select: 8 passes of 16 bins over the 32-bit keys
CANDIDATES = 1024            # the short path's list: a row with more candidates takes the radix passes


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
def _row_max(pmax_ptr, pidx_ptr, row, C, CP: tl.constexpr):
    """The row's maximum and its first index, from the chunks' (``_max_kernel``)."""
    o_c = tl.arange(0, CP)
    b_m = tl.load(pmax_ptr + row * C + o_c, mask=o_c < C, other=float("-inf"))
    b_i = tl.load(pidx_ptr + row * C + o_c, mask=o_c < C, other=2 ** 31 - 1)
    m = tl.max(b_m, axis=0)
    return m, tl.min(tl.where((b_m == m) & (o_c < C), b_i, 2 ** 31 - 1), axis=0)


@triton.jit
def _digit(h_ptr, base, C, prefix, need, shift, CP: tl.constexpr):
    """One radix level reduced over the row's chunks: ``h_ptr + base`` holds [C, 16] counts or
    masses of the candidates per digit at ``shift``; the digit kept is the largest whose
    candidates at or above it hold ``need``. Returns (prefix with it, need left below it)."""
    o_c = tl.arange(0, CP)
    o_b = tl.arange(0, 16)
    b_h = tl.sum(tl.load(h_ptr + base + o_c[:, None] * 16 + o_b[None, :], mask=(o_c < C)[:, None], other=0), axis=0)
    # [16]: what the candidates with digit >= d hold
    b_ge = tl.sum(tl.where(o_b[None, :] >= o_b[:, None], b_h[None, :], 0), axis=1)
    d = tl.maximum(tl.max(tl.where(b_ge >= need, o_b, -1), axis=0), 0)
    need = need - tl.sum(tl.where(o_b > d, b_h, 0), axis=0)
    return prefix | (d.to(tl.int64) << shift), need


@triton.jit
def _threshold(h_ptr, key_ptr, need_ptr, row, S, C, CP: tl.constexpr):
    """A select's key after its eighth level: the state before it and the level's histograms."""
    key, _ = _digit(h_ptr, ((7 * S + row) * C) * 16, C, tl.load(key_ptr + 7 * S + row),
                    tl.load(need_ptr + 7 * S + row), 0, CP)
    return key


@triton.jit
def _kth_largest_key(p_pmax, C, k, CP: tl.constexpr):
    """The k-th largest (1 <= k <= C) of a row's C chunk maxima, as a key: the largest
    maximum that at least k maxima reach (ties counted). The maxima reaching each are
    counted against 16 of them at a time (a [CP, CP] compare at once held 150 registers
    at CP = 128, sm_90)."""
    o_c = tl.arange(0, CP)
    b_k = tl.where(o_c < C, _keys(tl.load(p_pmax + o_c, mask=o_c < C, other=float("-inf"))), -1)
    reach = tl.zeros([CP], dtype=tl.int32)          # [CP]: maxima >= each
    for j0 in range(0, C, 16):
        o_j = j0 + tl.arange(0, 16)
        b_j = tl.where(o_j < C, _keys(tl.load(p_pmax + o_j, mask=o_j < C, other=float("-inf"))), -1)
        reach += tl.sum((b_j[None, :] >= b_k[:, None]).to(tl.int32), axis=1)
    return tl.max(tl.where(reach >= k, b_k, 0), axis=0)      # (lanes past C hold -1: never the largest)


@triton.jit
def _shared_digits(lo, hi):
    """How many of the leading 4-bit digits two keys (in [0, 2**32)) share, at most 7: the
    radix levels before it are fixed by them."""
    o_j = tl.arange(0, 8).to(tl.int64)
    return tl.minimum(tl.sum((((lo ^ hi) >> (28 - 4 * o_j)) == 0).to(tl.int32), axis=0), 7)


@triton.jit
def _max_kernel(logits_ptr, stride_row, V, CHUNK, C, G, pmax_ptr, pidx_ptr, count_ptr, COUNT: tl.constexpr,
                BLOCK: tl.constexpr):
    """Each of G chunks' maximum and its first index; COUNT: the row's first program also
    empties the short path's candidate count (``_collect_kernel`` adds to it next)."""
    row = tl.program_id(0)
    g = tl.program_id(1)
    if COUNT:
        if g == 0:
            tl.store(count_ptr + row, 0)
    p_row = logits_ptr + row.to(tl.int64) * stride_row
    for c in range(g * G, tl.minimum(g * G + G, C)):
        m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
        i_m = c * CHUNK
        end = tl.minimum(c * CHUNK + CHUNK, V)
        for start in range(c * CHUNK, end, BLOCK):
            o_v = start + tl.arange(0, BLOCK)
            b_l = _load_row(p_row, o_v, end)
            c_m = tl.max(b_l, axis=0)
            c_i = tl.min(tl.where(b_l == c_m, o_v, V), axis=0)      # the piece's first maximum
            take = c_m > m
            i_m = tl.where(take, c_i, i_m)
            m = tl.where(take, c_m, m)
        tl.store(pmax_ptr + row * C + c, m)
        tl.store(pidx_ptr + row * C + c, i_m)


@triton.jit
def _radix_kernel(logits_ptr, stride_row, V, CHUNK, C, G, S, temp_ptr, top_k_ptr, top_p_ptr, pmax_ptr, pidx_ptr,
                  fast_ptr, h_ptr, key_ptr, need_ptr, kthr_ptr, zpart_ptr, level, WEIGHTED: tl.constexpr,
                  CP: tl.constexpr, BLOCK: tl.constexpr):
    """Level ``level`` of a radix select (WEIGHTED: top-p's, over the top-k set; else top-k's)
    for G chunks of one row: the state before this level from the last one, or from the
    candidates' bounds where they fix it (the row's first program writes it, for the next
    level and the consumers), then each chunk's histogram of the digit (zeros, unread, for a
    chunk that holds no candidate; none written at a level the bounds fix: no level reads
    it). A row the short path served (``fast``) is skipped."""
    row = tl.program_id(0)
    g = tl.program_id(1)
    t = tl.load(temp_ptr + row)
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    if WEIGHTED:
        wanted = (t > 0) & (p < 1.0)
    else:
        wanted = (t > 0) & (k > 0) & (k < V)
    # (settings first: a row that needs no select, or that the short path served, reads nothing more)
    if wanted & (tl.load(fast_ptr + row) == 0):
        m, _first = _row_max(pmax_ptr, pidx_ptr, row, C, CP)
        if m > float("-inf"):
            inv_t = 1.0 / t
            hi_key = _keys(m)
            # the candidates' keys lie in [floor_key, hi_key]: top-p's at or above top-k's
            # threshold; top-k's at or above the k-th largest chunk maximum where k <= C
            # (k chunks hold a logit that large, so the k-th largest logit is no smaller)
            floor_key = hi_key * 0
            if WEIGHTED:
                if (k > 0) & (k < V):
                    floor_key = tl.load(kthr_ptr + row)
            elif k <= C:
                floor_key = _kth_largest_key(pmax_ptr + row * C, C, k, CP)
            # the levels whose digit the two bounds share fix it for every candidate: up to
            # the first that differs (at most the last), the state is the bounds' prefix and
            # nothing is read
            first = _shared_digits(floor_key, hi_key)
            if level <= first:
                key = (hi_key >> (32 - 4 * level)) << (32 - 4 * level)
                if WEIGHTED:
                    o_c = tl.arange(0, CP)
                    need = p * tl.sum(tl.load(zpart_ptr + row * C + o_c, mask=o_c < C, other=0.0), axis=0)
                else:
                    need = k
            else:
                key, need = _digit(h_ptr, (((level - 1) * S + row) * C) * 16, C,
                                   tl.load(key_ptr + (level - 1) * S + row),
                                   tl.load(need_ptr + (level - 1) * S + row), 32 - 4 * level, CP)
            if g == 0:
                tl.store(key_ptr + level * S + row, key)
                tl.store(need_ptr + level * S + row, need)
            if level >= first:
                shift = 28 - 4 * level
                # the candidates: keys with the prefix's high bits, at or above the floor
                low = tl.maximum((key >> (shift + 4)) << (shift + 4), floor_key)
                o_b = tl.arange(0, 16)
                p_row = logits_ptr + row.to(tl.int64) * stride_row
                # the digit the last level kept: a chunk with nothing in it there (no count, or
                # no mass: every candidate's weight 0) has nothing at this level either
                p_prev = h_ptr + (((level - 1) * S + row) * C) * 16 + ((key >> (shift + 4)) & 15)
                for c in range(g * G, tl.minimum(g * G + G, C)):
                    if WEIGHTED:
                        b_h = tl.zeros([16], dtype=tl.float32)
                    else:
                        b_h = tl.zeros([16], dtype=tl.int32)
                    live = _keys(tl.load(pmax_ptr + row * C + c)) >= low
                    if level > first:
                        live = live & (tl.load(p_prev + c * 16) != 0)
                    if live:      # else no candidate in the chunk
                        end = tl.minimum(c * CHUNK + CHUNK, V)
                        for start in range(c * CHUNK, end, BLOCK):
                            o_v = start + tl.arange(0, BLOCK)
                            # [BLOCK]
                            b_l = _load_row(p_row, o_v, end)
                            b_k = _keys(b_l)
                            m_c = (((b_k >> (shift + 4)) == (key >> (shift + 4))) & (b_k >= floor_key)
                                   & (o_v < end))
                            b_d = ((b_k >> shift) & 15).to(tl.int32)      # 32-bit for the 16 compares below
                            # [BLOCK, 16]: one-hot digit of each candidate
                            m_hit = (b_d[:, None] == o_b[None, :]) & m_c[:, None]
                            if WEIGHTED:
                                b_w = tl.exp((b_l - m) * inv_t)
                                b_h += tl.sum(tl.where(m_hit, b_w[:, None], 0.0), axis=0)
                            else:
                                b_h += tl.sum(m_hit.to(tl.int32), axis=0)
                    tl.store(h_ptr + ((level * S + row) * C + c) * 16 + o_b, b_h)


@triton.jit
def _mass_kernel(logits_ptr, stride_row, V, CHUNK, C, G, S, temp_ptr, top_k_ptr, top_p_ptr, pmax_ptr, pidx_ptr,
                 fast_ptr, hk_ptr, kkey_ptr, kneed_ptr, kthr_ptr, zpart_ptr, CP: tl.constexpr, BLOCK: tl.constexpr):
    """Top-k's threshold (the row's first program keeps it for the later passes) and, where
    top-p is on, each of G chunks' share of the top-k set's softmax mass (nothing for a row
    the short path served)."""
    row = tl.program_id(0)
    g = tl.program_id(1)
    t = tl.load(temp_ptr + row)
    if (t > 0) & (tl.load(fast_ptr + row) == 0):
        m, _first = _row_max(pmax_ptr, pidx_ptr, row, C, CP)
        if m > float("-inf"):
            k = tl.load(top_k_ptr + row)
            floor_key = _keys(m) * 0
            if (k > 0) & (k < V):
                floor_key = _threshold(hk_ptr, kkey_ptr, kneed_ptr, row, S, C, CP)
            if g == 0:
                tl.store(kthr_ptr + row, floor_key)
            if tl.load(top_p_ptr + row) < 1.0:
                inv_t = 1.0 / t
                p_row = logits_ptr + row.to(tl.int64) * stride_row
                for c in range(g * G, tl.minimum(g * G + G, C)):
                    z = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), axis=0)
                    if _keys(tl.load(pmax_ptr + row * C + c)) >= floor_key:     # else none of the set here
                        end = tl.minimum(c * CHUNK + CHUNK, V)
                        for start in range(c * CHUNK, end, BLOCK):
                            o_v = start + tl.arange(0, BLOCK)
                            b_l = _load_row(p_row, o_v, end)
                            z += tl.sum(tl.where(_keys(b_l) >= floor_key, tl.exp((b_l - m) * inv_t), 0.0), axis=0)
                    tl.store(zpart_ptr + row * C + c, z)


@triton.jit
def _draw_kernel(logits_ptr, stride_row, V, CHUNK, C, G, S, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr,
                 counter_ptr, pmax_ptr, pidx_ptr, fast_ptr, fthr_ptr, kthr_ptr, hp_ptr, pkey_ptr, pneed_ptr,
                 bestv_ptr, besti_ptr, lowc_ptr, DRAW: tl.constexpr, CP: tl.constexpr, BLOCK: tl.constexpr):
    """Min-p and the draw over G chunks: each one's best Gumbel score among the kept tokens,
    where, and its smallest kept logit (DRAW 0: the smallest kept logit alone, no uniforms
    drawn; seed, counter, bestv and besti untouched)."""
    row = tl.program_id(0)
    g = tl.program_id(1)
    t = tl.load(temp_ptr + row)
    if t > 0:
        m, _first = _row_max(pmax_ptr, pidx_ptr, row, C, CP)
        if m > float("-inf"):
            inv_t = 1.0 / t
            if tl.load(fast_ptr + row) != 0:       # the short path's thresholds
                floor_key = tl.load(fthr_ptr + row)
            else:
                floor_key = tl.load(kthr_ptr + row)
                if tl.load(top_p_ptr + row) < 1.0:
                    floor_key = tl.maximum(floor_key, _threshold(hp_ptr, pkey_ptr, pneed_ptr, row, S, C, CP))
            min_p = tl.load(min_p_ptr + row)
            if DRAW:
                seed = tl.load(seed_ptr + row)
                counter = tl.load(counter_ptr + row).to(tl.int64)
                c_lo = (counter & 0xFFFFFFFF).to(tl.uint32)
                c_hi = ((counter >> 32) & 0xFFFFFFFF).to(tl.uint32)
            p_row = logits_ptr + row.to(tl.int64) * stride_row
            for c in range(g * G, tl.minimum(g * G + G, C)):
                best = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
                i_b = c * CHUNK
                lowest = m
                if _keys(tl.load(pmax_ptr + row * C + c)) >= floor_key:     # else nothing kept here
                    end = tl.minimum(c * CHUNK + CHUNK, V)
                    for start in range(c * CHUNK, end, BLOCK):
                        o_v = start + tl.arange(0, BLOCK)
                        b_l = _load_row(p_row, o_v, end)
                        b_x = (b_l - m) * inv_t
                        m_keep = ((_keys(b_l) >= floor_key) & (tl.exp(b_x) >= min_p) & (o_v < end)
                                  & (b_l > float("-inf")))
                        if DRAW:
                            r0, _r1, _r2, _r3 = tl.philox(seed, o_v.to(tl.uint32), c_lo + o_v.to(tl.uint32) * 0,
                                                          c_hi + o_v.to(tl.uint32) * 0, o_v.to(tl.uint32) * 0)
                            b_u = tl.uint_to_uniform_float(r0)
                            b_g = b_x - tl.log(-tl.log(b_u))
                            b_g = tl.where(m_keep, b_g, float("-inf"))
                            c_best = tl.max(b_g, axis=0)
                            c_i = tl.min(tl.where(b_g == c_best, o_v, V), axis=0)
                            take = c_best > best
                            i_b = tl.where(take, c_i, i_b)
                            best = tl.where(take, c_best, best)
                        lowest = tl.minimum(lowest, tl.min(tl.where(m_keep, b_l, float("inf")), axis=0))
                if DRAW:
                    tl.store(bestv_ptr + row * C + c, best)
                    tl.store(besti_ptr + row * C + c, i_b)
                tl.store(lowc_ptr + row * C + c, lowest)


@triton.jit
def _pick_kernel(temp_ptr, pmax_ptr, pidx_ptr, bestv_ptr, besti_ptr, lowc_ptr, out_ptr, lowest_ptr, C,
                 DRAW: tl.constexpr, HAS_LOWEST: tl.constexpr, CP: tl.constexpr):
    """Each row's token: the first maximum (greedy, or nothing finite), else the best Gumbel
    score over the chunks (the first index among equal ones). DRAW 0: no token (out
    untouched), the smallest kept logit alone."""
    row = tl.program_id(0)
    t = tl.load(temp_ptr + row)
    m, i_m = _row_max(pmax_ptr, pidx_ptr, row, C, CP)
    low = m
    if (t > 0) & (m > float("-inf")):
        o_c = tl.arange(0, CP)
        if DRAW:
            b_v = tl.load(bestv_ptr + row * C + o_c, mask=o_c < C, other=float("-inf"))
            b_i = tl.load(besti_ptr + row * C + o_c, mask=o_c < C, other=2 ** 31 - 1)
            best = tl.max(b_v, axis=0)
            i_m = tl.min(tl.where((b_v == best) & (o_c < C), b_i, 2 ** 31 - 1), axis=0)
        low = tl.min(tl.load(lowc_ptr + row * C + o_c, mask=o_c < C, other=float("inf")), axis=0)
    if DRAW:
        tl.store(out_ptr + row, i_m.to(tl.int64))
    if HAS_LOWEST:
        tl.store(lowest_ptr + row, low)


@triton.jit
def _short_path(t, k, V, C):
    """Whether a row may take the short path: sampling, with top-k on and bounded by its
    chunk maxima (k at most the chunk count)."""
    return (t > 0) & (k > 0) & (k < V) & (k <= C)


@triton.jit
def _collect_kernel(logits_ptr, stride_row, V, CHUNK, C, G, temp_ptr, top_k_ptr, pmax_ptr, pidx_ptr, count_ptr,
                    cand_ptr, CAP: tl.constexpr, CP: tl.constexpr, BLOCK: tl.constexpr):
    """The short path's list: G chunks' logits at or above top-k's bound (the k-th largest
    chunk maximum) appended to the row's list, the row's count grown by them all (a count
    past CAP: the list is partial, and the row takes the radix passes). The order of the
    list depends on the programs' timing; what it holds does not."""
    row = tl.program_id(0)
    g = tl.program_id(1)
    if _short_path(tl.load(temp_ptr + row), tl.load(top_k_ptr + row), V, C):
        m, _first = _row_max(pmax_ptr, pidx_ptr, row, C, CP)
        if m > float("-inf"):
            floor_key = _kth_largest_key(pmax_ptr + row * C, C, tl.load(top_k_ptr + row), CP)
            p_row = logits_ptr + row.to(tl.int64) * stride_row
            p_cand = cand_ptr + row.to(tl.int64) * CAP
            for c in range(g * G, tl.minimum(g * G + G, C)):
                if _keys(tl.load(pmax_ptr + row * C + c)) >= floor_key:      # else no candidate here
                    end = tl.minimum(c * CHUNK + CHUNK, V)
                    for start in range(c * CHUNK, end, BLOCK):
                        o_v = start + tl.arange(0, BLOCK)
                        b_l = _load_row(p_row, o_v, end)
                        m_c = (_keys(b_l) >= floor_key) & (o_v < end)
                        n_c = tl.sum(m_c.to(tl.int32), axis=0)
                        if n_c > 0:
                            base = tl.atomic_add(count_ptr + row, n_c)
                            pos = base + tl.cumsum(m_c.to(tl.int32), axis=0) - 1
                            tl.store(p_cand + pos, b_l, mask=m_c & (pos < CAP))


@triton.jit
def _select_kernel(temp_ptr, top_k_ptr, top_p_ptr, pmax_ptr, pidx_ptr, count_ptr, cand_ptr, fast_ptr, fthr_ptr,
                   V, C, CAP: tl.constexpr, CP: tl.constexpr):
    """The short path's thresholds, one program a row: where the row's list is whole, its
    entries sorted, top-k's threshold the k-th (ties at it all kept) and, where top-p is on,
    top-p's the first entry whose running mass over the top-k set reaches p Z (the largest
    logit whose top set holds p Z): ``fthr`` the higher of the two, as a key, and ``fast``
    1 (the radix passes and the mass pass then skip the row); else ``fast`` 0."""
    row = tl.program_id(0)
    t = tl.load(temp_ptr + row)
    k = tl.load(top_k_ptr + row)
    fast = 0
    if _short_path(t, k, V, C):
        m, _first = _row_max(pmax_ptr, pidx_ptr, row, C, CP)
        n = tl.load(count_ptr + row)
        if (m > float("-inf")) & (n <= CAP):
            o = tl.arange(0, CAP)
            b_s = tl.sort(tl.load(cand_ptr + row.to(tl.int64) * CAP + o, mask=o < n, other=float("-inf")),
                          descending=True)
            v_k = tl.max(tl.where(o == k - 1, b_s, float("-inf")), axis=0)     # (k <= n: k maxima reach the bound)
            thr = _keys(v_k)
            p = tl.load(top_p_ptr + row)
            if p < 1.0:
                b_w = tl.where((o < n) & (b_s >= v_k), tl.exp((b_s - m) * (1.0 / t)), 0.0)
                z = tl.sum(b_w, axis=0)
                reach = (tl.cumsum(b_w, axis=0) >= p * z) & (o < n) & (b_s >= v_k)
                i_p = tl.min(tl.where(reach, o, CAP), axis=0)
                if i_p < CAP:      # (none only where rounding kept the last sum below p Z: all kept)
                    thr = tl.maximum(thr, _keys(tl.max(tl.where(o == i_p, b_s, float("-inf")), axis=0)))
            tl.store(fthr_ptr + row, thr)
            fast = 1
    tl.store(fast_ptr + row, fast)


def default_block(vocab: int) -> int:
    """Logits a program reads at a time: the whole row up to 1024, else pieces of 1024."""
    return min(1024, max(16, triton.next_power_of_2(vocab)))


MAX_CHUNKS = 128     # chunks a row at most (enough to fill a GPU at batch 1)
PROGRAMS = 1024      # programs a launch aims at: at larger batches a program takes several chunks


def chunking(vocab: int) -> tuple[int, int, int]:
    """(block, chunk, chunks): a row is cut into ``chunks`` chunks of ``chunk`` logits (a
    multiple of ``block``), at most MAX_CHUNKS. The cut depends on the vocabulary only: the
    partial maxima and masses are per chunk, so a row's sums (and so its draw) are the same
    in any batch."""
    block = default_block(vocab)
    chunk = max(block, -(-vocab // MAX_CHUNKS))
    chunk = -(-chunk // block) * block
    return block, chunk, -(-vocab // chunk)


def grouping(rows: int, chunks: int) -> int:
    """Chunks one program walks, for a launch of ``rows`` rows of ``chunks`` chunks: enough
    that the launch has about PROGRAMS programs (one chunk each at small batches). A
    program reads the row's partial results once for all of its chunks, and the result does
    not depend on the grouping (each chunk's partials are written apart)."""
    return min(chunks, max(1, -(-rows * chunks // PROGRAMS)))


def _check_logits(logits) -> tuple[int, int]:
    """(rows, vocabulary) of logits [S, V], checked."""
    check_tensor("logits", logits, dim=2)
    check_runnable(logits.device)
    s, v = logits.shape
    if v < 1:
        raise ValueError("logits must have at least one column")
    if v >= 2 ** 31:
        raise ValueError(f"logits has {v} columns; at most 2**31 - 1 fit the kernel's int32 indices")
    return s, v


def _ids_out(out, s: int, device) -> torch.Tensor:
    """The [s] int64 ids tensor to write: ``out`` checked, or a new one."""
    if out is None:
        return torch.empty(s, dtype=torch.int64, device=device)
    check_tensor("out", out, dim=1, dtypes=(torch.int64,), device=device)
    if out.shape[0] != s:
        raise ValueError(f"out must have {s} entries, got {out.shape[0]}")
    return out


def _group(group, rows: int, chunks: int) -> int:
    """Chunks a program walks: ``group`` checked (at most ``chunks``), or ``grouping``'s."""
    if group is None:
        return grouping(rows, chunks)
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be an int >= 1, got {group!r}")
    return min(group, chunks)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor, *, out: torch.Tensor | None = None,
           lowest: torch.Tensor | None = None, group: int | None = None) -> torch.Tensor:
    """Each row's next token id, drawn from ``logits`` [S, V] with that row's settings.

    temperature [S] float32: 0 = greedy (the first maximum), else the softmax's temperature.
    top_k [S] int32: keep the k largest logits (ties at the k-th all kept); 0 = off.
    top_p [S] float32 in (0, 1]: then keep the smallest top set holding p of the mass.
    min_p [S] float32 in [0, 1): then keep tokens of probability >= min_p * the largest.
    seed [S] int64, counter [S] int64 or int32 (a sequence's length, say): the draw's key
    (the same pair draws the same token).
    out [S] int64 (given: written in place). lowest [S] float32 (given: receives the
    smallest logit kept, what the tests compare the kept set by). group: chunks a program
    walks (default ``grouping``; any value gives the same result).

    The settings are not checked here (they are device tensors; ``SamplingParams`` checks
    them on the host before they are staged): a temperature below 0 acts as 0, top_p >= 1
    and top_k outside (0, V) as off. NaN logits count as -inf; a row of only -inf gives 0.
    """
    s, _ = _check_logits(logits)
    _check_settings(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                    counter=counter)
    out = _ids_out(out, s, logits.device)
    if lowest is not None:
        _check_lowest(lowest, logits)
    return _passes(logits, temperature, top_k, top_p, min_p, seed, counter, out, lowest, group)


def kept_lowest(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, *, out: torch.Tensor | None = None, group: int | None = None) -> torch.Tensor:
    """[S] float32: the smallest logit ``sample`` keeps in each row with these settings (its
    ``lowest``), without drawing a token: the same passes less the uniforms, for a caller that
    needs the kept distribution only (``kept_probs``; a speculative verify's rejection
    sampling). ``out`` [S] float32 (given: written in place); the rest as ``sample``."""
    s, _ = _check_logits(logits)
    _check_settings(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    if out is None:
        out = torch.empty(s, dtype=torch.float32, device=logits.device)
    else:
        _check_lowest(out, logits, name="out")
    _passes(logits, temperature, top_k, top_p, min_p, None, None, None, out, group)
    return out


def _check_settings(logits: torch.Tensor, **tensors: torch.Tensor) -> None:
    s = logits.shape[0]
    dtypes = dict(temperature=(torch.float32,), top_k=(torch.int32,), top_p=(torch.float32,),
                  min_p=(torch.float32,), seed=(torch.int64,), counter=(torch.int64, torch.int32))
    for name, t in tensors.items():
        check_tensor(name, t, dim=1, dtypes=dtypes[name], device=logits.device)
        if t.shape[0] != s:
            raise ValueError(f"{name} must have one entry per row of logits ({s}), got {t.shape[0]}")


def _check_lowest(lowest: torch.Tensor, logits: torch.Tensor, *, name: str = "lowest") -> None:
    check_tensor(name, lowest, dim=1, dtypes=(torch.float32,), device=logits.device)
    if lowest.shape[0] != logits.shape[0]:
        raise ValueError(f"{name} must have {logits.shape[0]} entries, got {lowest.shape[0]}")


def _passes(logits, temperature, top_k, top_p, min_p, seed, counter, out, lowest, group, *,
            radix: tuple[int, int] | None = None, candidates: int = CANDIDATES) -> torch.Tensor | None:
    """``sample``'s launches on checked arguments; without ``out`` (and seed, counter) no
    draw: ``lowest`` alone is written. ``radix``: (logits a tile, warps) of the radix
    levels (default: the other passes' tile, 4 warps; a tile smaller than theirs divides
    the chunk; benchmarks/probes/probe_sampling.py times them). ``candidates``: the short
    path's list a row (a power of two; a row with more candidates takes the radix passes,
    which the tests force with a small list)."""
    s, v = logits.shape
    draw = out is not None
    if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 2 \
            or candidates & (candidates - 1):
        raise ValueError(f"candidates must be a power of two >= 2, got {candidates!r}")
    block, chunk, c = chunking(v)
    radix_block, radix_warps = (block, 4) if radix is None else (min(radix[0], block), radix[1])
    group = _group(group, s, c)
    if s == 0:
        return out
    cp = max(2, triton.next_power_of_2(c))
    dev = logits.device
    f32, i32, i64 = torch.float32, torch.int32, torch.int64
    # per row and chunk: the maximum and where; the top-k set's mass; the best score, where, the lowest kept
    pmax, pidx = torch.empty(s, c, dtype=f32, device=dev), torch.empty(s, c, dtype=i32, device=dev)
    zpart, bestv = torch.empty(s, c, dtype=f32, device=dev), torch.empty(s, c, dtype=f32, device=dev)
    besti, lowc = torch.empty(s, c, dtype=i32, device=dev), torch.empty(s, c, dtype=f32, device=dev)
    # the two selects: per level, row and chunk a histogram of 16 digits; per level and row the state before it
    hk, hp = torch.empty(8, s, c, 16, dtype=i32, device=dev), torch.empty(8, s, c, 16, dtype=f32, device=dev)
    kkey, pkey = torch.empty(8, s, dtype=i64, device=dev), torch.empty(8, s, dtype=i64, device=dev)
    kneed, pneed = torch.empty(8, s, dtype=i32, device=dev), torch.empty(8, s, dtype=f32, device=dev)
    kthr = torch.empty(s, dtype=i64, device=dev)
    # the short path: per row its candidates' count and list, whether it served the row, and its threshold
    count, fast = torch.empty(s, dtype=i32, device=dev), torch.empty(s, dtype=i32, device=dev)
    cand, fthr = torch.empty(s, candidates, dtype=f32, device=dev), torch.empty(s, dtype=i64, device=dev)
    grid = (s, -(-c // group))
    rows = (logits, logits.stride(0), v, chunk, c, group)
    _max_kernel[grid](*rows, pmax, pidx, count, COUNT=True, BLOCK=block, num_warps=4)
    _collect_kernel[grid](*rows, temperature, top_k, pmax, pidx, count, cand, CAP=candidates, CP=cp, BLOCK=block,
                          num_warps=4)
    _select_kernel[(s,)](temperature, top_k, top_p, pmax, pidx, count, cand, fast, fthr, v, c, CAP=candidates,
                         CP=cp, num_warps=4)
    top_k_on = top_p_on = True      # on a GPU every pass is launched (a captured graph serves any settings) and
    if not logits.is_cuda:          # rows skip what they do not need; on the CPU (the interpreter, where each
        live = (temperature > 0) & (fast == 0)       # program costs milliseconds) the settings are read: passes
        top_k_on = bool((live & (top_k > 0) & (top_k < v)).any())     # no row needs are not run
        top_p_on = bool((live & (top_p < 1)).any())
    for level in range(8 if top_k_on else 0):
        _radix_kernel[grid](*rows, s, temperature, top_k, top_p, pmax, pidx, fast, hk, kkey, kneed, kthr, zpart,
                            level, WEIGHTED=False, CP=cp, BLOCK=radix_block, num_warps=radix_warps)
    _mass_kernel[grid](*rows, s, temperature, top_k, top_p, pmax, pidx, fast, hk, kkey, kneed, kthr, zpart, CP=cp,
                       BLOCK=block, num_warps=4)
    for level in range(8 if top_p_on else 0):
        _radix_kernel[grid](*rows, s, temperature, top_k, top_p, pmax, pidx, fast, hp, pkey, pneed, kthr, zpart,
                            level, WEIGHTED=True, CP=cp, BLOCK=radix_block, num_warps=radix_warps)
    _draw_kernel[grid](*rows, s, temperature, top_k, top_p, min_p, seed if draw else temperature,
                       counter if draw else temperature, pmax, pidx, fast, fthr, kthr, hp, pkey, pneed, bestv, besti,
                       lowc, DRAW=draw, CP=cp, BLOCK=block, num_warps=4)
    _pick_kernel[(s,)](temperature, pmax, pidx, bestv, besti, lowc, out if draw else pidx,
                       lowest if lowest is not None else pmax, c, DRAW=draw, HAS_LOWEST=lowest is not None, CP=cp,
                       num_warps=4)
    return out


@triton.jit
def _first_max_kernel(pmax_ptr, pidx_ptr, out_ptr, C, CP: tl.constexpr):
    """Each row's first maximum from its chunks' (``_max_kernel``)."""
    row = tl.program_id(0)
    _, i_m = _row_max(pmax_ptr, pidx_ptr, row, C, CP)
    tl.store(out_ptr + row, i_m.to(tl.int64))


def greedy(logits: torch.Tensor, *, out: torch.Tensor | None = None, group: int | None = None) -> torch.Tensor:
    """Each row's first maximum: [S] int64 from ``logits`` [S, V] (fp16, bf16 or fp32; rows
    may have any stride, the vocabulary must be contiguous). ``sample``'s greedy answer in two launches
    instead of its twenty: the row's chunks are read side by side (one program each at
    small batches, as ``sample`` cuts them), then one program a row picks among them.
    ``torch.argmax`` reads a row with one block of threads, which on a vocabulary of 128k
    is tens of microseconds at batch 1.

    NaN logits count as -inf (``torch.argmax`` takes a NaN as the maximum); a row with
    nothing finite above -inf gives 0. out [S] int64 (given: written in place); group as
    in ``sample`` (any value gives the same result)."""
    s, v = _check_logits(logits)
    out = _ids_out(out, s, logits.device)
    block, chunk, c = chunking(v)
    group = _group(group, s, c)
    if s == 0:
        return out
    pmax = torch.empty(s, c, dtype=torch.float32, device=logits.device)
    pidx = torch.empty(s, c, dtype=torch.int32, device=logits.device)
    _max_kernel[(s, -(-c // group))](logits, logits.stride(0), v, chunk, c, group, pmax, pidx, pidx, COUNT=False,
                                      BLOCK=block, num_warps=4)
    _first_max_kernel[(s,)](pmax, pidx, out, c, CP=max(2, triton.next_power_of_2(c)), num_warps=4)
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
