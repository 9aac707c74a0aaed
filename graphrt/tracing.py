"""NVTX ranges in the ``graphrt`` domain, for Nsight Systems timelines.

Off (the default) ``range`` hands back one shared no-op context and formats nothing.
"""

from __future__ import annotations

import contextlib

_NULL = contextlib.nullcontext()


class Tracer:
    """NVTX ranges of the runtime (``enabled``), or no-ops."""

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        if enabled:
            import nvtx

            self._annotate = nvtx.annotate

    def range(self, name: str, **fields):
        """A context manager spanning ``name``, with ``fields`` written into the range's
        message (e.g. ``replay decode bucket=8 seqs=5 tokens=5``)."""
        if not self.enabled:
            return _NULL
        message = " ".join([name, *(f"{k}={v}" for k, v in fields.items())])
        return self._annotate(message, domain="graphrt")
