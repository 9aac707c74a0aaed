"""Position rows given with a step (multimodal RoPE's three rows, or any positions that are
not each token's sequence position): packed into the step's one pinned copy, read by the
model step as ``ctx.positions``, checked before anything is staged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _cases import fresh_seed
from graphrt import Runtime, RuntimeConfig, SeqStep, Step
from graphrt.buffers import Layout
from graphrt.checking import ReferenceRunner


def cfg_with(rows: int) -> RuntimeConfig:
    return RuntimeConfig(num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=16, num_blocks=16, max_num_seqs=4,
                         max_num_tokens=32, max_model_len=128, max_prefix_ranges=1, dtype=torch.float32,
                         position_rows=rows)


class EchoPositions(torch.nn.Module):
    """A model step whose output is what it read: its positions (and one attention call,
    so that the step writes the cache like a real one)."""

    def forward(self, ctx):
        q = torch.zeros(ctx.num_tokens, 2, 16, device=ctx.input_ids.device)
        ctx.attention(0, q, q[:, :1], q[:, :1])
        return ctx.positions.clone()


def step_of(rng) -> Step:
    free = iter(rng.permutation(16).tolist())
    seqs = []
    for q, c in ((7, 0), (1, 40), (5, 20)):
        seqs.append(SeqStep(q_len=q, context_len=c, block_ids=[next(free) for _ in range(-(-(q + c) // 16))]))
    return Step(seqs)


def sequence_positions(step: Step) -> np.ndarray:
    return np.concatenate([np.arange(c, c + q) for q, c in zip(step.q_lens, step.context_lens)])


@pytest.mark.parametrize("rows", [1, 3])
def test_given_and_default_positions_land(device, rows):
    rng = np.random.default_rng(fresh_seed())
    cfg = cfg_with(rows)
    rt = Runtime(cfg, EchoPositions(), num_layers=1, device=device)
    ref = ReferenceRunner(cfg, EchoPositions(), num_layers=1, device=device)
    step = step_of(rng)
    n = step.num_tokens
    given = rng.integers(0, 2 ** 31 - 1, (rows, n))
    for _ in range(2):               # given, then none: no value of the given ones may stay behind
        got = rt.step(step, np.zeros(n, np.int64), positions=given)
        want = given if rows > 1 else given[0]
        np.testing.assert_array_equal(got[..., :n].cpu().numpy(), want)
        np.testing.assert_array_equal(ref.step(step, np.zeros(n, np.int64), positions=given).cpu().numpy(), want)
        got = rt.step(step, np.zeros(n, np.int64))
        seq = sequence_positions(step)
        want = np.tile(seq, (rows, 1)) if rows > 1 else seq
        np.testing.assert_array_equal(got[..., :n].cpu().numpy(), want)
        np.testing.assert_array_equal(ref.step(step, np.zeros(n, np.int64)).cpu().numpy(), want)


def test_position_rows_follow_the_bucket_in_the_copy():
    """Three rows take 16 more bytes a token slot of the bucket, and nothing else moves."""
    one, three = Layout.make(4, 32, 1, 8), Layout.make(4, 32, 1, 8, position_rows=3)
    assert three.copy_bytes(2) - one.copy_bytes(2) == 2 * 8 * 32
    assert three.offsets["positions"] == one.offsets["positions"]


@pytest.mark.parametrize("positions,message", [
    (np.zeros((2, 13), np.int64), r"positions must be ints of shape \[3, 13\]"),
    (np.zeros(13, np.int64), r"positions must be ints of shape \[3, 13\]"),
    (np.zeros((3, 13)), r"positions must be ints"),
    (np.full((3, 13), -1), r"positions must be in \[0, 2\*\*31\)"),
    (np.full((3, 13), 2 ** 31), r"positions must be in \[0, 2\*\*31\)"),
], ids=["rows", "one-row", "float", "negative", "too-large"])
def test_bad_positions_refused_before_staging(device, positions, message):
    rng = np.random.default_rng(fresh_seed())
    rt = Runtime(cfg_with(3), EchoPositions(), num_layers=1, device=device)
    step = step_of(rng)
    rt.step(step, np.zeros(13, np.int64), positions=np.ones((3, 13), np.int64))
    before = [t.clone() for t in (rt.buffers.arena, *rt.buffers.staging, *rt.k_caches)]
    with pytest.raises(ValueError, match=message):
        rt.step(step, np.zeros(13, np.int64), positions=positions)
    assert all(torch.equal(a, b) for a, b in zip(before, (rt.buffers.arena, *rt.buffers.staging, *rt.k_caches)))


def test_device_positions_refused(device):
    if device.type != "cuda":
        pytest.skip("a device tensor needs CUDA")
    rt = Runtime(cfg_with(1), EchoPositions(), num_layers=1, device=device)
    step = Step([SeqStep(q_len=2, context_len=0, block_ids=[0])])
    with pytest.raises(ValueError, match="host ints"):
        rt.step(step, [1, 2], positions=torch.zeros(2, dtype=torch.int64, device=device))


def test_position_rows_config():
    for bad in (0, 5, True, 2.0):
        with pytest.raises(ValueError, match="position_rows"):
            cfg_with(bad)


@pytest.mark.gpu
def test_replayed_positions_one_copy():
    """Captured, three rows: every replay reads the step's own positions."""
    rng = np.random.default_rng(fresh_seed())
    rt = Runtime(cfg_with(3), EchoPositions(), num_layers=1, device="cuda", strict=True)
    rt.capture(decode_buckets=[4], mixed_buckets=[32], quiet=True)
    step = step_of(rng)
    for i in range(4):
        given = None if i % 2 else rng.integers(0, 1000, (3, step.num_tokens))
        got = rt.step(step, np.zeros(step.num_tokens, np.int64), positions=given)
        assert rt.last.mode == "replay"
        want = np.tile(sequence_positions(step), (3, 1)) if given is None else given
        np.testing.assert_array_equal(got[:, : step.num_tokens].cpu().numpy(), want)
