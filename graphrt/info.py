"""``graphrt info``: what this installation runs with, one line each — versions, the GPU,
whether the optional C helper ``graphrt._fast`` was built (and, where it was not, what its
build lacked), and which module the name ``kernels`` resolves to (transformers >= 5.25
imports the PyPI package of that name; a graphrt checkout's top-level ``kernels/`` must not
stand in for it)."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import shutil
import sysconfig


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def fast_helper() -> str:
    """"built, with copy_h2d", "built, without copy_h2d" (an older build), or "not built"
    with what the build needs that this machine lacks (a C compiler, Python's headers)."""
    try:
        fast = importlib.import_module("graphrt._fast")
    except ImportError:
        header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
        compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
        lacks = [what for what, ok in ((f"Python's headers ({header})", os.path.isfile(header)),
                                        (f"a C compiler ({compiler})", shutil.which(compiler) is not None)) if not ok]
        why = f"this machine lacks {' and '.join(lacks)}" if lacks else "the build failed (reinstall with pip -v)"
        return f"not built ({why}): steps are checked and packed in numpy, copied through torch"
    return "built, with copy_h2d" if hasattr(fast, "copy_h2d") else "built, without copy_h2d (rebuild: pip install .)"


def kernels_module() -> str:
    """Where ``import kernels`` leads from here: the PyPI package, or absent."""
    spec = importlib.util.find_spec("kernels")
    if spec is None:
        return "not installed"
    module = importlib.import_module("kernels")
    return f"{_version('kernels')} at {os.path.dirname(module.__file__ or '')}"


def collect() -> dict[str, str]:
    import torch

    import graphrt

    cuda = torch.cuda.is_available()
    return {
        "graphrt": f"{graphrt.__version__} at {os.path.dirname(graphrt.__file__)}",
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "kernels (PyPI)": kernels_module(),
        "nvtx": _version("nvtx"),
        "device": torch.cuda.get_device_name() if cuda else "no CUDA device: kernels run in Triton's interpreter",
        "graphrt._fast": fast_helper(),
    }


def run() -> int:
    for key, value in collect().items():
        print(f"{key:>15}: {value}")
    return 0
