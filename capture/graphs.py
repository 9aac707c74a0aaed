"""Capture and replay: one CUDA graph per bucket, all in one memory pool."""

from __future__ import annotations

import contextlib
import gc
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .buckets import Bucket, BucketIndex
from .compiled import CompileError

GuardFn = Callable[[], Sequence[tuple[str, torch.Tensor]]]
FastGuardFn = Callable[[], Sequence[torch.Tensor]]


@dataclass
class CapturedGraph:
    bucket: Bucket
    graph: torch.cuda.CUDAGraph | None   # None in a GraphSet without CUDA graphs: ``run`` runs the step
    outputs: Any                # what the step function returned while capturing: static tensors
    seconds: float              # warm-up + capture time
    pool_bytes: int             # growth of reserved memory while capturing (new graph-pool segments)
    run: Callable[[], Any] | None = None     # the bucket's step, where there is no graph to replay


class CaptureError(RuntimeError):
    """Some buckets could not be captured (out of GPU memory). The graphs captured before
    and after them stay usable; steps that only the failed buckets would have served run
    in a larger captured bucket or eagerly. ``failures``: [(bucket, bytes asked or None)]."""

    def __init__(self, failures: list[tuple[Bucket, int | None]], captured: int, total: int):
        self.failures = failures
        parts = [f"{b} (asked for {_gib(n)})" if n else f"{b}" for b, n in failures]
        super().__init__(f"graphrt: out of GPU memory capturing {', '.join(parts)}; {captured} of {total} buckets "
                         f"captured, the rest run eagerly. Lower max_num_tokens / max_num_seqs or capture fewer "
                         f"buckets.")


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2 ** 30:.2f} GiB"


def _out_of_memory(exc: BaseException) -> torch.OutOfMemoryError | None:
    """The OOM behind ``exc``: itself, or what it was raised while handling (ending a
    capture after an allocation failed raises its own error)."""
    seen = 0
    while exc is not None and seen < 4:
        if isinstance(exc, torch.OutOfMemoryError):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _asked_bytes(oom: torch.OutOfMemoryError) -> int | None:
    """Bytes of the failed allocation, from the allocator's message ("Tried to allocate 2.00 GiB")."""
    m = re.search(r"[Tt]ried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)", str(oom))
    if not m:
        return None
    return int(float(m.group(1)) * 1024 ** ["B", "KiB", "MiB", "GiB", "TiB"].index(m.group(2)))


class GraphSet:
    """Owns the graphs. ``guard`` names every tensor the graphs read by address (caches,
    arena, weights): a replay after any of them was replaced or reallocated is refused.
    ``fast_guard``, when given, returns the same tensors in the same order without names
    (None, or anything else not a tensor, where one is gone); each step compares their
    addresses, and only a mismatch pays for ``guard`` to name what moved.

    ``cuda_graphs=False`` (a machine without CUDA, for compiled steps): "capture" runs each
    bucket's step once (its compile) and keeps the function; a "replay" runs it again over
    the bucket's buffers, the same code path a graph would replay, padding included."""

    def __init__(self, guard: GuardFn, fast_guard: FastGuardFn | None = None, *, cuda_graphs: bool = True):
        self.cuda_graphs = cuda_graphs
        self.graphs: dict[Bucket, CapturedGraph] = {}
        self.index = BucketIndex([])
        self.pool = None
        self._guard = guard
        self._fast_guard = fast_guard
        self._addresses: list[int] | None = None     # of the guarded tensors, at capture
        self.precompile_report = None                 # capture.precompile.PrecompileReport of the last capture

    def _guard_holds(self) -> bool:
        if self._fast_guard is not None:
            try:
                return list(map(torch.Tensor.data_ptr, self._fast_guard())) == self._addresses
            except TypeError:           # an entry that is no tensor (a deleted weight): not as captured
                return False
        return [t.data_ptr() for _, t in self._guard()] == self._addresses

    def check_guard(self) -> None:
        """Raise RuntimeError naming the guarded tensors that moved since capture."""
        if self._addresses is None or self._guard_holds():
            return
        now = self._guard()
        moved = [name for (name, t), a in zip(now, self._addresses) if t.data_ptr() != a]
        what = ", ".join(moved[:4]) or f"the set of guarded tensors ({len(self._addresses)} -> {len(now)})"
        raise RuntimeError(f"graphrt: {what} moved or was replaced since capture; the captured graphs would "
                           f"read stale memory. Put new values in place with .copy_(), or capture again.")

    def capture(self, buckets: Sequence[Bucket], prepare: Callable[[Bucket], Callable[[], Any]], *,
                warmup: int = 1, trace=None, progress: Callable[[CapturedGraph], None] | None = None,
                precompile: bool = False, precompile_key: str | None = None) -> None:
        """Capture every bucket, largest first. ``prepare(bucket)`` stages an all-padding step
        for the bucket and returns the function that runs one step of it. Graphs captured
        earlier are dropped when a tensor they read has moved since (capturing again is
        the way to go on after replacing a cache or a weight). ``precompile``: first find
        the Triton kernel variants every bucket needs and compile the missing ones in
        parallel processes (``capture.precompile``); ``self.precompile_report`` says what
        that did. ``precompile_key``: what besides the buckets decides the variants (shapes,
        dtypes, the model), naming the manifest that lets a warm start skip that search."""
        if self._addresses is not None and not self._guard_holds():
            self.graphs.clear()
            self.index = BucketIndex([])
        if not self.cuda_graphs:
            self._run_without_graphs(buckets, prepare, progress)
            return
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        self.precompile_report = None
        if precompile:
            from .precompile import precompile as compile_variants

            def runs():
                # each kind's largest and smallest bucket first: between them they need
                # most of the variants, which then reach the workers early
                ordered = sorted(set(buckets), reverse=True)
                ends = []
                for kind in ("mixed", "verify", "decode"):
                    same = [b for b in ordered if b.kind == kind]
                    ends += list(dict.fromkeys(same[:1] + same[-1:]))
                for bucket in ends + [b for b in ordered if b not in ends]:
                    yield prepare(bucket)

            stream.wait_stream(torch.cuda.current_stream())
            try:
                key = None if precompile_key is None else f"{precompile_key}|{sorted(set(buckets))}"
                with torch.cuda.stream(stream):
                    self.precompile_report = compile_variants(runs(), key=key)
            except CompileError:          # a compiled step refused: capturing it would replay it wrong
                raise
            except Exception as exc:      # an optimisation only: capture compiles what it needs anyway
                from .precompile import PrecompileReport

                self.precompile_report = PrecompileReport(failures=[f"precompile stopped: {type(exc).__name__}: "
                                                                    f"{exc}"[:300]])
            torch.cuda.current_stream().wait_stream(stream)
        gc.collect()
        gc.freeze()     # torch.cuda.graph collects garbage on entry: keep that cheap across many buckets
        failures: list[tuple[Bucket, int | None]] = []
        # variants compiled (or loaded) by the capture itself; after a manifest's variants
        # were loaded, any means the manifest missed one
        missed: list[str] = []
        watch = contextlib.nullcontext()
        if self.precompile_report is not None and self.precompile_report.from_manifest:
            from .precompile import watch_compiles

            watch = watch_compiles(missed)
        try:
            with watch:
                for bucket in sorted(buckets, reverse=True):
                    t0 = time.perf_counter()
                    graph = None
                    try:
                        run = prepare(bucket)
                        stream.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(stream):
                            for _ in range(warmup):      # compiles kernels and warms the allocator outside the graph
                                run()
                        torch.cuda.current_stream().wait_stream(stream)
                        # torch.cuda.graph empties the allocator's cache on entry; doing it here
                        # first makes the growth below the graph pool's alone (not warm-up's).
                        torch.cuda.synchronize()
                        torch.cuda.empty_cache()
                        reserved = torch.cuda.memory_reserved()
                        graph = torch.cuda.CUDAGraph()
                        span = trace.range("capture", bucket=bucket) if trace else contextlib.nullcontext()
                        with span, torch.cuda.graph(graph, pool=self.pool, stream=stream):
                            outputs = run()
                        torch.cuda.synchronize()
                    except Exception as exc:
                        oom = _out_of_memory(exc)
                        if oom is None:
                            raise
                        # Drop the partial graph (its pool blocks go back) and go on with the
                        # smaller buckets, which may fit.
                        del graph
                        torch.cuda.synchronize()
                        failures.append((bucket, _asked_bytes(oom)))
                        self.graphs.pop(bucket, None)
                        continue
                    captured = CapturedGraph(bucket, graph, outputs, time.perf_counter() - t0,
                                             torch.cuda.memory_reserved() - reserved)
                    self.graphs[bucket] = captured
                    if progress:
                        progress(captured)
        finally:
            gc.unfreeze()
            self.index = BucketIndex(list(self.graphs))
            self._addresses = [t.data_ptr() for _, t in self._guard()]
            if missed:
                from .precompile import forget_manifest

                forget_manifest(self.precompile_report)
        if failures:
            raise CaptureError(failures, captured=len(buckets) - len(failures), total=len(buckets))

    def _run_without_graphs(self, buckets: Sequence[Bucket], prepare: Callable[[Bucket], Callable[[], Any]],
                            progress: Callable[[CapturedGraph], None] | None) -> None:
        self.precompile_report = None
        try:
            for bucket in sorted(buckets, reverse=True):
                t0 = time.perf_counter()
                run = prepare(bucket)
                outputs = run()
                self.graphs[bucket] = CapturedGraph(bucket, None, outputs, time.perf_counter() - t0, 0, run)
                if progress:
                    progress(self.graphs[bucket])
        finally:
            self.index = BucketIndex(list(self.graphs))
            self._addresses = [t.data_ptr() for _, t in self._guard()]

    def pick(self, num_seqs: int, num_tokens: int, is_decode: bool, q_len: int | None = None) -> CapturedGraph | None:
        """The captured graph of the smallest bucket that fits, or None (``q_len``: every
        sequence's query length where they are all equal, for verify buckets)."""
        bucket = self.index.pick(num_seqs, num_tokens, is_decode, q_len)
        return None if bucket is None else self.graphs[bucket]

    def replay(self, captured: CapturedGraph) -> Any:
        """Replay on the current stream; the caller runs ``check_guard`` first (before it
        stages anything, so a refused step leaves the buffers as they were)."""
        if captured.graph is None:
            return captured.run()
        captured.graph.replay()
        return captured.outputs

