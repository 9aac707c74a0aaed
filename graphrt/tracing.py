"""NVTX ranges in the ``graphrt`` domain, for Nsight Systems timelines.

Off (the default) ``range`` hands back one shared no-op context and formats nothing.
"""

from __future__ import annotations

import contextlib

_NULL = contextlib.nullcontext()


class _Range:
    """A reusable context manager pushing one prebuilt NVTX range of a domain."""

    __slots__ = ("_domain", "_attributes")

    def __init__(self, domain, attributes):
        self._domain = domain
        self._attributes = attributes

    def __enter__(self):
        self._domain.push_range(self._attributes)
        return self

    def __exit__(self, *exc) -> bool:
        self._domain.pop_range()
        return False


class Tracer:
    """NVTX ranges of the runtime (``enabled``), or no-ops. Each distinct range (name and
    fields) gets its message and event attributes once, from the ``graphrt`` domain, and is
    reused: a step's ranges repeat from step to step, where ``nvtx.annotate`` built both
    anew on every call."""

    _MAX_RANGES = 4096          # distinct ranges kept (a step has a few per bucket)

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        if enabled:
            import nvtx

            self._domain = nvtx.get_domain("graphrt")
            self._ranges: dict[tuple, _Range] = {}

    def range(self, name: str, **fields):
        """A context manager spanning ``name``, with ``fields`` written into the range's
        message (e.g. ``replay decode bucket=8 seqs=5 tokens=5``)."""
        if not self.enabled:
            return _NULL
        key = (name, *fields.items())
        r = self._ranges.get(key)
        if r is None:
            if len(self._ranges) >= self._MAX_RANGES:
                self._ranges.clear()
            message = " ".join([name, *(f"{k}={v}" for k, v in fields.items())])
            r = self._ranges[key] = _Range(self._domain, self._domain.get_event_attributes(message=message))
        return r
