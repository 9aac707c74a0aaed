"""Compile, in parallel processes, the Triton kernel variants a capture is about to launch.

From a cold Triton cache, capture spends most of its time compiling one kernel variant
after another in one process (Triton holds the GIL while it compiles, so threads do not
help). ``precompile(runs)`` instead:

1. runs each step function once with Triton's ``jit_cache_hook`` set: every launch of a
   variant this process has not compiled yet is recorded (its specialization data, the
   JSON Triton's ``JITFunction.preload`` takes) and skipped, neither compiled nor launched
   (the outputs of that pass are garbage; the torch ops around the kernels run as usual);
2. hands all but the largest variant to worker processes (started before step 1, so that
   their imports overlap it) that compile for the same GPU target, and meanwhile loads the
   largest one in this process (``preload``). Fast means Triton's on-disk cache already
   held it, and likely the rest: the workers are stopped and the rest load here one by
   one. Slow (it compiled) means a cold cache: the workers fill the on-disk cache, and then
   everything loads here.

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
    phases: dict[str, float] = field(default_factory=dict)           # seconds: collect, probe, pool_wait, load
    compile_seconds: dict[str, float] = field(default_factory=dict)  # per variant in the pool, and imports


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
    """Worker processes that import Triton and graphrt's kernel modules as soon as they
    start, then wait on stdin for their share of the variants: started before the caller
    knows what to compile, they are ready by the time it does. ``assign`` hands out the
    shares, ``finish`` waits for the workers and returns the failures, ``stop`` ends them.
    The workers are plain subprocesses (``python -c``), not multiprocessing's: spawning
    those would import the caller's main script again in every worker."""

    MODULES = ("graphrt.kernels.paged_attention", "graphrt.kernels.kv_write")

    def __init__(self, target: tuple, workers: int):
        import subprocess
        import sys
        import tempfile

        self._tmp = tempfile.TemporaryDirectory(prefix="graphrt-precompile-")
        self._target = list(target)
        self._jobs: list[tuple[list[Variant], Any, str]] = []
        code = "from graphrt.capture.precompile import _worker; _worker()"
        for i in range(workers):
            path = os.path.join(self._tmp.name, f"worker{i}")
            # output to files, not pipes: nobody reads a pipe before the workers end, and a
            # full one would stall its worker
            with open(path + ".out", "w") as out, open(path + ".err", "w") as err:
                job = subprocess.Popen([sys.executable, "-c", code, *self.MODULES], stdin=subprocess.PIPE,
                                       stdout=out, stderr=err)
            self._jobs.append(([], job, path))

    def assign(self, variants: list[Variant]) -> None:
        """Send each worker its share (round robin; a worker without one exits)."""
        n = len(self._jobs)
        for i, (share, job, _) in enumerate(self._jobs):
            share += variants[i::n]
            try:
                job.stdin.write(json.dumps(dict(target=self._target, variants=[v.__dict__ for v in share])).encode())
                job.stdin.close()
            except OSError:                # the worker died while importing: finish reports it
                pass

    def finish(self) -> tuple[list[str], dict[str, float]]:
        """(one message per variant that failed, seconds per variant compiled), once every
        worker has ended."""
        failures: list[str] = []
        seconds: dict[str, float] = {}
        for share, job, path in self._jobs:
            job.wait()
            with open(path + ".out") as f_out, open(path + ".err") as f_err:
                out, err = f_out.read(), f_err.read()
            if job.returncode != 0 or not out.strip():
                failures += [f"{v.qualname}: worker exited with {job.returncode}: {err.strip()[-300:]}" for v in share]
                continue
            result = json.loads(out.strip().splitlines()[-1])
            failures += result["failures"]
            seconds.update(result["seconds"])
        self._tmp.cleanup()
        return failures, seconds

    def stop(self) -> None:
        """End the workers now (what they wrote to the cache stays: Triton writes each
        file whole, by rename)."""
        for _, job, _ in self._jobs:
            job.kill()
        for _, job, _ in self._jobs:
            job.wait()
            if job.stdin is not None and not job.stdin.closed:
                job.stdin.close()
        self._tmp.cleanup()


def compile_in_pool(variants: list[Variant], target: tuple, workers: int) -> list[str]:
    """Compile ``variants`` in ``workers`` fresh Python processes (each a share, one after
    another); returns one message per variant that failed."""
    pool = _Pool(target, workers)
    pool.assign(variants)
    return pool.finish()[0]


def _worker() -> None:
    """A worker process: import the modules named in argv, read its share (JSON) from
    stdin, compile it and print the failures and each variant's seconds as one JSON line."""
    import sys

    t0 = time.perf_counter()
    for name in sys.argv[1:]:
        importlib.import_module(name)
    import triton.compiler  # noqa: F401  (what compile_variant uses, loaded before the share comes)

    seconds = {f"(imports)@{os.getpid()}": time.perf_counter() - t0}
    job = json.loads(sys.stdin.read() or "{}")
    failures = []
    for i, item in enumerate(job.get("variants", [])):
        variant = Variant(**item)
        t = time.perf_counter()
        try:
            compile_variant(variant, tuple(job["target"]))
        except Exception as exc:
            failures.append(f"{variant.qualname}: {type(exc).__name__}: {exc}"[:300])
        seconds[f"{variant.qualname}#{i}@{os.getpid()}"] = time.perf_counter() - t
    print(json.dumps(dict(failures=failures, seconds=seconds)))


def precompile(runs: Iterable[Callable[[], Any]], *, max_workers: int | None = None) -> PrecompileReport:
    """Run ``runs`` with kernels skipped to find the variants they need, compile the
    missing ones in parallel processes, and load them all into this process (module doc).
    CUDA only. ``max_workers``: at most this many worker processes (default: one per CPU
    core but one, up to 16)."""
    from triton.runtime import driver

    t0 = time.perf_counter()
    report = PrecompileReport()
    gpu = driver.active.get_current_target()
    workers = max(1, min(max_workers or 16, (os.cpu_count() or 2) - 1))
    # the workers import while the step functions run: ~2 s of imports each, off the clock
    pool = _Pool((gpu.backend, gpu.arch, gpu.warp_size), workers)
    try:
        variants = collect(runs)
        report.phases["collect"] = time.perf_counter() - t0
        report.variants = len(variants)
        if not variants:
            pool.stop()
            report.seconds = time.perf_counter() - t0
            return report
        # Probe with the largest kernel: it takes seconds to compile and milliseconds to
        # load from the cache, where a small one may compile in under the threshold. The
        # workers compile the others meanwhile, so a cold cache loses no time to the probe.
        probe = max(variants, key=lambda v: len(_kernel(v).src))
        rest = [v for v in variants if v is not probe]
        pool.assign(rest)
        report.workers = min(workers, len(rest))
        t = time.perf_counter()
        _kernel(probe).preload(probe.data)
        report.phases["probe"] = time.perf_counter() - t
    except BaseException:
        pool.stop()
        raise
    t = time.perf_counter()
    if rest and report.phases["probe"] > _LOADED_SECONDS:          # a cold cache
        report.compiled_in_pool = len(rest)
        report.failures, report.compile_seconds = pool.finish()
        report.failed_in_pool = len(report.failures)
    else:                                                           # a warm one: load here
        pool.stop()
        report.workers = 0
    report.phases["pool_wait"] = time.perf_counter() - t
    t = time.perf_counter()
    for v in rest:
        _kernel(v).preload(v.data)          # from the on-disk cache (or compiled here)
    report.phases["load"] = time.perf_counter() - t
    report.seconds = time.perf_counter() - t0
    return report
