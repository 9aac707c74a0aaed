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

            self.domain = nvtx.get_domain("graphrt")
            self._ranges: dict[tuple, _Range] = {}
            self._steps: dict[tuple, tuple] = {}

    def step_ranges(self, bucket, seqs: int, tokens: int, nbytes: int) -> tuple:
        """The event attributes of a step's three ranges (stage, copy, and replay or eager),
        built once per (bucket, seqs, tokens, bytes) and looked up with one key after that:
        the runtime pushes them on ``domain`` itself, so a traced step costs one lookup
        and three push/pop pairs."""
        key = (bucket, seqs, tokens, nbytes)
        r = self._steps.get(key)
        if r is None:
            if len(self._steps) >= self._MAX_RANGES:
                self._steps.clear()
            attributes = self.domain.get_event_attributes
            sizes = f"seqs={seqs} tokens={tokens}"
            run = f"replay bucket={bucket} {sizes}" if bucket is not None else f"eager {sizes}"
            r = self._steps[key] = (attributes(message=f"stage bucket={bucket} {sizes}"),
                                    attributes(message=f"copy bytes={nbytes}"), attributes(message=run))
        return r

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
            r = self._ranges[key] = _Range(self.domain, self.domain.get_event_attributes(message=message))
        return r
