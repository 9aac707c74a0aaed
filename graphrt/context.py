"""What a model step may use of its ``ctx``: one protocol that every context implements.

``graphrt.runtime.StepContext`` (a runtime's steps, captured or eager) and the reference
runner's context (``graphrt.checking.ReferenceRunner``: float64 attention and sampling)
implement ``ModelContext``; the transformers adapter's construction check implements
``AttentionContext`` (it only records each layer's attention call). A model step written
against ``ModelContext`` runs under all of them; ``tests/test_context.py`` holds each
implementation to it, signatures included.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from graphrt.kernels.metadata import AttentionMetadata


@runtime_checkable
class AttentionContext(Protocol):
    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                  window: int | None = None, window_rule: str = "clip", ranges: bool = True,
                  softcap: float | None = None) -> torch.Tensor:
        """Write k, v ([T, Hkv, D]) into ``layer``'s KV cache, then attend q ([T, Hq, D]) over
        it; returns [T, Hq, D]."""
        ...


@runtime_checkable
class ModelContext(AttentionContext, Protocol):
    meta: AttentionMetadata                 # the step's metadata (device tensors)
    input_ids: torch.Tensor                 # [T] int64
    positions: torch.Tensor                 # [T] int64, or [P, T] with several position rows
    embed_index: torch.Tensor | None        # [T] int32 row of inputs_embeds, -1 = none; None without embeddings
    inputs_embeds: torch.Tensor | None      # [T, embed_dim] given embeddings
    num_tokens: int                         # T
    num_seqs: int                           # S

    @property
    def last_token_index(self) -> torch.Tensor:
        """[S] int64: each sequence's last new token's row."""
        ...

    def merge_embeds(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with the rows of tokens that brought an input embedding replaced by it."""
        ...

    def sample(self, logits: torch.Tensor, *, probs: bool = False):
        """[S] int64: each sequence's next token from its row of ``logits`` [S, V], with the
        step's sampling settings; ``probs``: (ids, the distributions drawn from [S, V])."""
        ...


MEMBERS = ("meta", "input_ids", "positions", "embed_index", "inputs_embeds", "num_tokens", "num_seqs",
           "last_token_index", "merge_embeds", "sample", "attention")
