"""Float64 ground truth in plain PyTorch: a dense mask built from the rule, one sequence
at a time. Slow and simple on purpose; use it to check a set-up, never in a step.

    visible(q, k) = k < seq_len and
        no window:         k <= q or same_range(q, k)
        clip:              (k <= q or same_range(q, k)) and q - k < window
        two_sided:         (k <= q or same_range(q, k)) and |q - k| < window
        ranges_unclipped:  (k <= q and q - k < window) or same_range(q, k)
    where same_range(q, k) holds when one prefix range [start, end) of the sequence
    contains both positions (never, with ``ranges=False``).

An fp8 (e4m3) cache holds K / k_scale[h] and V / v_scale[h] per KV head h, saturated to
+-448 and rounded to nearest even; attention reads K = cache * k_scale[h] (likewise V).
"""

from __future__ import annotations

import math

import torch

from .metadata import AttentionMetadata

_ALIASES = {"gemma3": "clip", "gemma4": "clip"}
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[..., Hkv, D] float values as e4m3 codes of x / scale[h] (saturated)."""
    return (x.float() / scale.float().to(x.device)[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """float64 values of a cache slice [..., Hkv, D]: codes * scale[h] for fp8, as is otherwise."""
    if codes.dtype != FP8:
        return codes.double()
    return codes.double() * scale.double().to(codes.device)[:, None]


def attention_mask(seq_len: int, q_len: int, prefix_ranges, *, window: int | None = None,
                   window_rule: str = "clip", ranges: bool = True) -> torch.Tensor:
    """Dense [q_len, seq_len] bool mask for the last q_len positions of a sequence.
    ``prefix_ranges``: iterable of half-open (start, end); empty ones are ignored."""
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    causal = k_pos <= q_pos
    same_range = torch.zeros(q_len, seq_len, dtype=torch.bool)
    for start, end in prefix_ranges if ranges else ():
        if end > start:
            same_range |= (q_pos >= start) & (q_pos < end) & (k_pos >= start) & (k_pos < end)
    if window is None:
        return causal | same_range
    window = min(window, seq_len + 1)      # the same mask (|q - k| <= seq_len), and no int64 overflow
    in_window = (q_pos - k_pos) < window
    rule = _ALIASES.get(window_rule, window_rule)
    if rule == "clip":
        return (causal | same_range) & in_window
    if rule == "two_sided":
        return (causal | same_range) & in_window & ((k_pos - q_pos) < window)
    if rule == "ranges_unclipped":
        return (causal & in_window) | same_range
    raise ValueError(f"window_rule must be 'clip', 'two_sided' or 'ranges_unclipped', got {window_rule!r}")


def gather_kv(cache: torch.Tensor, block_ids, seq_len: int) -> torch.Tensor:
    """[seq_len, Hkv, D] rows of one sequence from a [num_blocks, block_size, Hkv, D] cache."""
    block_size = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    blocks = torch.as_tensor(block_ids, dtype=torch.long, device=cache.device)[pos // block_size]
    return cache[blocks, pos % block_size]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    *, scale: float | None = None, window: int | None = None, window_rule: str = "clip",
                    ranges: bool = True, softcap: float | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 [num_tokens, Hq, D] CPU output of the step's tokens (rows past the step's token
    count are not returned). Same arguments and semantics as ``graphrt.kernels.paged_attention``."""
    dev = k_cache.device             # computed where the cache lives: a cache can be GBs
    qsl = meta.query_start_loc.cpu().long()
    seq_lens = meta.seq_lens.cpu().long()
    block_table = meta.block_table.to(dev).long()
    prefix_ranges = meta.prefix_ranges.cpu().long()
    q64 = q.detach().to(dev, torch.float64)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    qpk = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(int(qsl[-1]), num_q_heads, head_dim, dtype=torch.float64, device=dev)
    for i in range(seq_lens.shape[0]):
        q0, q1, seq_len = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
        if q1 == q0:
            continue
        mask = attention_mask(seq_len, q1 - q0, prefix_ranges[i].tolist(), window=window, window_rule=window_rule,
                              ranges=ranges).to(dev)
        k = dequantize(gather_kv(k_cache.detach(), block_table[i], seq_len), k_scale)     # [L, Hkv, D]
        v = dequantize(gather_kv(v_cache.detach(), block_table[i], seq_len), v_scale)
        # Query head h reads KV head h // qpk: view the query heads as [Hkv, qpk].
        qg = q64[q0:q1].reshape(q1 - q0, num_kv_heads, qpk, head_dim)
        s = torch.einsum("qgpd,kgd->gpqk", qg, k).reshape(num_q_heads, q1 - q0, seq_len) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~mask, float("-inf"))
        p = torch.softmax(s, dim=-1).reshape(num_kv_heads, qpk, q1 - q0, seq_len)
        out[q0:q1] = torch.einsum("gpqk,kgd->qgpd", p, v).reshape(q1 - q0, num_q_heads, head_dim)
    return out.cpu()


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """In-place cache write with the same contract as ``graphrt.kernels.write_kv``."""
    block_size = k_cache.shape[1]
    slots = slot_mapping[: k.shape[0]].to(k_cache.device).long()
    keep = (slots >= 0) & (slots < k_cache.shape[0] * block_size)     # outside the cache: skipped
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    if k_cache.dtype == FP8:
        k_cache[blocks, offsets] = quantize(k[keep].to(k_cache.device), k_scale)
        v_cache[blocks, offsets] = quantize(v[keep].to(v_cache.device), v_scale)
    else:
        k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
        v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


def sampling_keep(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float):
    """One row's kept tokens and their probabilities in float64, by sorting: the top k
    logits (ties at the k-th all kept; 0 or >= V: all), then the smallest top set of those
    whose softmax mass at ``temperature`` reaches ``top_p`` (ties kept), then the tokens of
    probability >= ``min_p`` times the largest. Returns (keep [V] bool, probs [V] float64,
    0 outside keep); greedy (temperature 0) keeps the first maximum alone."""
    x = logits.double().nan_to_num(nan=-math.inf, neginf=-math.inf)
    v = x.shape[0]
    keep = torch.zeros(v, dtype=torch.bool)
    m = x.max()
    if temperature <= 0 or m == -math.inf:
        keep[int(torch.argmax(x))] = True          # torch.argmax: the first maximum
        return keep, keep.double()
    keep = x > -math.inf
    values = x.sort(descending=True).values
    if 0 < top_k < v:
        keep &= x >= values[top_k - 1]
    w = torch.where(keep, torch.exp((x - m) / temperature), 0.0)
    if top_p < 1:
        kept = torch.where(keep, x, -math.inf).sort(descending=True).values
        mass = torch.cumsum(torch.exp((kept - m) / temperature), 0)
        # the first sorted position whose top set reaches p of the mass, ties with it included
        at = int(torch.nonzero(mass >= top_p * w.sum())[0]) if bool((mass >= top_p * w.sum()).any()) else v - 1
        keep &= x >= kept[at]
    keep &= torch.exp((x - m) / temperature) >= min_p
    w = torch.where(keep, torch.exp((x - m) / temperature), 0.0)
    return keep, w / w.sum()


def sample(logits: torch.Tensor, temperature, top_k, top_p, min_p, seed, counter) -> torch.Tensor:
    """[S] int64: each row's draw, Gumbel-max over ``sampling_keep``'s set in float64 with
    the kernel's Philox uniforms (``graphrt.kernels.sampling.philox_uniform``), so that a
    kernel's draw can be compared token for token."""
    import numpy as np

    from .sampling import philox_uniform

    out = torch.empty(logits.shape[0], dtype=torch.int64)
    for i, row in enumerate(logits.cpu()):
        keep, _ = sampling_keep(row, float(temperature[i]), int(top_k[i]), float(top_p[i]), float(min_p[i]))
        x = row.double().nan_to_num(nan=-math.inf, neginf=-math.inf)
        if float(temperature[i]) <= 0 or int(keep.sum()) == 1:
            out[i] = int(torch.nonzero(keep)[0])
            continue
        u = torch.from_numpy(philox_uniform(int(seed[i]), int(counter[i]), np.arange(row.shape[0]))).double()
        g = (x - x.max()) / float(temperature[i]) - torch.log(-torch.log(u))
        out[i] = int(torch.argmax(torch.where(keep, g, -math.inf)))
    return out
