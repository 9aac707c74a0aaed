"""Argument checks shared by the launchers (each raises naming the argument and the limit),
and what the device lets them launch."""

from __future__ import annotations

import contextlib
import contextvars
import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8 = torch.float8_e4m3fn
CACHE_DTYPES = (*FLOAT_DTYPES, FP8)      # a KV cache: the inputs' dtype, or fp8 e4m3 with scales


def check_tensor(name: str, t: object, *, dim: int, dtypes=FLOAT_DTYPES, device: torch.device | None = None,
                 last_contiguous: bool = True) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dims, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (same device as the metadata)")
    if last_contiguous and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dim, got strides {t.stride()}")
    return t


def check_shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_runnable(device: torch.device) -> None:
    """Triton compiles for CUDA devices; CPU tensors need its interpreter."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError("graphrt kernels on CPU tensors run under Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before triton is first imported")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"graphrt kernels run on cuda (or cpu through the interpreter), got {device}")


def check_same_dtype(q: torch.Tensor, **others: object) -> None:
    """Each of ``others`` (tensors) has q's dtype; the message names both."""
    for name, t in others.items():
        if isinstance(t, torch.Tensor) and t.dtype != q.dtype:
            raise TypeError(f"{name} is {t.dtype} but q is {q.dtype}: q, {', '.join(others)} share one dtype")


# head_dim the attention kernel is known to compile for and compute right on the GPU
# (benchmarks/probes/probe_head_dims.py on the H200): 8 fails to compile (``tl.dot`` needs the
# padded head dimension, the next power of two, to be at least 16); 9..256 work. Past 256
# the dimension pads to 512: one such shape compiled in the probe, the rest are untested,
# so they are refused rather than left to fail at the first launch.
MIN_HEAD_DIM, MAX_HEAD_DIM = 9, 256


def check_head_dim(head_dim: object, name: str = "head_dim") -> None:
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{name} must be an int in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}] (what the attention kernel "
                         f"compiles for), got {head_dim!r}")


def check_cache_dtypes(dtype: torch.dtype, name: str, k_cache: object, v_cache: object) -> bool:
    """Both caches ``dtype`` (the inputs', named ``name``) or both fp8 e4m3; True for fp8."""
    kd, vd = (getattr(c, "dtype", None) for c in (k_cache, v_cache))
    if kd == FP8 and vd == FP8:
        return True
    for cache_name, d in (("k_cache", kd), ("v_cache", vd)):
        if d is not None and d != dtype:
            raise TypeError(f"{cache_name} is {d} but {name} is {dtype}: the caches are {name}'s dtype, or both "
                            f"torch.float8_e4m3fn (with k_scale and v_scale)")
    return False


def check_kv_scales(fp8: bool, k_scale: object, v_scale: object, num_kv_heads: int, device: torch.device) -> None:
    """fp8 caches take [Hkv] float32 scales on the device; other caches none."""
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not fp8:
            if s is not None:
                raise ValueError(f"{name} is for fp8 caches; these caches are not fp8")
            continue
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{name} must be a [{num_kv_heads}] float32 tensor for fp8 caches, got {type(s).__name__}")
        if s.dtype != torch.float32 or tuple(s.shape) != (num_kv_heads,) or s.device != device or \
                (num_kv_heads > 1 and s.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous [{num_kv_heads}] float32 tensor on {device}, got "
                             f"{tuple(s.shape)} {s.dtype} on {s.device}")


_PDL_ON: contextvars.ContextVar[bool | None] = contextvars.ContextVar("graphrt_pdl", default=None)


@contextlib.contextmanager
def pdl_launches(on: bool):
    """Inside the block, launchers not told otherwise use PDL where ``on`` (and supported),
    whatever GRAPHRT_PDL says: what ``CompileOptions(pdl=...)`` wraps a compiled step in."""
    if not isinstance(on, bool):
        raise TypeError(f"pdl_launches(on) takes a bool, got {type(on).__name__}")
    token = _PDL_ON.set(on)
    try:
        yield
    finally:
        _PDL_ON.reset(token)


def pdl_supported(device: torch.device, wanted: bool | None = None) -> bool:
    """Whether to launch kernels on ``device`` as programmatic dependents: ``wanted`` (None:
    as the enclosing ``pdl_launches`` says, else whether the environment's GRAPHRT_PDL is
    "1"), on a CUDA device of compute capability 9.0 or later, outside Triton's interpreter."""
    if wanted is None:
        wanted = _PDL_ON.get()
    if wanted is None:
        wanted = os.environ.get("GRAPHRT_PDL") == "1"
    if not wanted or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    ok = _PDL.get(index)
    if ok is None:
        ok = _PDL[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return ok


_PDL: dict[int, bool] = {}
