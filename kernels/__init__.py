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
import importlib.util
import sys


def _hand_over_shadowed_name() -> bool:
    """This directory is graphrt.kernels. Imported under the top-level name "kernels", it
    was found through a graphrt checkout's root on sys.path (a script or ``python -m`` run
    from there), and it hides the PyPI package of that name, which transformers >= 5.25
    imports. Where that package is installed, the import is handed to it (True)."""
    from importlib.machinery import PathFinder
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = PathFinder.find_spec("kernels", [p for p in sys.path if Path(p or ".").resolve() != root])
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module               # what the import statement returns
    spec.loader.exec_module(module)
    return True


if __name__ != "kernels" or not _hand_over_shadowed_name():
    from .metadata import AttentionMetadata

_LAZY = {
    "paged_attention": "paged_attention", "split_workspace": "paged_attention", "KernelConfig": "paged_attention",
    "default_config": "paged_attention", "WINDOW_RULES": "paged_attention", "decode_splits": "paged_attention",
    "write_kv": "kv_write", "small_linear": "linear", "LinearConfig": "linear", "sample": "sampling", "greedy": "sampling", "kept_lowest": "sampling", "place_tokens": "speculative", "accept_greedy": "speculative", "accept_rejection": "speculative", "reference": None, "ops": None,
}

__all__ = ["AttentionMetadata", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'graphrt.kernels' has no attribute {name!r}")
    module_name = _LAZY[name] or name
    module = importlib.import_module(f".{module_name}", __name__)
    # Importing a submodule binds its name on this package (``paged_attention`` the module),
    # so bind every lazy name it serves, the function of the same name included.
    for lazy, source in _LAZY.items():
        if (source or lazy) == module_name:
            globals()[lazy] = module if source is None else getattr(module, lazy)
    return globals()[name]
