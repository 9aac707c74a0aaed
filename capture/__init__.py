"""CUDA graph capture and replay of graphrt steps (buckets, shared pool, eager fallback)."""
