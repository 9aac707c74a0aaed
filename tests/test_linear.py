"""graphrt.kernels.small_linear (a decode step's few rows against one to three weights)
against a float64 x @ w.T + b."""

from __future__ import annotations

import pytest
import torch

from _cases import assert_close, fresh_seed, rngs
from graphrt.kernels.linear import LinearConfig, block_rows, default_linear_config, small_linear

HAS_CUDA = torch.cuda.is_available()
# (dtype, atol, rtol): bf16 through tl.dot only on the GPU (the interpreter's bf16 dot is wrong)
DTYPES = [
    pytest.param((torch.float32, 1e-4, 1e-4), id="fp32"),
    pytest.param((torch.float16, 2e-2, 1e-2), id="fp16"),
    pytest.param((torch.bfloat16, 1e-1, 2e-2), id="bf16", marks=pytest.mark.gpu),
]
CASES = [   # rows, output rows of each weight, columns
    pytest.param(1, [40], 96, id="one-row"),
    pytest.param(1, [16, 8, 8], 64, id="one-row-qkv"),
    pytest.param(2, [33, 17], 130, id="two-rows-odd"),
    pytest.param(17, [64, 64], 48, id="rows17-pair"),
    pytest.param(64, [31, 1, 7], 40, id="rows64-three"),
    pytest.param(8, [1], 1, id="one-column"),
]
CONFIGS = [None, LinearConfig(block_n=16, block_k=32), LinearConfig(block_n=32, block_k=64, num_warps=8)]


@pytest.mark.parametrize("dtype_tol", DTYPES)
@pytest.mark.parametrize("rows,outs,cols", CASES)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_small_linear(dtype_tol, rows, outs, cols, bias, device):
    dtype, atol, rtol = dtype_tol
    seed = fresh_seed()
    _, gen = rngs(seed)
    # x as a view with a row stride past its columns (a slice of a wider activation)
    x = torch.randn(rows, cols + 5, generator=gen).to(device=device, dtype=dtype)[:, :cols]
    ws = [torch.randn(n, cols, generator=gen).to(device=device, dtype=dtype) for n in outs]
    bs = [torch.randn(n, generator=gen).to(device=device, dtype=dtype) for n in outs] if bias else None
    for cfg in CONFIGS:
        got = small_linear(x, ws, bs, config=cfg)
        assert len(got) == len(ws)
        for i, (y, w) in enumerate(zip(got, ws)):
            ref = x.double() @ w.double().T + (bs[i].double() if bias else 0)
            assert y.dtype == dtype and tuple(y.shape) == (rows, w.shape[0])
            assert_close(f"y[{i}] ({cfg})", y, ref, atol, rtol, seed)


def test_small_linear_refuses_bad_input(device):
    x = torch.zeros(2, 8, device=device)
    w = torch.zeros(4, 8, device=device)
    with pytest.raises(ValueError, match="1 to 3 tensors"):
        small_linear(x, [])
    with pytest.raises(ValueError, match="1 to 3 tensors"):
        small_linear(x, [w] * 4)
    with pytest.raises(ValueError, match="rows"):
        small_linear(torch.zeros(65, 8, device=device), [w])
    with pytest.raises(ValueError, match=r"weights\[0\] has 7 columns"):
        small_linear(x, [torch.zeros(4, 7, device=device)])
    with pytest.raises(TypeError, match=r"weights\[1\] must have dtype"):
        small_linear(x, [w, w.half()])
    with pytest.raises(ValueError, match=r"biases\[0\] has 3 entries"):
        small_linear(x, [w], [torch.zeros(3, device=device)])
    with pytest.raises(ValueError, match="one tensor per weight"):
        small_linear(x, [w, w], [torch.zeros(4, device=device)])
    with pytest.raises(ValueError, match="block_n must be >= 16"):
        small_linear(x, [w], config=LinearConfig(block_n=8, block_k=32))
    with pytest.raises(ValueError, match="contiguous last dim"):
        small_linear(torch.zeros(8, 2, device=device).T, [w])
    with pytest.raises(ValueError, match="power of two"):
        LinearConfig(block_n=12, block_k=32)


def test_default_config_fits_the_rows():
    for m in (1, 2, 16, 17, 64):
        cfg = default_linear_config(m, 4096, 4096)
        assert block_rows(m) == 1 or cfg.block_n >= 16
        assert block_rows(m) >= m
