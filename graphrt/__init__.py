"""graphrt: paged-KV attention built for CUDA-graph capture and host-sync-free replay."""

from graphrt.config import RuntimeConfig
from graphrt.kernels.metadata import AttentionMetadata
from graphrt.step import SeqStep, Step, build_metadata, validate_ranges

__version__ = "0.1.0"
__all__ = ["AttentionMetadata", "RuntimeConfig", "SeqStep", "Step", "build_metadata", "validate_ranges"]
