"""graphrt's launchers as ``torch.library`` custom ops, for code that ``torch.compile`` traces.

``torch.ops.graphrt.write_kv``, ``torch.ops.graphrt.paged_attention`` and
``torch.ops.graphrt.paged_attention_new_kv`` (the KV write in the attention launch, what a
decode bucket runs) take the metadata as its five tensors and write their outputs in place (declared with ``mutates_args``, so
functionalization and Inductor's re-inplacing keep the writes). Their fake
implementations do nothing: every output is an argument. Eager code should call
``graphrt.kernels.write_kv`` / ``paged_attention`` directly (no dispatcher overhead);
``graphrt.StepContext.attention`` switches to these ops while it is being compiled.
``torch.ops.graphrt.sample`` draws a step's next tokens (``StepContext.sample``), ``greedy`` takes
each row's first maximum (in two launches where ``argmax`` reads a row with one block), ``sample_kept``
also gives the smallest logit each row kept, ``kept_lowest`` that alone (no draw), ``uniforms`` a
speculative step's uniforms;
``torch.ops.graphrt.place_tokens`` places a speculative step's tokens (``graphrt.speculative``).
``torch.ops.graphrt.small_linear`` is a plain functional op: a compiled step's matmuls of a
few rows become it after tracing (``graphrt.capture.linear_pass``).
"""

from __future__ import annotations

from typing import Optional

import torch

from .kv_write import write_kv as _write_kv
from .linear import small_linear as _small_linear
from .metadata import AttentionMetadata
from .paged_attention import paged_attention as _paged_attention
from .sampling import greedy as _greedy
from .sampling import kept_lowest as _kept_lowest
from .sampling import sample as _sample
from .sampling import uniforms as _uniforms
from .speculative import place_tokens as _place_tokens


@torch.library.custom_op("graphrt::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: Optional[torch.Tensor] = None,
             v_scale: Optional[torch.Tensor] = None) -> None:
    """k, v: [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]; slot_mapping [T] int64;
    k_scale, v_scale: [Hkv] float32 for fp8 caches."""
    _write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


@write_kv.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    return None


@torch.library.custom_op("graphrt::paged_attention", mutates_args=("out", "part_o", "part_lse", "counters"))
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                    prefix_ranges: torch.Tensor, slot_mapping: torch.Tensor, part_o: torch.Tensor,
                    part_lse: torch.Tensor, counters: torch.Tensor, scale: Optional[float] = None,
                    window: Optional[int] = None, window_rule: str = "clip", ranges: bool = True,
                    softcap: Optional[float] = None, num_splits: int = 1, max_query_len: Optional[int] = None,
                    k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None) -> None:
    """``graphrt.kernels.paged_attention`` with the metadata's tensors spelled out and the
    split workspace as its three tensors (empty ones: no workspace); writes ``out`` ([T, Hq, D])
    in place. The workspace is three required positional tensors, not Optional ones with
    defaults: torch 2.11 raises IndexError for a mutated argument passed by keyword or left
    to its default (pytorch/pytorch#176078)."""
    meta = AttentionMetadata(query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
                             prefix_ranges=prefix_ranges, slot_mapping=slot_mapping)
    workspace = None if part_o.numel() == 0 or part_lse.numel() == 0 else (part_o, part_lse, counters)
    _paged_attention(q, k_cache, v_cache, out, meta, scale=scale, window=window, window_rule=window_rule,
                     ranges=ranges, softcap=softcap, num_splits=num_splits, workspace=workspace,
                     max_query_len=max_query_len, k_scale=k_scale, v_scale=v_scale)


@paged_attention.register_fake
def _(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, prefix_ranges, slot_mapping, part_o,
      part_lse, counters, scale=None, window=None, window_rule="clip", ranges=True, softcap=None, num_splits=1,
      max_query_len=None, k_scale=None, v_scale=None) -> None:
    return None


@torch.library.custom_op("graphrt::paged_attention_new_kv",
                         mutates_args=("k_cache", "v_cache", "out", "part_o", "part_lse", "counters"))
def paged_attention_new_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, out: torch.Tensor, query_start_loc: torch.Tensor,
                           seq_lens: torch.Tensor, block_table: torch.Tensor, prefix_ranges: torch.Tensor,
                           slot_mapping: torch.Tensor, part_o: torch.Tensor, part_lse: torch.Tensor,
                           counters: torch.Tensor, scale: Optional[float] = None, window: Optional[int] = None,
                           window_rule: str = "clip", ranges: bool = True, softcap: Optional[float] = None,
                           num_splits: int = 1, max_query_len: Optional[int] = None,
                           k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                           rope_cos: Optional[torch.Tensor] = None, rope_sin: Optional[torch.Tensor] = None) -> None:
    """``paged_attention`` that writes the new k, v ([T, Hkv, D]) into the caches in the same
    launch (``new_kv``): the caches are declared mutated, so it is a separate op from
    ``graphrt::paged_attention``, whose caches are only read. With ``rope_cos`` and
    ``rope_sin`` ([T, R]), q and k come before their rotary embedding, which the launch
    applies (``paged_attention``'s ``rope``; what the compiled step's rotary pass makes)."""
    meta = AttentionMetadata(query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
                             prefix_ranges=prefix_ranges, slot_mapping=slot_mapping)
    workspace = None if part_o.numel() == 0 or part_lse.numel() == 0 else (part_o, part_lse, counters)
    _paged_attention(q, k_cache, v_cache, out, meta, scale=scale, window=window, window_rule=window_rule,
                     ranges=ranges, softcap=softcap, num_splits=num_splits, workspace=workspace,
                     max_query_len=max_query_len, k_scale=k_scale, v_scale=v_scale, new_kv=(k, v),
                     rope=None if rope_cos is None and rope_sin is None else (rope_cos, rope_sin))


@paged_attention_new_kv.register_fake
def _(q, k, v, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, prefix_ranges, slot_mapping, part_o,
      part_lse, counters, scale=None, window=None, window_rule="clip", ranges=True, softcap=None, num_splits=1,
      max_query_len=None, k_scale=None, v_scale=None, rope_cos=None, rope_sin=None) -> None:
    return None


@torch.library.custom_op("graphrt::small_linear", mutates_args=())
def small_linear(x: torch.Tensor, weights: list[torch.Tensor], biases: list[Optional[torch.Tensor]],
                 constant_weights: bool = False, gate: Optional[torch.Tensor] = None,
                 norm_weight: Optional[torch.Tensor] = None, norm_eps: float = 1e-6, norm_offset: bool = False,
                 residual: Optional[torch.Tensor] = None, activation: str = "silu") -> list[torch.Tensor]:
    """``graphrt.kernels.linear.small_linear``: [x @ w.T (+ b)] for 1 to 3 weights in one
    launch (what a compiled step's matmuls of a few rows become: ``graphrt.capture.linear_pass``);
    biases: one per weight, all tensors or all None; ``constant_weights``: the step writes
    none of the weights (the kernel may load them before the kernel before it has finished,
    under programmatic dependent launch); ``gate``, ``activation``: the input is
    act(gate) * x (a SwiGLU or GeGLU down projection); ``norm_weight``, ``norm_eps``,
    ``norm_offset``: the input is x under an RMSNorm; ``residual``: the output is
    residual + x @ w.T (one weight)."""
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise ValueError("biases must be all tensors or all None")
    return _small_linear(x, weights, None if all(b is None for b in biases) else biases,
                         constant_weights=constant_weights, gate=gate, norm_weight=norm_weight, norm_eps=norm_eps,
                         norm_offset=norm_offset, residual=residual, activation=activation)


@small_linear.register_fake
def _(x, weights, biases, constant_weights=False, gate=None, norm_weight=None, norm_eps=1e-6, norm_offset=False,
      residual=None, activation="silu"):
    return [x.new_empty(x.shape[0], w.shape[0]) for w in weights]


@torch.library.custom_op("graphrt::sample", mutates_args=())
def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """``graphrt.kernels.sampling.sample``: [S] int64 token ids, one a row of logits [S, V]."""
    return _sample(logits, temperature, top_k, top_p, min_p, seed, counter)


@sample.register_fake
def _(logits, temperature, top_k, top_p, min_p, seed, counter):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


@torch.library.custom_op("graphrt::greedy", mutates_args=())
def greedy(logits: torch.Tensor) -> torch.Tensor:
    """``graphrt.kernels.sampling.greedy``: [S] int64, each row's first maximum of logits [S, V]."""
    return _greedy(logits)


@greedy.register_fake
def _(logits):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


@torch.library.custom_op("graphrt::sample_kept", mutates_args=())
def sample_kept(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample`` with the smallest logit each row kept: ([S] int64 ids, [S] float32), the
    second what ``graphrt.kernels.sampling.kept_probs`` turns into the distribution drawn from."""
    lowest = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    return _sample(logits, temperature, top_k, top_p, min_p, seed, counter, lowest=lowest), lowest


@sample_kept.register_fake
def _(logits, temperature, top_k, top_p, min_p, seed, counter):
    return (logits.new_empty(logits.shape[0], dtype=torch.int64),
            logits.new_empty(logits.shape[0], dtype=torch.float32))


@torch.library.custom_op("graphrt::kept_lowest", mutates_args=())
def kept_lowest(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor) -> torch.Tensor:
    """``graphrt.kernels.sampling.kept_lowest``: [S] float32, the smallest logit ``sample``
    keeps in each row, with no draw."""
    return _kept_lowest(logits, temperature, top_k, top_p, min_p)


@kept_lowest.register_fake
def _(logits, temperature, top_k, top_p, min_p):
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


@torch.library.custom_op("graphrt::uniforms", mutates_args=())
def uniforms(seed: torch.Tensor, counter: torch.Tensor, n: int) -> torch.Tensor:
    """``graphrt.kernels.sampling.uniforms``: [S, n] float32 in [0, 1)."""
    return _uniforms(seed, counter, n)


@uniforms.register_fake
def _(seed, counter, n):
    return seed.new_empty(seed.shape[0], n, dtype=torch.float32)


@torch.library.custom_op("graphrt::place_tokens", mutates_args=("seq_lens", "positions", "slot_mapping", "input_ids"))
def place_tokens(request: torch.Tensor, offset: torch.Tensor, length: torch.Tensor, query_start_loc: torch.Tensor,
                 seq_lens: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_table: torch.Tensor, block_size: int, input_ids: torch.Tensor, tokens: torch.Tensor) -> None:
    """``graphrt.kernels.speculative.place_tokens`` with ids: a speculative step's lengths,
    positions, slots and ids from device-owned lengths (``graphrt.speculative``)."""
    _place_tokens(request, offset, length, query_start_loc=query_start_loc, seq_lens=seq_lens, positions=positions,
                  slot_mapping=slot_mapping, block_table=block_table, block_size=block_size, input_ids=input_ids,
                  tokens=tokens)


@place_tokens.register_fake
def _(request, offset, length, query_start_loc, seq_lens, positions, slot_mapping, block_table, block_size,
      input_ids, tokens) -> None:
    return None


# the ops that run graphrt attention: what a compiled step's graphs must hold, once a layer
ATTENTION_OPS = ("graphrt.paged_attention", "graphrt.paged_attention_new_kv")


def attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                 meta: AttentionMetadata, *, workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 new_kv: tuple[torch.Tensor, torch.Tensor] | None = None, **opts) -> torch.Tensor:
    """``paged_attention`` through the custom op, taking an AttentionMetadata (and, with
    ``new_kv``, writing the new K/V in the same launch); returns out."""
    if workspace is None:               # distinct empty tensors: mutated arguments must not alias
        workspace = (q.new_empty(0, dtype=torch.float32), q.new_empty(0, dtype=torch.float32),
                     q.new_empty(0, dtype=torch.int32))
    if len(workspace) != 3:
        raise ValueError("workspace must be split_workspace(...)'s three tensors (part_o, part_lse, counters)")
    tensors = (meta.query_start_loc, meta.seq_lens, meta.block_table, meta.prefix_ranges, meta.slot_mapping)
    if new_kv is None:
        torch.ops.graphrt.paged_attention(q, k_cache, v_cache, out, *tensors, *workspace, **opts)
    else:
        torch.ops.graphrt.paged_attention_new_kv(q, *new_kv, k_cache, v_cache, out, *tensors, *workspace, **opts)
    return out
