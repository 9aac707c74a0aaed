"""graphrt: paged-KV attention built for CUDA-graph capture and host-sync-free replay."""

import importlib

from graphrt.config import RuntimeConfig
from graphrt.kernels.metadata import AttentionMetadata
from graphrt.sampling import SamplingParams
from graphrt.step import SeqStep, Step, build_metadata, validate_ranges

__version__ = "0.1.0"

# The runtime imports the kernels, and Triton fixes compiled vs interpreted mode when they
# are defined; loading it on first use lets `import graphrt` happen before that choice.
_LAZY = {"Runtime": "graphrt.runtime", "StepContext": "graphrt.runtime", "StepInfo": "graphrt.runtime",
         "ReferenceRunner": "graphrt.checking"}

__all__ = ["AttentionMetadata", "RuntimeConfig", "SamplingParams", "SeqStep", "Step", "build_metadata", "validate_ranges", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'graphrt' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
