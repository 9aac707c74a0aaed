"""CUDA graph capture and replay of graphrt steps: size buckets, one shared memory pool,
largest-first capture after a warm-up, replay in the smallest bucket that fits, and a
guard that refuses to replay graphs whose tensors were replaced."""

from .buckets import Bucket, BucketIndex, default_buckets, make_buckets
from .graphs import CaptureError, CapturedGraph, GraphSet

__all__ = ["Bucket", "BucketIndex", "CaptureError", "CapturedGraph", "GraphSet", "default_buckets", "make_buckets"]
