"""Tensor parallel: heads sharded over 2 ranks give the single-device result.

CPU: gloo, 2 processes, eager runtimes (the Triton interpreter). GPU (2 devices or more):
NCCL, each rank captures its step (all-reduce included) and replays it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from _cases import TOL, fresh_seed, rngs
from _model import random_step
from graphrt import Runtime, RuntimeConfig
from graphrt.parallel import ParallelToyModel, free_port, process_group, shard_config
from graphrt.toy import ToyModel

LAYERS = 2
TOY = dict(hidden=64, vocab=50, window=24)


def _cfg(dtype: torch.dtype) -> RuntimeConfig:
    return RuntimeConfig(num_q_heads=8, num_kv_heads=4, head_dim=64, block_size=16, num_blocks=120, max_num_seqs=4,
                         max_num_tokens=64, max_model_len=160, max_prefix_ranges=2, dtype=dtype)


def _steps(cfg: RuntimeConfig, seed: int, count: int) -> list:
    """The same steps in every process: decodes and mixed steps with image ranges."""
    rng, _ = rngs(seed)
    out = []
    for i in range(count):
        step = random_step(rng, cfg, num_seqs=int(rng.integers(1, cfg.max_num_seqs + 1)), decode=i % 2 == 1,
                           max_ctx=90)
        out.append((step, rng.integers(0, TOY["vocab"], step.num_tokens)))
    return out


def _worker(rank: int, world: int, port: int, out_dir: str, seed: int, backend: str, count: int) -> None:
    with process_group(rank, world, port, backend) as device:
        cfg = _cfg(torch.float32)
        model = ParallelToyModel(cfg, rank=rank, world_size=world, num_layers=LAYERS, seed=seed, device=device,
                                 **TOY)
        rt = Runtime(shard_config(cfg, world), model, num_layers=LAYERS, device=device)
        rt.capture(decode_buckets=[4], mixed_buckets=[64], quiet=True)
        outs, modes = [], []
        for step, ids in _steps(cfg, seed, count):
            logits = rt.step(step, ids)[1]
            outs.append(logits[: step.num_seqs].cpu().clone())
            modes.append(rt.last.mode)
        torch.save(dict(logits=outs, modes=modes), Path(out_dir) / f"rank{rank}.pt")


def _check(tmp_path: Path, backend: str, device: torch.device, count: int) -> list[list[str]]:
    seed = fresh_seed()
    world = 2
    mp.spawn(_worker, args=(world, free_port(), str(tmp_path), seed, backend, count), nprocs=world, join=True)
    cfg = _cfg(torch.float32)
    single = Runtime(cfg, ToyModel(cfg, num_layers=LAYERS, seed=seed, device=device, **TOY), num_layers=LAYERS,
                     device=device)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    atol, rtol = TOL[torch.float32]
    for i, (step, ids) in enumerate(_steps(cfg, seed, count)):
        want = single.step(step, ids)[1][: step.num_seqs].cpu()
        for r, got in enumerate(ranks):
            err = (got["logits"][i] - want).abs().max().item()
            assert torch.allclose(got["logits"][i], want, atol=2 * atol, rtol=2 * rtol), \
                f"step {i} rank {r}: logits differ from one device by up to {err:.3g} (seed={seed})"
    return [got["modes"] for got in ranks]


def test_shard_config_rejects_uneven_heads():
    with pytest.raises(ValueError, match=r"num_q_heads \(8\) must be a multiple of world_size \(3\)"):
        shard_config(_cfg(torch.float32), 3)
    with pytest.raises(ValueError, match=r"num_kv_heads \(4\) must be a multiple of world_size \(8\)"):
        shard_config(_cfg(torch.float32), 8)
    assert shard_config(_cfg(torch.float32), 2).num_q_heads == 4


def test_gloo_two_ranks_match_one_device(tmp_path):
    """Each rank stages the same Step on its own runtime; with the output projection
    all-reduced, every rank's logits equal the unsharded model's."""
    if torch.cuda.is_available():
        pytest.skip("the CPU (gloo, eager) variant; the GPU one is below")
    _check(tmp_path, "gloo", torch.device("cpu"), count=4)


@pytest.mark.gpu
def test_nccl_two_gpus_replay_matches_one_gpu(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    modes = _check(tmp_path, "nccl", torch.device("cuda", 0), count=8)
    assert all(m == "replay" for rank in modes for m in rank), modes
