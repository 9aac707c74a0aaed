"""Speculative decoding on the device: where a step's tokens sit when only the device knows
how many drafts the last verify accepted, and the greedy acceptance rule. The design
(buffers, owners, what the host reads when) is docs/speculative.md.

``place_tokens`` rewrites a staged step's per-token metadata from a device-owned length
per request: sequence i (of request ``request[i]``) puts its q_i tokens at positions
``length[request[i]] + offset[i] + j``; its ``seq_lens`` entry becomes the last of those
positions + 1, each token's ``positions`` entry its position, and its ``slot_mapping``
entry the cache slot of that position in the sequence's block table. The host stages the
step with room for the longest case (every draft accepted), so the block table already
holds every block a position can reach; a position past the table, or a request index
outside ``length``, gets slot -1 (no write) and a length of 0 (nothing read), never an
access outside the tensors. Padding sequences (query length 0) are left as staged.

``accept_greedy``: the longest prefix of the drafts that equals the target's argmax at
each position, and the token to feed next (the target's argmax after that prefix).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_runnable, check_tensor


@triton.jit
def _place_kernel(request_ptr, offset_ptr, length_ptr, num_requests, qsl_ptr, seq_lens_ptr, positions_ptr,
                  slot_ptr, num_tokens, bt_ptr, stride_bt_s, stride_bt_b, max_blocks, block_size,
                  ids_ptr, tokens_ptr, stride_tok, tok_cols, HAS_IDS: tl.constexpr, BLOCK: tl.constexpr):
    i_s = tl.program_id(0)
    start = tl.load(qsl_ptr + i_s)
    # the sequence's tokens, clipped to the token tensors (hand-built offsets cannot send the
    # loop past them, nor make it long)
    q_len = tl.minimum(tl.load(qsl_ptr + i_s + 1), num_tokens) - start
    if (q_len > 0) & (start >= 0):
        r = tl.load(request_ptr + i_s)
        known = (r >= 0) & (r < num_requests)
        # (a request index outside ``length`` reads its entry 0, then counts as unknown)
        off = tl.load(offset_ptr + i_s)
        first = tl.load(length_ptr + tl.where(known, r, 0)).to(tl.int64) + off
        last = first + q_len                   # int64: no wrap past 2**31
        ok = known & (first >= 0) & (last < 2 ** 31)
        tl.store(seq_lens_ptr + i_s, tl.where(ok, last, 0).to(tl.int32))
        for j0 in range(0, q_len, BLOCK):
            o_j = j0 + tl.arange(0, BLOCK)
            m_j = o_j < q_len
            # ok as a [BLOCK] mask (the interpreter refuses a scalar & a block as a load mask)
            m_ok = (o_j * 0 + ok.to(tl.int32)) > 0
            pos = first + o_j
            i_b = pos // block_size
            m_b = (i_b >= 0) & (i_b < max_blocks) & m_j & m_ok
            # [BLOCK]: the block holding each position (the table was staged for the longest case)
            b_block = tl.load(bt_ptr + i_s.to(tl.int64) * stride_bt_s + i_b.to(tl.int64) * stride_bt_b, mask=m_b,
                              other=-1)
            slot = tl.where(m_b & (b_block >= 0), b_block.to(tl.int64) * block_size + pos % block_size, -1)
            tl.store(slot_ptr + start + o_j, slot, mask=m_j)
            tl.store(positions_ptr + start + o_j, tl.where(m_ok, pos, 0).to(tl.int64), mask=m_j)
            if HAS_IDS:
                # token j of the sequence is column 1 + offset + j of its request's token row
                col = 1 + off.to(tl.int64) + o_j
                m_t = m_ok & m_j & (col >= 0) & (col < tok_cols)
                b_id = tl.load(tokens_ptr + tl.where(known, r, 0).to(tl.int64) * stride_tok + col, mask=m_t, other=0)
                tl.store(ids_ptr + start + o_j, b_id, mask=m_j)


def place_tokens(request: torch.Tensor, offset: torch.Tensor, length: torch.Tensor, *, query_start_loc: torch.Tensor,
                 seq_lens: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_table: torch.Tensor, block_size: int, input_ids: torch.Tensor | None = None,
                 tokens: torch.Tensor | None = None) -> None:
    """Rewrite ``seq_lens`` [S], ``positions`` [T] and ``slot_mapping`` [T] in place (see the
    module doc). request [S] int32: each sequence's row of ``length``; offset [S] int32:
    where its first token sits against that length (0: the next token; -1: the one before);
    length [R] int32: the device-owned lengths; query_start_loc [S + 1] int32, block_table
    [S, B] int32 as staged. With ``input_ids`` [T] int64 and ``tokens`` [R, C] int64 (a
    row of token ids per request), token j of sequence i also takes the id
    ``tokens[request[i], 1 + offset[i] + j]`` (0 outside the row). A launch of S programs;
    nothing is read back."""
    check_tensor("query_start_loc", query_start_loc, dim=1, dtypes=(torch.int32,))
    device = query_start_loc.device
    check_runnable(device)
    s = query_start_loc.shape[0] - 1
    for name, t, n in (("request", request, s), ("offset", offset, s), ("seq_lens", seq_lens, s)):
        check_tensor(name, t, dim=1, dtypes=(torch.int32,), device=device)
        if t.shape[0] != n:
            raise ValueError(f"{name} must have {n} entries (one per sequence), got {t.shape[0]}")
    check_tensor("length", length, dim=1, dtypes=(torch.int32,), device=device)
    if length.shape[0] < 1:
        raise ValueError("length must have at least one entry (one per request slot)")
    check_tensor("positions", positions, dim=1, dtypes=(torch.int64,), device=device)
    check_tensor("slot_mapping", slot_mapping, dim=1, dtypes=(torch.int64,), device=device)
    if positions.shape != slot_mapping.shape:
        raise ValueError(f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)} must "
                         f"have one entry per token slot each")
    check_tensor("block_table", block_table, dim=2, dtypes=(torch.int32,), device=device, last_contiguous=False)
    if block_table.shape[0] != s:
        raise ValueError(f"block_table must have {s} rows, got {block_table.shape[0]}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if (input_ids is None) != (tokens is None):
        raise ValueError("input_ids and tokens go together (the ids are read from the request's token row)")
    if tokens is not None:
        check_tensor("input_ids", input_ids, dim=1, dtypes=(torch.int64,), device=device)
        check_tensor("tokens", tokens, dim=2, dtypes=(torch.int64,), device=device)
        if input_ids.shape != positions.shape:
            raise ValueError(f"input_ids must have {positions.shape[0]} entries, got {input_ids.shape[0]}")
        if tokens.shape[0] != length.shape[0]:
            raise ValueError(f"tokens must have one row per entry of length ({length.shape[0]}), got {tokens.shape[0]}")
    if s == 0:
        return
    _place_kernel[(s,)](request, offset, length, length.shape[0], query_start_loc, seq_lens, positions,
                        slot_mapping, positions.shape[0], block_table, block_table.stride(0), block_table.stride(1),
                        block_table.shape[1], block_size, input_ids if tokens is not None else positions,
                        tokens if tokens is not None else positions, tokens.stride(0) if tokens is not None else 0,
                        tokens.shape[1] if tokens is not None else 0, HAS_IDS=tokens is not None, BLOCK=16)


def accept_greedy(target_ids: torch.Tensor, draft_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_ids [S, K + 1] int64: the target's argmax after each of a verify step's K + 1
    tokens (the last accepted token, then K drafts); draft_ids [S, K] int64. Returns
    (accepted [S] int32, the leading drafts equal to the target's choice; next_ids [S]
    int64, the target's token after them: the correction, or the bonus when every draft
    was accepted). Plain tensor ops, no host read: capturable."""
    check_tensor("target_ids", target_ids, dim=2, dtypes=(torch.int64,))
    check_tensor("draft_ids", draft_ids, dim=2, dtypes=(torch.int64,), device=target_ids.device)
    s, k1 = target_ids.shape
    if draft_ids.shape != (s, k1 - 1):
        raise ValueError(f"draft_ids must be [{s}, {k1 - 1}] (one fewer than target_ids' columns), got "
                         f"{tuple(draft_ids.shape)}")
    same = (draft_ids == target_ids[:, :-1]).to(torch.int32)          # [S, K]
    accepted = same.cumprod(dim=1).sum(dim=1, dtype=torch.int32)       # [S]
    next_ids = target_ids.gather(1, accepted.long()[:, None]).squeeze(1)
    return accepted, next_ids


def accept_rejection(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_ids: torch.Tensor,
                     uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling's acceptance rule: the emitted tokens follow the target's
    distributions exactly, whatever the draft's.

    target_probs [S, K + 1, V]: the target's (filtered, renormalised) distribution after each
    of the verify step's K + 1 tokens; draft_probs [S, K, V]: the distributions the drafts
    were drawn from; draft_ids [S, K] int64; uniforms [S, K + 1] in [0, 1): one per draft
    (draft j is accepted when u_j * q_j(d_j) < p_j(d_j)) and one for the token after the
    accepted ones, drawn from max(0, p_a - q_a) renormalised (p_K after K accepted; p_a
    itself where that difference is all zero). Returns (accepted [S] int32, next_ids [S]
    int64). Plain tensor ops, no host read: capturable."""
    for name, t, dims in (("target_probs", target_probs, 3), ("draft_probs", draft_probs, 3),
                          ("uniforms", uniforms, 2)):
        check_tensor(name, t, dim=dims, dtypes=(torch.float32, torch.float64), device=target_probs.device)
    check_tensor("draft_ids", draft_ids, dim=2, dtypes=(torch.int64,), device=target_probs.device)
    s, k1, v = target_probs.shape
    k = k1 - 1
    for name, t, shape in (("draft_probs", draft_probs, (s, k, v)), ("draft_ids", draft_ids, (s, k)),
                           ("uniforms", uniforms, (s, k + 1))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)} (target_probs is {list(target_probs.shape)}), got "
                             f"{list(t.shape)}")
    at = draft_ids.clamp(0, v - 1)[..., None]                                   # [S, K, 1]
    p = target_probs[:, :k].gather(2, at).squeeze(2)                             # [S, K]
    q = draft_probs.gather(2, at).squeeze(2)
    accepted = (uniforms[:, :k] * q < p).to(torch.int32).cumprod(dim=1).sum(dim=1, dtype=torch.int32)
    rows = accepted.long()[:, None, None].expand(s, 1, v)
    p_a = target_probs.gather(1, rows).squeeze(1)                                # [S, V]
    q_a = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], 1).gather(1, rows).squeeze(1)
    residual = (p_a - q_a).clamp_min(0)
    total = residual.sum(dim=1, keepdim=True)
    residual = torch.where(total > 0, residual, p_a)
    cdf = residual.cumsum(dim=1)                                                 # [S, V]
    x = (uniforms[:, k:] * cdf[:, -1:]).contiguous()
    next_ids = torch.searchsorted(cdf, x, right=True).squeeze(1).clamp(max=v - 1)
    return accepted, next_ids
