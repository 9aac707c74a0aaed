"""Paged attention for a mixed batch (prefill chunks + decodes) in one launch.

Masks (DESIGN.md): causal, plus bidirectional attention among the tokens of one prefix
range (``ranges=False`` turns that off per call); optional logit soft-cap; GQA/MQA; an
optional sliding window, which combines with the ranges by one of three rules:

    clip              (causal | same_range) & (q - k < window)     the window clips ranges
    two_sided         (causal | same_range) & (|q - k| < window)   ... from both sides
    ranges_unclipped  (causal & (q - k < window)) | same_range     ranges reach past it

Model names are aliases for the rule their reference code uses (docs/masks.md has the table).

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
writes a partial output and its log-sum-exp. The split of a tile that finishes last (a
counter per tile in the workspace, which that split resets) merges them into ``out`` in
the same launch (for at most FUSED_MERGE_MAX_SPLITS splits unless
``KernelConfig.fuse_merge`` says otherwise); or a second launch, ``_merge_kernel``, does.
The split count is fixed at launch, the split lengths follow each step's contexts on the
device. The count is not a compile-time constant of the attention kernel, so the decode
buckets' split factors (1 to 64) share two variants of it (split or not), which keeps
capture's compiles down.

KV write in the launch (``new_kv``): in decode launches (and for the decodes of a mixed
launch, on the short path) each program first writes the new tokens' K/V that its key
tiles hold into the caches (at ``slot_mapping``, as ``write_kv`` does), then reads them
back with its other keys after a barrier of its threads; programs whose key tiles overlap
write the same bytes to the same slots. Other query tiles read a sequence's keys below its
context length from the cache and its new keys from k/v directly, through tensor
descriptors (one bulk copy per key tile, in tiles counted from the context length), and
split 0 of each writes its own tokens' K/V into the caches. A layer's attention is then
one launch (two with a merge launch) instead of a write and an attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from ._attention_jit import (RULE_CLIP, RULE_RANGES_UNCLIPPED, RULE_TWO_SIDED, _PER_BUCKET,  # noqa: F401
                             _attend_key_tile, _attend_span, _attend_tile, _attn_kernel, _merge_kernel)
from ._checks import (CACHE_DTYPES, MAX_HEAD_DIM, check_cache_dtypes, check_head_dim, check_kv_scales,
                      check_runnable, check_same_dtype, check_shape, check_tensor, pdl_supported)
from .kv_write import write_kv
from .metadata import AttentionMetadata

# How a sliding window and prefix ranges combine (see the module doc). The names say what
# the rule does; model names are aliases for the rule that model's reference code uses.
WINDOW_RULES = ("clip", "two_sided", "ranges_unclipped")
WINDOW_RULE_ALIASES = {"gemma3": "clip", "gemma4": "clip"}
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
    # Launch the kernels as programmatic dependents of the kernel before them (PDL, sm_90
    # and up): a launch is set up while the previous one finishes and waits on the device
    # (``griddepcontrol.wait``) before its first load. None: as the environment's
    # GRAPHRT_PDL says (off unless "1"). Ignored where unsupported. Off by default: on the
    # H200 it saved 0.3 us of a 10 us decode launch among launches of its own and cost
    # 1-1.5 us of a layer-like graph (benchmarks/probes/sweep_decode.py).
    pdl: bool | None = None
    # Split-KV launches: True, the tile's last split to finish merges the partials in the
    # same launch (a counter per tile in the workspace: ``split_workspace`` makes them);
    # False, a second launch (``_merge_kernel``) does. None: fused for at most
    # FUSED_MERGE_MAX_SPLITS splits when the workspace has the counters (H200: in place it
    # saved 1-5 us at batch 8, 4 splits; at batch 1 with 32 splits it cost 7 us more than
    # the second launch, the SMs idle while one program per KV head merged: NOTES.md).
    fuse_merge: bool | None = None
    # A cap on registers per thread (Triton's ``maxnreg``; None: the compiler's choice).
    # Fewer registers let more programs share an SM, at the risk of spills
    # (``benchmarks/probes/sass_stats.py --maxnreg`` shows them).
    maxnreg: int | None = None


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
# KernelConfig.maxnreg: from a cap the compiler meets by spilling to the hardware's 255
# registers per thread.
MAXNREG_RANGE = (64, 255)
# KernelConfig.fuse_merge=None fuses the merge up to this many splits.
FUSED_MERGE_MAX_SPLITS = 4
# The fused merge loads this many rows of partial output at once (tile rows x splits).
_MERGE_ROWS = 64

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


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device | str, *,
                  max_key_tiles: int | None = None) -> int:
    """Split-KV factor for a decode launch of ``num_seqs`` sequences, fixed before capture:
    about two programs per SM (sequences x KV heads x splits), rounded down to a power of
    two, at most 64, and (given ``max_key_tiles``, the key tiles of the longest context the
    launch can see) no more than a sequence's key tiles, since a split holds whole tiles and
    the splits past them idle while the merge reads their empty partials (four splits or
    fewer merge inside the launch: ``FUSED_MERGE_MAX_SPLITS``). The split lengths then follow
    each step's contexts on the device. 1 off CUDA. (The power of two once bounded the
    kernel variants; the split count is now a launch dimension, so any factor is free:
    ``benchmarks/probes/sweep_splits.py`` measures them.)"""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    return split_factor(torch.cuda.get_device_properties(device).multi_processor_count, num_seqs, num_kv_heads,
                        max_key_tiles)


def split_factor(sms: int, num_seqs: int, num_kv_heads: int, max_key_tiles: int | None = None) -> int:
    """``decode_splits`` on a GPU of ``sms`` SMs."""
    want = max(1, min(MAX_SPLITS, (2 * sms) // (num_seqs * num_kv_heads)))
    if max_key_tiles is not None:
        want = max(1, min(want, max_key_tiles))
    return 1 << (want.bit_length() - 1)


def key_tile(head_dim: int, dtype: torch.dtype, queries_per_kv: int, *, max_query_len: int | None = None,
             num_tokens: int | None = None) -> int:
    """The fewest keys a tile of the default config's launch holds (``default_config``'s
    ``block_n``, or its ``short_block_n`` for short queries when smaller): what
    ``decode_splits``' ``max_key_tiles`` counts in."""
    cfg = default_config(head_dim, dtype, queries_per_kv, max_query_len=max_query_len, num_tokens=num_tokens)
    return min(cfg.block_n, cfg.short_block_n or cfg.block_n)


def split_workspace(num_tokens: int, num_q_heads: int, head_dim: int, num_splits: int,
                    device: torch.device | str, *, max_num_seqs: int | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Partial outputs [T, Hq, splits, D] and log-sum-exps [T, Hq, splits], float32, and
    the fused merge's tile counters: int32 zeros, one per (query tile, KV head) of any
    launch of T token slots and at most ``max_num_seqs`` (default T) sequences. The
    counters must be zero before a launch; each launch leaves them so."""
    part_o = torch.empty(num_tokens, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    part_lse = torch.empty(num_tokens, num_q_heads, num_splits, dtype=torch.float32, device=device)
    seqs = num_tokens if max_num_seqs is None else max_num_seqs
    counters = torch.zeros((num_tokens + seqs) * num_q_heads, dtype=torch.int32, device=device)
    return part_o, part_lse, counters


def _offsets_fit_32(cache: torch.Tensor) -> bool:
    """Whether every element's offset in ``cache`` (from its first element, by its strides)
    fits in a signed 32-bit int, with room for a head dim padded to a power of two: the
    attention kernel's KV_OFF32."""
    return sum((n - 1) * st for n, st in zip(cache.shape, cache.stride())) + MAX_HEAD_DIM < 2 ** 31


def _bulk_loadable(k: torch.Tensor, v: torch.Tensor, block_n: int, head_dim_pad: int) -> bool:
    """Whether the attention kernel can read k and v ([T, Hkv, D]) as rows [T, Hkv * D]
    through tensor descriptors (bulk copies, sm_90 and up; Triton's interpreter emulates
    them): heads adjacent, 16-byte aligned rows, start and heads (a copy starts at column
    h * D), at least one row (a descriptor has no empty dims)."""
    if k.shape[0] == 0 or (k.shape[1] > 1 and (k.shape[2] * k.element_size()) % 16 != 0):
        return False
    if k.device.type == "cuda" and torch.cuda.get_device_capability(k.device)[0] < 9:
        return False
    size = k.element_size()
    return all(t.stride(2) == 1 and t.stride(1) == t.shape[2] and (t.stride(0) * size) % 16 == 0
               and t.data_ptr() % 16 == 0 for t in (k, v)) and head_dim_pad * size >= 16 and block_n <= 256


def _rows_descriptor(t: torch.Tensor, block_n: int, head_dim_pad: int):
    """A descriptor of t [T, Hkv, D] as rows [T, Hkv * D] in blocks [block_n, head_dim_pad]
    (columns past a head's D belong to the next head, or read as zeros past the last)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, [t.shape[0], t.shape[1] * t.shape[2]], [t.stride(0), 1], [block_n, head_dim_pad])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ([T, H, D]) with its rotary embedding over the first R columns of each head (cos,
    sin: [T, R]; ``paged_attention``'s ``rope``), as a new tensor: in fp32, rounded once to
    x's dtype, as the decode launch computes it."""
    half = cos.shape[1] // 2
    xf = x.float()
    rot = xf[..., : 2 * half]
    turned = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    rot = rot * cos.float()[:, None, :] + turned * sin.float()[:, None, :]
    return torch.cat((rot, xf[..., 2 * half:]), dim=-1).to(x.dtype)


def _checked_rope(rope: object, new_kv: object, q: torch.Tensor, num_tokens: int, head_dim: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope`` checked (paged_attention's doc), as two tensors with one row stride and
    contiguous rows."""
    if new_kv is None:
        raise ValueError("rope needs new_kv: the call rotates the new k it writes (and q)")
    if not isinstance(rope, (tuple, list)) or len(rope) != 2:
        raise TypeError(f"rope must be a pair (cos, sin) of [T, R] tensors, got {type(rope).__name__}")
    for name, t in zip(("rope[0] (cos)", "rope[1] (sin)"), rope):
        check_tensor(name, t, dim=2, dtypes=(q.dtype, torch.float32) if q.dtype != torch.float32 else (q.dtype,),
                     device=device, last_contiguous=False)
    cos, sin = rope
    check_shape("rope[1] (sin)", sin, tuple(cos.shape))
    rows, dim = cos.shape
    if rows != num_tokens:
        raise ValueError(f"rope tables have {rows} rows, q has {num_tokens}: one row per token slot")
    if dim < 2 or dim % 2 or dim > head_dim:
        raise ValueError(f"rope tables' width (the rotated columns) must be even, in [2, head_dim={head_dim}], "
                         f"got {dim}")
    if cos.stride(1) != 1 or sin.stride(1) != 1 or cos.stride(0) != sin.stride(0):
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    meta: AttentionMetadata, *, scale: float | None = None, window: int | None = None,
                    window_rule: str = "clip", ranges: bool = True, softcap: float | None = None, num_splits: int = 1,
                    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                    max_query_len: int | None = None, config: KernelConfig | None = None,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                    rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
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
             here when None (pass them when capturing, so the graph owns fixed buffers);
             (part_o, part_lse) without counters: the merge is a second launch.
    max_query_len: a capacity hint (1 for decode-only launches) that picks the tile shape.
    new_kv:  (k, v), the step's new K and V ([T, Hkv, D], q's dtype): the launch writes
             them into the caches itself, at ``meta.slot_mapping`` as ``write_kv`` would
             (quantized alike for fp8), so that a layer needs no separate write. It writes
             the tokens of the metadata's sequences (every token of a Step); a row outside
             them is left to ``write_kv``. Other than decode launches (``max_query_len=1``)
             also read the new keys from k and v, in bulk copies (tensor descriptors,
             sm_90 and up) where k and v allow them (heads adjacent, 16-byte aligned rows);
             elsewhere a ``write_kv`` runs first and the launch reads the caches.
    rope:    (cos, sin), each [T, R] (R even, at most D; q's dtype or float32), with
             ``new_kv``: q and the new k are given before their rotary embedding, which the
             call applies to the first R columns of each head (``rotate_half`` form:
             ``x * cos + rotate_half(x) * sin``, cos and sin the token's rows, in fp32 and
             rounded once to q's dtype; the columns past R pass through). Decode launches
             rotate as they load q and k; others rotate first (``apply_rope``).
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
    if new_kv is not None:
        if not isinstance(new_kv, (tuple, list)) or len(new_kv) != 2:
            raise TypeError(f"new_kv must be a pair (k, v) of [T, Hkv, D] tensors, got {type(new_kv).__name__}")
        for i, t in enumerate(new_kv):
            check_tensor(f"new_kv[{i}]", t, dim=3, dtypes=(q.dtype,), device=device)
            check_shape(f"new_kv[{i}]", t, (num_tokens, num_kv_heads, head_dim))
        check_tensor("meta.slot_mapping", meta.slot_mapping, dim=1, dtypes=(torch.int64,), device=device)
    if rope is not None:
        rope = _checked_rope(rope, new_kv, q, num_tokens, head_dim, device)
    qpk = num_q_heads // num_kv_heads
    cfg = config or default_config(head_dim, q.dtype, qpk, max_query_len=max_query_len, num_tokens=num_tokens)
    qpk_pad = triton.next_power_of_2(qpk)
    if cfg.maxnreg is not None and (isinstance(cfg.maxnreg, bool) or not isinstance(cfg.maxnreg, int)
                                    or not MAXNREG_RANGE[0] <= cfg.maxnreg <= MAXNREG_RANGE[1]):
        raise ValueError(f"config.maxnreg must be None or an int in [{MAXNREG_RANGE[0]}, {MAXNREG_RANGE[1]}], "
                         f"got {cfg.maxnreg!r}")
    if cfg.block_q * qpk_pad < 16:
        raise ValueError(f"config.block_q={cfg.block_q} gives {cfg.block_q * qpk_pad} tile rows, need >= 16")

    short_q = max(1, 16 // qpk_pad)
    short_block_n = cfg.short_block_n if cfg.short_block_n and short_q < cfg.block_q else 0

    max_num_seqs = meta.max_num_seqs
    num_tiles = num_tokens // cfg.block_q + max_num_seqs
    fuse_merge = merge_now = False
    counters = out                    # unused by the kernel without FUSE_MERGE
    if num_splits > 1:
        if workspace is None:
            workspace = split_workspace(num_tokens, num_q_heads, head_dim, num_splits, device,
                                        max_num_seqs=max_num_seqs)
        if not isinstance(workspace, (tuple, list)) or len(workspace) not in (2, 3):
            raise TypeError("workspace must be the tuple split_workspace(...) returns (part_o, part_lse, counters)")
        part_o, part_lse = workspace[:2]
        # fuse_merge: the kernel variant can merge in place (any split launch with counters
        # unless the config says no, so that every split factor shares it); merge_now: this
        # launch does (the config's choice, or up to FUSED_MERGE_MAX_SPLITS splits)
        if cfg.fuse_merge is None:
            fuse_merge = len(workspace) == 3
            merge_now = fuse_merge and num_splits <= FUSED_MERGE_MAX_SPLITS
        else:
            fuse_merge = merge_now = bool(cfg.fuse_merge)
        if fuse_merge:
            if len(workspace) != 3:
                raise ValueError("workspace has no counters for the fused merge (config.fuse_merge=True): pass all "
                                 "of split_workspace(...)")
            counters = workspace[2]
            check_tensor("workspace[2]", counters, dim=1, dtypes=(torch.int32,), device=device)
            if counters.numel() < num_tiles * num_kv_heads or counters.stride(0) != 1:
                raise ValueError(f"workspace[2] (counters) must be contiguous with >= {num_tiles * num_kv_heads} "
                                 f"elements ((tokens // block_q + max_num_seqs) x KV heads), got "
                                 f"{counters.numel()}")
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
    pdl = pdl_supported(device, cfg.pdl)
    off32 = _offsets_fit_32(k_cache) and _offsets_fit_32(v_cache)
    k_new, v_new = new_kv if new_kv is not None else (out, out)     # (unused without WRITE_KV or READ_NEW)
    decode = max_query_len == 1
    rope_dim, (cos, sin) = 0, (out, out)                              # (unused without ROPE_DIM)
    if rope is not None and decode:
        rope_dim, (cos, sin) = rope[0].shape[1], rope
    elif rope is not None:          # a launch that reads k from k_new as it is: rotated first
        q, k_new = apply_rope(q, *rope), apply_rope(k_new, *rope)
        new_kv = (k_new, v_new)
    k_desc = v_desc = out                                             # (unused without READ_NEW)
    read_new = new_kv is not None and not decode
    if read_new:
        if _bulk_loadable(k_new, v_new, cfg.block_n, head_dim_pad):
            k_desc, v_desc = (_rows_descriptor(t, cfg.block_n, head_dim_pad) for t in new_kv)
        else:            # no bulk copies here: the write first, then attention over the caches
            write_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
            read_new = False
            k_new, v_new = out, out
    _attn_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_o, part_lse,
        meta.query_start_loc, meta.seq_lens, meta.block_table, meta.prefix_ranges,
        k_scale if fp8 else out, v_scale if fp8 else out, counters, k_new, v_new, meta.slot_mapping, k_desc, v_desc,
        cos, sin, cos.stride(0) if rope_dim else 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        meta.block_table.stride(0), meta.block_table.stride(1),
        part_o.stride(0), part_o.stride(1), part_o.stride(2) if num_splits > 1 else 0,
        part_lse.stride(0), part_lse.stride(1),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        float(scale) * 1.4426950408889634, float(softcap or 1.0), min(window or 0, MAX_WINDOW),
        max_num_seqs, num_tokens, num_blocks, meta.block_table.shape[1], int(merge_now),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, KV_BLOCK_SIZE=block_size,
        QPK=qpk, QPK_PAD=qpk_pad, BLOCK_Q=cfg.block_q, BLOCK_N=cfg.block_n,
        SHORT_Q=short_q if short_block_n else 0, SHORT_BLOCK_N=short_block_n,
        MAX_RANGES=meta.max_prefix_ranges,
        USE_WINDOW=window is not None, WINDOW_RULE=rule, USE_RANGES=ranges and meta.max_prefix_ranges > 0,
        USE_SOFTCAP=softcap is not None,
        # bf16 dots are wrong under the interpreter: there they run in fp32 too
        SPLIT=num_splits > 1, IEEE_DOT=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and device.type == "cpu"),
        KV_FP8=fp8, KV_OFF32=off32, FUSE_MERGE=fuse_merge, MERGE_ROWS=_MERGE_ROWS, DECODE_MAP=decode,
        WRITE_KV=new_kv is not None and decode, ROUND_E4M3=new_kv is not None and fp8 and device.type == "cpu",
        READ_NEW=read_new, PDL=pdl, ROPE_DIM=rope_dim,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg, launch_pdl=pdl,
    )
    if num_splits > 1 and not merge_now:
        _merge_kernel[(num_tokens, num_q_heads)](
            out, part_o, part_lse, meta.query_start_loc,
            out.stride(0), out.stride(1),
            part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            max_num_seqs,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), PDL=pdl,
            num_warps=4, launch_pdl=pdl,
        )
    return out
