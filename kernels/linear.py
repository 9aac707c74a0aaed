"""Small-batch linear layers: y = x @ w.T (+ b) for a few rows of x (a decode step's tokens),
where reading the weight is the whole cost. Up to three weights that share the input (a
layer's q, k and v projections; gate and up) run in one launch without concatenating
them, each into its own output.

The kernel streams each weight once, BLOCK_N rows a program, BLOCK_K columns at a time.
One row of x accumulates elementwise in fp32 and reduces once at the end; 2 to 64 rows
use ``tl.dot`` with the rows padded to 16 (a memory-bound shape: the tensor cores have
room to spare).

Given a ``gate`` of x's shape, the kernel's input is ``act(gate) * x``, computed as it loads
x (a gated MLP's down projection: the product is never written), act(gate) and the
product each rounded to x's dtype as the separate ops round; act is silu (SwiGLU, Llama)
or the tanh approximation of gelu (GeGLU, Gemma). Given a ``norm_weight``, the
input is x under an RMSNorm: each row of x scaled by the inverse root of its mean square
and by the norm's weight (``w``, or ``1 + w`` as Gemma's norms have it). The kernel
multiplies x by the weight as it loads it, sums x's squares beside the products and
scales each row's sums once at the end (so the normed x is never rounded to x's dtype,
where the separate ops round it twice). Given a ``residual`` [M, N], the output is
``residual + x @ w.T (+ b)``, the product rounded to x's dtype first as the separate add
sees it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._checks import check_runnable, check_tensor, pdl_supported

MAX_ROWS = 64               # more rows than this are a GEMM for cuBLAS, not a weight stream
MAX_WEIGHTS = 3
ACTIVATIONS = {"silu": 1, "gelu_tanh": 2}     # a gate's activation: the kernel's GATED


@triton.jit
def _accumulate(acc, b_w, b_x, BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One column tile into the accumulator: one row elementwise ([BLOCK_N, BLOCK_K], summed
    at the end), more rows through ``tl.dot`` ([BLOCK_M, BLOCK_N])."""
    if BLOCK_M == 1:
        acc += b_w.to(tl.float32) * b_x.to(tl.float32)
    else:
        acc = tl.dot(b_x, tl.trans(b_w), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _load_x(p_x, p_g, nw_ptr, o_k, m_x, m_k, ss, GATED: tl.constexpr, NORM: tl.constexpr):
    """A [BLOCK_M, BLOCK_K] tile of the input: x, or (GATED 1 / 2) act(gate) * x, act silu /
    gelu's tanh form, act(gate) and the product each rounded to x's dtype, or (NORM 1 / 2) x
    times the norm's weight w / 1 + w, each row's sum of squares added to ``ss`` [BLOCK_M].
    Returns (tile, ss)."""
    b_x = tl.load(p_x + o_k[None, :], mask=m_x, other=0.0)
    if GATED != 0:
        b_g = tl.load(p_g + o_k[None, :], mask=m_x, other=0.0).to(tl.float32)
        if GATED == 1:      # silu(g) = g * sigmoid(g)
            b_s = (b_g / (1.0 + tl.exp(-b_g))).to(b_x.dtype)
        else:               # 0.5 g (1 + tanh(z)) = g * sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
            z2 = 1.5957691216057308 * (b_g + 0.044715 * b_g * b_g * b_g)
            b_s = (b_g / (1.0 + tl.exp(-z2))).to(b_x.dtype)
        b_x = (b_s.to(tl.float32) * b_x.to(tl.float32)).to(b_x.dtype)
    if NORM != 0:
        x32 = b_x.to(tl.float32)
        ss += tl.sum(x32 * x32, axis=1)
        b_nw = tl.load(nw_ptr + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
        if NORM == 2:
            b_nw += 1.0
        b_x = (x32 * b_nw).to(b_x.dtype)
    return b_x, ss


@triton.jit
def _linear_tile(x_ptr, g_ptr, nw_ptr, eps, r_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_gm, stride_rm,
                 stride_wn, stride_ym, i_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                 GATED: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr):
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < M
    p_w = w_ptr + o_n.to(tl.int64)[:, None] * stride_wn          # [BLOCK_N, 1]
    p_x = x_ptr + o_m.to(tl.int64)[:, None] * stride_xm          # [BLOCK_M, 1]
    p_g = g_ptr + o_m.to(tl.int64)[:, None] * stride_gm          # (GATED only)
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)                  # each row's sum of squares (NORM only)
    # the first tile of columns apart from the loop: a programmatic dependent launch with
    # constant weights (PREFETCH, only with PDL) loads its weight tile before it waits for
    # the kernel before it, which wrote x (the weights no kernel of the step writes)
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < K
    if PREFETCH:
        b_w = tl.load(p_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)     # [BLOCK_N, BLOCK_K]
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    else:
        if PDL:     # a programmatic dependent launch: wait for the kernel before (see _attn_kernel)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        b_w = tl.load(p_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
    b_x, ss = _load_x(p_x, p_g, nw_ptr, o_k, m_m[:, None] & m_k[None, :], m_k, ss, GATED, NORM)  # [BLOCK_M, BLOCK_K]
    acc = _accumulate(acc, b_w, b_x, BLOCK_M, DOT_PRECISION)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        b_w = tl.load(p_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
        b_x, ss = _load_x(p_x, p_g, nw_ptr, o_k, m_m[:, None] & m_k[None, :], m_k, ss, GATED, NORM)
        acc = _accumulate(acc, b_w, b_x, BLOCK_M, DOT_PRECISION)
    if BLOCK_M == 1:
        b_y = tl.sum(acc, axis=1)[None, :]                       # [1, BLOCK_N]
    else:
        b_y = acc                                                # [BLOCK_M, BLOCK_N]
    if NORM != 0:       # each row's 1 / sqrt(mean square + eps)
        b_y *= tl.math.rsqrt(ss / K + eps)[:, None]
    if HAS_BIAS:
        b_y += tl.load(b_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    m_y = m_m[:, None] & m_n[None, :]
    if RESIDUAL:
        p_r = r_ptr + o_m.to(tl.int64)[:, None] * stride_rm + o_n[None, :]
        b_y = b_y.to(y_ptr.dtype.element_ty).to(tl.float32) + tl.load(p_r, mask=m_y, other=0.0).to(tl.float32)
    p_y = y_ptr + o_m.to(tl.int64)[:, None] * stride_ym + o_n[None, :]
    tl.store(p_y, b_y.to(y_ptr.dtype.element_ty), mask=m_y)


@triton.jit
def _linear_kernel(x_ptr, g_ptr, nw_ptr, eps, r_ptr, w0_ptr, w1_ptr, w2_ptr, b0_ptr, b1_ptr, b2_ptr, y0_ptr, y1_ptr,
                   y2_ptr, M, N0, N1, N2, K, stride_xm, stride_gm, stride_rm, stride_w0, stride_w1, stride_w2,
                   stride_y0, stride_y1, stride_y2, NUM_W: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   PDL: tl.constexpr, PREFETCH: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr,
                   RESIDUAL: tl.constexpr):
    # (a residual comes with one weight only: the caller checks)
    # programs [0, nb0) stream w0, the next nb1 w1, the rest w2
    i = tl.program_id(0)
    nb0 = tl.cdiv(N0, BLOCK_N)
    nb1 = tl.cdiv(N1, BLOCK_N)
    if i < nb0:
        _linear_tile(x_ptr, g_ptr, nw_ptr, eps, r_ptr, w0_ptr, b0_ptr, y0_ptr, M, N0, K, stride_xm, stride_gm,
                     stride_rm, stride_w0, stride_y0, i, BLOCK_M, BLOCK_N, BLOCK_K, HAS_BIAS, DOT_PRECISION, PDL,
                     PREFETCH, GATED, NORM, RESIDUAL)
    elif NUM_W == 2 or (NUM_W == 3 and i < nb0 + nb1):
        _linear_tile(x_ptr, g_ptr, nw_ptr, eps, r_ptr, w1_ptr, b1_ptr, y1_ptr, M, N1, K, stride_xm, stride_gm,
                     stride_rm, stride_w1, stride_y1, i - nb0, BLOCK_M, BLOCK_N, BLOCK_K, HAS_BIAS, DOT_PRECISION,
                     PDL, PREFETCH, GATED, NORM, False)
    elif NUM_W == 3:
        _linear_tile(x_ptr, g_ptr, nw_ptr, eps, r_ptr, w2_ptr, b2_ptr, y2_ptr, M, N2, K, stride_xm, stride_gm,
                     stride_rm, stride_w2, stride_y2, i - nb0 - nb1, BLOCK_M, BLOCK_N, BLOCK_K, HAS_BIAS,
                     DOT_PRECISION, PDL, PREFETCH, GATED, NORM, False)


@dataclass(frozen=True)
class LinearConfig:
    block_n: int            # weight rows a program streams
    block_k: int            # columns a load takes (a [block_n, block_k] tile in flight)
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"LinearConfig.{name} must be a power of two >= 1, got {v!r}")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"LinearConfig.num_stages must be an int >= 1, got {self.num_stages!r}")


def block_rows(m: int) -> int:
    """The kernel's row block for m rows of x: 1, or 16 / 32 / 64 (``tl.dot``'s smallest is 16)."""
    return 1 if m == 1 else max(16, triton.next_power_of_2(m))


def default_linear_config(m: int, n: int, k: int, itemsize: int = 2) -> LinearConfig:
    """The config for m rows against weights of n rows in all (k columns) of ``itemsize``
    bytes: a static table, picked before capture, from a sweep on an H100 of Llama-1B/8B's
    shapes at 1, 8 and 32 rows (benchmarks/probes/probe_linear.py at d481a37): one row, 4 x
    1024 tiles (narrow programs: 32k+ of them keep every SM's loads in flight; 8 warps for
    outputs of 2048 or fewer); up to 32 rows, ``tl.dot`` tiles of 64 x 128 for wide outputs
    (gate/up, the LM head), 32 x 256 for a q/k/v group, 16 x 256 for the rest, three stages
    of loads in flight. 33 to 64 rows (not swept) and fp32 take 16 x 128 tiles in two stages:
    64 rows with the 16 x 256 tiles in three stages asked for 240 KB of shared memory on the
    H100 (232 KB there)."""
    if m == 1:
        return LinearConfig(block_n=4, block_k=1024, num_warps=8 if n <= 2048 else 4)
    if block_rows(m) > 32 or itemsize > 2:
        return LinearConfig(block_n=16, block_k=128, num_stages=2)
    if n >= 16384:
        return LinearConfig(block_n=64, block_k=128, num_stages=3)
    if n >= 3072:
        return LinearConfig(block_n=32, block_k=256, num_stages=3)
    return LinearConfig(block_n=16, block_k=256, num_stages=3)


def small_linear(x: torch.Tensor, weights: list[torch.Tensor] | tuple[torch.Tensor, ...],
                 biases: list[torch.Tensor] | tuple[torch.Tensor, ...] | None = None, *,
                 config: LinearConfig | None = None, constant_weights: bool = False,
                 gate: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6,
                 norm_offset: bool = False, residual: torch.Tensor | None = None,
                 activation: str = "silu") -> list[torch.Tensor]:
    """``[x @ w.T (+ b) for w, b in zip(weights, biases)]`` in one launch.

    x:       [M, K], 1 <= M <= 64, contiguous rows (any row stride).
    weights: 1 to 3 tensors [N_i, K] of x's dtype (fp16 / bf16 / fp32), contiguous rows.
    biases:  None, or one [N_i] tensor per weight.
    constant_weights: no kernel launched before this one in the stream writes the weights
               (a model's parameters): a programmatic dependent launch then loads its first
               weight tile before it waits for the kernel before it.
    gate:    None, or [M, K] of x's dtype (contiguous rows, any row stride): the input is
               then act(gate) * x.
    activation: act, "silu" (SwiGLU) or "gelu_tanh" (GeGLU: gelu's tanh approximation).
    norm_weight: None, or [K] (x's dtype or fp32): the input is then x under an RMSNorm,
               x / sqrt(mean(x**2) + norm_eps) * w (w: norm_weight, or 1 + norm_weight
               where ``norm_offset``); norm_eps a float > 0.
    residual: None, or [M, N] of x's dtype (one weight only): returned is residual + x @ w.T (+ b).
    Returns new [M, N_i] tensors of x's dtype. The launch is a programmatic dependent one
    (PDL) on sm_90+ where GRAPHRT_PDL=1 or inside ``_checks.pdl_launches(True)``.
    """
    if not isinstance(constant_weights, bool):
        raise TypeError(f"constant_weights must be a bool, got {type(constant_weights).__name__}")
    check_tensor("x", x, dim=2)
    check_runnable(x.device)
    weights = list(weights)
    if not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"weights must hold 1 to {MAX_WEIGHTS} tensors, got {len(weights)}")
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"x must have 1 to {MAX_ROWS} rows (past that use torch's matmul), got {m}")
    for i, w in enumerate(weights):
        check_tensor(f"weights[{i}]", w, dim=2, dtypes=(x.dtype,), device=x.device)
        if w.shape[1] != k:
            raise ValueError(f"weights[{i}] has {w.shape[1]} columns, x has {k}")
        if w.shape[0] < 1:
            raise ValueError(f"weights[{i}] has no rows")
    if biases is not None:
        biases = list(biases)
        if len(biases) != len(weights):
            raise ValueError(f"biases must hold one tensor per weight ({len(weights)}), got {len(biases)}")
        for i, (b, w) in enumerate(zip(biases, weights)):
            check_tensor(f"biases[{i}]", b, dim=1, dtypes=(x.dtype,), device=x.device)
            if b.shape[0] != w.shape[0]:
                raise ValueError(f"biases[{i}] has {b.shape[0]} entries, weights[{i}] {w.shape[0]} rows")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if gate is not None:
        check_tensor("gate", gate, dim=2, dtypes=(x.dtype,), device=x.device)
        if tuple(gate.shape) != (m, k):
            raise ValueError(f"gate must have x's shape ({m}, {k}), got {tuple(gate.shape)}")
    if not isinstance(norm_offset, bool):
        raise TypeError(f"norm_offset must be a bool, got {type(norm_offset).__name__}")
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, dim=1, dtypes=(x.dtype, torch.float32), device=x.device)
        if norm_weight.shape[0] != k:
            raise ValueError(f"norm_weight must have x's {k} columns, got {norm_weight.shape[0]}")
        if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) or not 0 < norm_eps < 1:
            raise ValueError(f"norm_eps must be a float in (0, 1), got {norm_eps!r}")
    if residual is not None:
        if len(weights) != 1:
            raise ValueError(f"a residual comes with one weight, got {len(weights)}")
        check_tensor("residual", residual, dim=2, dtypes=(x.dtype,), device=x.device)
        if tuple(residual.shape) != (m, weights[0].shape[0]):
            raise ValueError(f"residual must have shape ({m}, {weights[0].shape[0]}), got {tuple(residual.shape)}")
    cfg = config or default_linear_config(m, sum(w.shape[0] for w in weights), k, x.element_size())
    if not isinstance(cfg, LinearConfig):
        raise TypeError(f"config must be a LinearConfig, got {type(cfg).__name__}")
    bm = block_rows(m)
    if bm > 1 and cfg.block_n < 16:
        raise ValueError(f"config.block_n must be >= 16 for {m} rows (tl.dot), got {cfg.block_n}")
    outs = [x.new_empty(m, w.shape[0]) for w in weights]
    pdl = pdl_supported(x.device)
    pad = 3 - len(weights)
    w3 = weights + [weights[0]] * pad
    b3 = (biases if biases is not None else weights[:1] * len(weights)) + [weights[0]] * pad
    y3 = outs + [outs[0]] * pad
    n3 = [w.shape[0] for w in weights] + [0] * pad
    grid = (sum(triton.cdiv(n, cfg.block_n) for n in n3),)
    _linear_kernel[grid](
        x, x if gate is None else gate, x if norm_weight is None else norm_weight,
        float(norm_eps) if norm_weight is not None else 0.0, x if residual is None else residual, *w3, *b3, *y3,
        m, *n3, k, x.stride(0), 0 if gate is None else gate.stride(0), 0 if residual is None else residual.stride(0),
        *(w.stride(0) for w in w3), *(y.stride(0) for y in y3),
        NUM_W=len(weights), BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_BIAS=biases is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",      # fp32 as torch's matmul: no tf32
        PDL=pdl, PREFETCH=pdl and constant_weights, GATED=0 if gate is None else ACTIVATIONS[activation],
        NORM=0 if norm_weight is None else 2 if norm_offset else 1, RESIDUAL=residual is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, launch_pdl=pdl,
    )
    return outs
