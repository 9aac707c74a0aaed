"""Per-request sampling settings, checked on the host before anything is staged.

``SamplingParams`` is what a request asks for; ``SamplingParams.fill`` writes a batch of
them into the per-sequence arrays that ``graphrt.kernels.sampling.sample`` reads on the
device (in a step, those arrays are fields of the one pinned copy). The draw's counter
is the caller's: the token's index in its sequence is the natural one, so that a request
draws the same tokens whatever batch it shares, eagerly or in a replay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SEED_LIMIT = 2 ** 63         # seeds and counters are int64 on the device
MIN_TEMPERATURE = 1e-30      # below it (not 0), 1 / T is inf in float32 and (logit - max) / T NaN


@dataclass(frozen=True)
class SamplingParams:
    """temperature: 0 = greedy (the first largest logit), else the softmax's temperature.
    top_k:       keep the k largest logits (0 = off; ties at the k-th are all kept).
    top_p:       then keep the smallest top set holding this share of the mass, in (0, 1].
    min_p:       then keep tokens of probability >= min_p times the largest, in [0, 1).
    seed:        the request's key for its draws, an int in [0, 2**63)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"SamplingParams.{name} must be a float, got {type(v).__name__}")
            if not math.isfinite(v):
                raise ValueError(f"SamplingParams.{name} must be finite, got {v!r}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1), got {self.min_p!r}")
        for name, limit in (("top_k", 2 ** 31), ("seed", SEED_LIMIT)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"SamplingParams.{name} must be an int, got {type(v).__name__}")
            if not 0 <= v < limit:
                raise ValueError(f"SamplingParams.{name} must be in [0, {limit}), got {v!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"SamplingParams.temperature must be 0 (greedy) or >= {MIN_TEMPERATURE} (the kernel's "
                             f"1 / T must be finite in float32), got {self.temperature!r}")

    @staticmethod
    def check(params, rows: int) -> None:
        """``params`` holds at most ``rows`` SamplingParams (each checked when it was made)."""
        if len(params) > rows:
            raise ValueError(f"{len(params)} sampling settings for {rows} rows")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params[{i}] must be a SamplingParams, got {type(p).__name__}")

    @staticmethod
    def fill(params: "list[SamplingParams]", *, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
             min_p: np.ndarray, seed: np.ndarray, checked: bool = False) -> None:
        """Write ``params`` into the first ``len(params)`` entries of the arrays, and make
        the rest greedy (padding rows draw nothing that matters, at the least cost).
        ``checked``: the caller ran ``check`` (a step's packing, after ``Runtime.step``'s)."""
        if not checked:
            SamplingParams.check(params, temperature.shape[0])
        n = len(params)
        temperature[:n] = [p.temperature for p in params]
        top_k[:n] = [p.top_k for p in params]
        top_p[:n] = [p.top_p for p in params]
        min_p[:n] = [p.min_p for p in params]
        seed[:n] = [p.seed for p in params]
        temperature[n:], top_k[n:], top_p[n:], min_p[n:], seed[n:] = 0.0, 0, 1.0, 0.0, 0


GREEDY = SamplingParams(temperature=0.0)
