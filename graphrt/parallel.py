"""Tensor-parallel attention on torch.distributed: heads sharded across ranks.

Each rank owns ``num_q_heads / world`` query heads and ``num_kv_heads / world`` KV heads,
its own KV-cache shard and its own ``Runtime`` (static buffers, pinned staging, graphs).
Every rank is handed the same host-side ``Step`` and stages it itself: nothing about the
step crosses ranks. The model's projections are column-parallel (q, k, v of the rank's
heads) and row-parallel (the output projection of those heads), followed by one
all-reduce per layer, which NCCL can run inside a captured CUDA graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
from typing import Iterator

import torch
import torch.distributed as dist

from graphrt.config import RuntimeConfig
from graphrt.toy import ToyModel


# Multicast over NVLink stays off: it is not available on every machine these run on.
_NCCL_ENV = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")


def free_port() -> int:
    """A free TCP port on localhost for the rendezvous of a single-host group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process_group(rank: int, world_size: int, port: int, backend: str = "nccl",
                  gloo_device: str = "cpu") -> Iterator[torch.device]:
    """Join a single-host group (rendezvous on 127.0.0.1:``port``) as ``rank``; yields this
    rank's device (``cuda:rank`` with NCCL; ``gloo_device`` with gloo, e.g. "cuda:0" for
    ranks that share one GPU) and leaves the group on exit."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **_NCCL_ENV)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device(gloo_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        yield device
    finally:
        dist.destroy_process_group()


def shard_config(cfg: RuntimeConfig, world_size: int) -> RuntimeConfig:
    """The per-rank config: the heads divided by ``world_size``, everything else equal."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    for name in ("num_q_heads", "num_kv_heads"):
        if getattr(cfg, name) % world_size:
            raise ValueError(f"RuntimeConfig.{name} ({getattr(cfg, name)}) must be a multiple of world_size "
                             f"({world_size}) to shard heads across ranks")
    return dataclasses.replace(cfg, num_q_heads=cfg.num_q_heads // world_size,
                               num_kv_heads=cfg.num_kv_heads // world_size)


class ParallelToyModel(ToyModel):
    """Rank ``rank``'s share of ``ToyModel(cfg, ...)``: the same weights (same seed), its
    query and KV heads' columns of the qkv projection, its heads' rows of the output
    projection, and an all-reduce of the output projection over ``group``. Embeddings
    are replicated, so every rank ends a layer with the same hidden state."""

    def __init__(self, cfg: RuntimeConfig, *, rank: int, world_size: int, num_layers: int,
                 group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu", **toy_kwargs):
        full = ToyModel(cfg, num_layers=num_layers, device="cpu", **toy_kwargs)
        shard = shard_config(cfg, world_size)
        super().__init__(shard, num_layers=num_layers, device="cpu", **toy_kwargs)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        d = cfg.head_dim
        hq, hkv = shard.num_q_heads, shard.num_kv_heads
        q0, k0 = rank * hq * d, cfg.num_q_heads * d + rank * hkv * d
        v0 = (cfg.num_q_heads + cfg.num_kv_heads) * d + rank * hkv * d
        w_qkv = torch.cat([full.w_qkv[..., q0: q0 + hq * d], full.w_qkv[..., k0: k0 + hkv * d],
                           full.w_qkv[..., v0: v0 + hkv * d]], dim=-1)
        with torch.no_grad():
            self.embed = torch.nn.Parameter(full.embed.detach().clone(), requires_grad=False)
            self.pos_embed = torch.nn.Parameter(full.pos_embed.detach().clone(), requires_grad=False)
            self.w_qkv = torch.nn.Parameter(w_qkv.contiguous(), requires_grad=False)
            self.w_o = torch.nn.Parameter(full.w_o[:, q0: q0 + hq * d].contiguous(), requires_grad=False)
        self.rank, self.world_size, self.group = rank, world_size, group
        self.to(device)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) of this rank's output-projection share [T, hidden], in place."""
        dist.all_reduce(partial, group=self.group)
        return partial
