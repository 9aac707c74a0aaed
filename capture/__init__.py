"""CUDA graph capture and replay of graphrt steps: size buckets, one shared memory pool,
largest-first capture after a warm-up, replay in the smallest bucket that fits, and a
guard that refuses to replay graphs whose tensors were replaced; model steps compiled per
bucket (``compiled``)."""

from .buckets import Bucket, BucketIndex, default_buckets, make_buckets
from .compiled import CompileError, CompileOptions, CompileRecord, StepCompiler
from .graphs import CaptureError, CapturedGraph, GraphSet

__all__ = ["Bucket", "BucketIndex", "CaptureError", "CapturedGraph", "CompileError", "CompileOptions", "CompileRecord",
           "GraphSet", "StepCompiler", "default_buckets", "make_buckets"]
