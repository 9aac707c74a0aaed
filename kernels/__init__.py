"""Triton kernels of graphrt and their launchers.

Every launcher reads per-step values from an ``AttentionMetadata`` of device tensors and
sizes its grid from capacities, so a launch can be captured in a CUDA graph once and
replayed for any step that fits. On CPU tensors the kernels run under Triton's
interpreter: set ``TRITON_INTERPRET=1`` before ``triton`` is first imported.

The kernel modules load on first use: Triton picks compiled or interpreted kernels when
they are defined, and this keeps ``import graphrt`` from making that choice early (the
CLI makes it after looking for a GPU).
"""

import importlib

from .metadata import AttentionMetadata

_LAZY = {
    "paged_attention": "paged_attention", "split_workspace": "paged_attention", "KernelConfig": "paged_attention",
    "default_config": "paged_attention", "COMPOSITIONS": "paged_attention",
    "write_kv": "kv_write", "reference": None,
}

__all__ = ["AttentionMetadata", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'graphrt.kernels' has no attribute {name!r}")
    module = importlib.import_module(f".{_LAZY[name] or name}", __name__)
    value = module if _LAZY[name] is None else getattr(module, name)
    globals()[name] = value
    return value
