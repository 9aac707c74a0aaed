"""Capacities and attention shape of a graphrt runtime."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrt.kernels._checks import check_head_dim

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """Fixed for the life of a runtime: every static buffer and graph is sized from it.

    Per-layer attention options (window, window rule, ranges on/off, soft-cap, scale) are arguments of
    the attention call instead, since real models mix sliding and global layers.
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int           # tokens per KV-cache block
    num_blocks: int           # blocks in the KV cache (per layer)
    max_num_seqs: int         # sequences in one step
    max_num_tokens: int       # new tokens in one step, all sequences together
    max_model_len: int        # context + new tokens of one sequence
    max_prefix_ranges: int = 8  # prefix ranges (images) per sequence
    dtype: torch.dtype = torch.bfloat16
    embed_dim: int = 0          # width of input embeddings a step may bring (0: token ids only)
    # position rows per token: 1 (a token's sequence position, or what the step gives), or
    # up to 4 for multimodal RoPE (the Qwen2-VL family's time, height and width rows: 3)
    position_rows: int = 1
    # KV-cache element type: None (dtype) or torch.float8_e4m3fn, which stores K / k_scale
    # and V / v_scale per layer and KV head (``Runtime.k_scales`` / ``v_scales``)
    kv_cache_dtype: torch.dtype | None = None
    # per-sequence sampling settings in the step's one copy, for ``StepContext.sample``
    # (temperature, top-k, top-p, min-p, seed: 24 bytes a sequence)
    sampling: bool = False
    # per-sequence request rows and offsets in the one copy, for graphrt.speculative's steps,
    # which place their tokens from device-owned lengths (8 bytes a sequence)
    speculative: bool = False

    def __post_init__(self) -> None:
        for name in ("num_q_heads", "num_kv_heads", "head_dim", "block_size", "num_blocks", "max_num_seqs",
                     "max_num_tokens", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RuntimeConfig.{name} must be a positive int, got {value!r}")
        if isinstance(self.embed_dim, bool) or not isinstance(self.embed_dim, int) or self.embed_dim < 0:
            raise ValueError(f"RuntimeConfig.embed_dim must be an int >= 0, got {self.embed_dim!r}")
        if isinstance(self.max_prefix_ranges, bool) or not isinstance(self.max_prefix_ranges, int) \
                or not 0 <= self.max_prefix_ranges <= 64:
            raise ValueError(f"RuntimeConfig.max_prefix_ranges must be an int in [0, 64], got {self.max_prefix_ranges!r}")
        if isinstance(self.position_rows, bool) or not isinstance(self.position_rows, int) \
                or not 1 <= self.position_rows <= 4:
            raise ValueError(f"RuntimeConfig.position_rows must be an int in [1, 4], got {self.position_rows!r}")
        for name in ("sampling", "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"RuntimeConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.speculative and self.position_rows != 1:
            raise ValueError("RuntimeConfig.speculative needs position_rows 1 (its steps place one position a token)")
        check_head_dim(self.head_dim, "RuntimeConfig.head_dim")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"RuntimeConfig.num_q_heads ({self.num_q_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.max_num_tokens < self.max_num_seqs:
            raise ValueError(f"RuntimeConfig.max_num_tokens ({self.max_num_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every sequence brings at least one token")
        if self.dtype not in _DTYPES:
            raise ValueError(f"RuntimeConfig.dtype must be one of {_DTYPES}, got {self.dtype}")
        if self.kv_cache_dtype not in (None, self.dtype, torch.float8_e4m3fn):
            raise ValueError(f"RuntimeConfig.kv_cache_dtype must be None (dtype), {self.dtype} or "
                             f"torch.float8_e4m3fn, got {self.kv_cache_dtype}")

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's element type."""
        return self.kv_cache_dtype or self.dtype

    @property
    def fp8_cache(self) -> bool:
        return self.cache_dtype == torch.float8_e4m3fn

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def queries_per_kv(self) -> int:
        return self.num_q_heads // self.num_kv_heads
