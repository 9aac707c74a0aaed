"""Compile, in parallel processes, the Triton kernel variants a capture is about to launch.

From a cold Triton cache, capture spends most of its time compiling one kernel variant
after another in one process (Triton holds the GIL while it compiles, so threads do not
help). ``precompile(runs)`` instead:

1. runs each step function once with Triton's ``jit_cache_hook`` set: every launch of a
   variant this process has not compiled yet is recorded (its specialization data, the
   JSON Triton's ``JITFunction.preload`` takes) and skipped, neither compiled nor launched
   (the outputs of that pass are garbage; the torch ops around the kernels run as usual);
2. starts fresh worker processes compiling all but the largest variant for the same GPU
   target, and meanwhile loads the largest one in this process (``preload``). Fast means
   Triton's on-disk cache already held it, and likely the rest: the workers are stopped
   and the rest load here one by one. Slow (it compiled) means a cold cache: the workers
   fill the on-disk cache, and then everything loads here.

Correctness never rests on the pool: the kernels a capture launches are always the ones
this process loads or compiles through Triton's own path; a variant a worker failed on, or
compiled under a different cache key, is simply compiled here.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

# A variant whose preload takes longer than this was compiled, not loaded from the cache.
_LOADED_SECONDS = 0.5


@dataclass(frozen=True)
class Variant:
    module: str          # the kernel's module, e.g. "graphrt.kernels.paged_attention"
    qualname: str        # its name in the module
    data: str            # Triton's specialization data (JSON)


@dataclass
class PrecompileReport:
    variants: int = 0            # kernel variants the step functions needed that were not in memory
    compiled_in_pool: int = 0    # of them, sent to the worker processes
    workers: int = 0
    failed_in_pool: int = 0      # compiled here instead
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)


@contextlib.contextmanager
def _recording(found: dict[str, Variant]):
    """Triton's jit_cache_hook records each variant about to compile and skips it."""
    from triton import knobs

    def hook(*, key, fn, compile, **_):
        found.setdefault(str(key) + fn.name, Variant(str(fn.module), fn.name, compile["specialization_data"]))
        return True              # skip: no compile, no launch

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook = previous


def collect(runs: Iterable[Callable[[], Any]]) -> list[Variant]:
    """The kernel variants that running each of ``runs`` would compile (none is compiled
    or launched while they run)."""
    found: dict[str, Variant] = {}
    with _recording(found):
        for run in runs:
            run()
    return list(found.values())


def _kernel(variant: Variant):
    obj = importlib.import_module(variant.module)
    for part in variant.qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _listify_free(value: Any) -> Any:
    return tuple(_listify_free(v) for v in value) if isinstance(value, list) else value


def compile_variant(variant: Variant, target: tuple) -> None:
    """Compile one variant for ``target`` ((backend, arch, warp_size)) into Triton's
    on-disk cache, without a GPU: what ``JITFunction.preload`` does, up to the point where
    it needs the device. A worker's entry point."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    fn = _kernel(variant)
    obj = json.loads(variant.data)
    constexprs = {
        tuple(k): (tl.dtype(v) if tl.dtype.is_dtype(v) else
                   tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v)
        for k, v in zip(obj["constant_keys"], obj["constant_vals"])
    }
    attrs = {tuple(k): v for k, v in zip(obj["attrs_keys"], obj["attrs_vals"])}
    signature = {k: _listify_free(v) for k, v in obj["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in obj["options"].items()}
    gpu = GPUTarget(*target)
    options = make_backend(gpu).parse_options(options)
    triton.compile(ASTSource(fn, signature, constexprs, attrs), target=gpu, options=options.__dict__)


class _Pool:
    """Worker processes compiling shares of a variant list, started at once: ``finish``
    waits for them and returns the failures, ``stop`` ends them early. The workers are
    plain subprocesses (``python -c``), not multiprocessing's: spawning those would import
    the caller's main script again in every worker."""

    def __init__(self, variants: list[Variant], target: tuple, workers: int):
        import subprocess
        import sys
        import tempfile

        self._tmp = tempfile.TemporaryDirectory(prefix="graphrt-precompile-")
        self._jobs = []
        for i in range(workers):
            share = variants[i::workers]
            if not share:
                continue
            path = os.path.join(self._tmp.name, f"share{i}.json")
            with open(path, "w") as f:
                json.dump(dict(target=list(target), variants=[v.__dict__ for v in share]), f)
            code = "from graphrt.capture.precompile import _worker; _worker()"
            # output to files, not pipes: nobody reads a pipe before the workers end, and a
            # full one would stall its worker
            with open(path + ".out", "w") as out, open(path + ".err", "w") as err:
                job = subprocess.Popen([sys.executable, "-c", code, path], stdout=out, stderr=err)
            self._jobs.append((share, job, path))

    def finish(self) -> list[str]:
        """One message per variant that failed, once every worker has ended."""
        failures: list[str] = []
        for share, job, path in self._jobs:
            job.wait()
            with open(path + ".out") as f_out, open(path + ".err") as f_err:
                out, err = f_out.read(), f_err.read()
            if job.returncode != 0:
                failures += [f"{v.qualname}: worker exited with {job.returncode}: {err.strip()[-300:]}" for v in share]
                continue
            failures += json.loads(out.strip().splitlines()[-1])
        self._tmp.cleanup()
        return failures

    def stop(self) -> None:
        """End the workers now (what they wrote to the cache stays: Triton writes each
        file whole, by rename)."""
        for _, job, _ in self._jobs:
            job.kill()
        for _, job, _ in self._jobs:
            job.wait()
        self._tmp.cleanup()


def compile_in_pool(variants: list[Variant], target: tuple, workers: int) -> list[str]:
    """Compile ``variants`` in ``workers`` fresh Python processes (each a share, one after
    another); returns one message per variant that failed."""
    return _Pool(variants, target, workers).finish()


def _worker() -> None:
    """A worker process: compile the variants of the share file named in argv[1] and
    print the failures as one JSON line."""
    import sys

    with open(sys.argv[1]) as f:
        job = json.load(f)
    failures = []
    for item in job["variants"]:
        variant = Variant(**item)
        try:
            compile_variant(variant, tuple(job["target"]))
        except Exception as exc:
            failures.append(f"{variant.qualname}: {type(exc).__name__}: {exc}"[:300])
    print(json.dumps(failures))


def precompile(runs: Iterable[Callable[[], Any]], *, max_workers: int | None = None) -> PrecompileReport:
    """Run ``runs`` with kernels skipped to find the variants they need, compile the
    missing ones in parallel processes, and load them all into this process (module doc).
    CUDA only."""
    from triton.runtime import driver

    t0 = time.perf_counter()
    report = PrecompileReport()
    variants = collect(runs)
    report.variants = len(variants)
    if variants:
        # Probe with the largest kernel: it takes seconds to compile and milliseconds to
        # load from the cache, where a small one may compile in under the threshold. The
        # workers start on the others meanwhile, so a cold cache loses no time to the probe.
        probe = max(variants, key=lambda v: len(_kernel(v).src))
        rest = [v for v in variants if v is not probe]
        pool = None
        if rest:
            gpu = driver.active.get_current_target()
            report.workers = max(1, min(len(rest), max_workers or 8, os.cpu_count() or 1))
            pool = _Pool(rest, (gpu.backend, gpu.arch, gpu.warp_size), report.workers)
        t = time.perf_counter()
        try:
            _kernel(probe).preload(probe.data)
        except BaseException:
            if pool is not None:
                pool.stop()
            raise
        if pool is not None:
            if time.perf_counter() - t > _LOADED_SECONDS:            # a cold cache
                report.compiled_in_pool = len(rest)
                report.failures = pool.finish()
                report.failed_in_pool = len(report.failures)
            else:                                                   # a warm one: load here
                pool.stop()
                report.workers = 0
        for v in rest:
            _kernel(v).preload(v.data)          # from the on-disk cache (or compiled here)
    report.seconds = time.perf_counter() - t0
    return report
