"""Compile, in parallel processes, the Triton kernel variants a capture is about to launch.

From a cold Triton cache, capture spends most of its time compiling one kernel variant
after another in one process (Triton holds the GIL while it compiles, so threads do not
help). ``precompile(runs)`` instead:

1. runs each step function once with Triton's ``jit_cache_hook`` set: every launch of a
   variant this process has not compiled yet is recorded (its specialization data, the
   JSON Triton's ``JITFunction.preload`` takes) and skipped, neither compiled nor launched
   (the outputs of that pass are garbage; the torch ops around the kernels run as usual);
2. sends each new variant to a worker process at once, so compiling overlaps the pass:
   each of the first variants starts one (up to one per CPU core but one, 16 at most),
   which imports Triton and graphrt's kernel modules (those import Triton alone: no torch,
   so a worker is ready in well under a second); later variants go round robin. A pass
   that finds every variant in memory starts no process;
3. waits for the workers, which compile for this process's GPU target into Triton's
   on-disk cache (a variant already there costs a worker a cache lookup), and loads every
   variant here from that cache.

Correctness never rests on the pool: the kernels a capture launches are always the ones
this process loads or compiles through Triton's own path; a variant a worker failed on, or
compiled under a different cache key, is simply compiled here.

With a ``key`` (what decides the variants: the runtime's shapes and buckets), the variants
found are written to a manifest in Triton's cache directory, named by that key, Triton's
version, the GPU target and the kernels' source hashes, with the cache entry of each. A
later capture with the same key whose entries are all still on disk skips the pass and the
pool: it loads the listed variants and goes on (a warm start costs the loads alone). A
manifest that turns out to miss a variant (the model's step launches one more) is removed
by the capture, so the next capture builds it again; a cleared cache simply misses it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

@dataclass(frozen=True)
class Variant:
    module: str          # the kernel's module, e.g. "graphrt.kernels._attention_jit"
    qualname: str        # its name in the module
    data: str            # Triton's specialization data (JSON)


@dataclass
class PrecompileReport:
    variants: int = 0            # kernel variants the step functions needed that were not in memory
    compiled_in_pool: int = 0    # of them, sent to the worker processes (all)
    workers: int = 0
    failed_in_pool: int = 0      # compiled here instead
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)           # seconds: collect, pool_wait, load
    manifest: str | None = None  # the manifest's path: read (``from_manifest``) or written
    from_manifest: bool = False  # the variants came from a manifest whose cache entries were all there
    compile_seconds: dict[str, float] = field(default_factory=dict)  # per variant in the pool, and imports


@contextlib.contextmanager
def _recording(found: dict[str, Variant], on_new: Callable[[Variant], None] | None = None):
    """Triton's jit_cache_hook records each variant about to compile (``on_new`` is called
    with each new one) and skips it."""

    def hook(*, key, fn, compile, **_):
        name = str(key) + fn.name
        if name not in found:
            found[name] = Variant(str(fn.module), fn.name, compile["specialization_data"])
            if on_new is not None:
                on_new(found[name])
        return True              # skip: no compile, no launch

    with _jit_cache_hook(hook):
        yield


@contextlib.contextmanager
def _jit_cache_hook(hook: Callable[..., bool]):
    """Triton's ``jit_cache_hook`` set to ``hook`` inside the block (called before each
    variant not in memory is compiled; True skips it), the previous one restored after."""
    from triton import knobs

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook = previous


def collect(runs: Iterable[Callable[[], Any]], on_new: Callable[[Variant], None] | None = None) -> list[Variant]:
    """The kernel variants that running each of ``runs`` would compile (none is compiled
    or launched while they run); ``on_new`` sees each as soon as it is found."""
    found: dict[str, Variant] = {}
    with _recording(found, on_new):
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
    """Worker processes compiling variants as they are sent (``send``: each of the first
    ``workers`` variants starts a worker, later ones go round robin; each worker compiles
    its variants in the order they come), so that a capture needing no compile starts no
    process. ``finish`` ends the input and waits for the workers, returning the failures;
    ``stop`` ends them at once.

    A worker runs this file as a script (not ``-m graphrt...``, which would import graphrt
    and torch) and loads the kernel modules by path under their own names (``MODULES``):
    Triton's cache key holds a kernel's module name, so the worker's compile is the one this
    process looks up. The workers are plain subprocesses, not multiprocessing's: spawning
    those would import the caller's main script again in every worker."""

    # in this order: _attention_jit imports from _kv_write_jit, which must be loaded by then
    # (a relative import of a module not yet loaded would import the package, and torch)
    MODULES = ("graphrt.kernels._kv_write_jit", "graphrt.kernels._attention_jit")

    def __init__(self, target: tuple, workers: int):
        import tempfile

        self._tmp = tempfile.TemporaryDirectory(prefix="graphrt-precompile-")
        self._jobs: list[tuple[list[Variant], Any, str]] = []
        self._next = 0
        self._target, self._workers = target, max(1, workers)
        self._modules = [f"{name}={importlib.util.find_spec(name).origin}" for name in self.MODULES]

    @property
    def started(self) -> int:
        return len(self._jobs)

    def _start(self) -> None:
        import subprocess
        import sys

        path = os.path.join(self._tmp.name, f"worker{len(self._jobs)}")
        # output to files, not pipes: nobody reads a pipe before the workers end, and a full
        # one would stall its worker
        with open(path + ".out", "w") as out, open(path + ".err", "w") as err:
            job = subprocess.Popen([sys.executable, os.path.abspath(__file__), json.dumps(list(self._target)),
                                    *self._modules], stdin=subprocess.PIPE, stdout=out, stderr=err)
        self._jobs.append(([], job, path))

    def send(self, variant: Variant) -> None:
        if len(self._jobs) < self._workers:
            self._start()
        share, job, _ = self._jobs[self._next % len(self._jobs)]
        self._next += 1
        share.append(variant)
        try:
            job.stdin.write(json.dumps(variant.__dict__).encode() + b"\n")
            job.stdin.flush()
        except OSError:                    # the worker died: finish reports its variants
            pass

    def finish(self) -> tuple[list[str], dict[str, float]]:
        """(one message per variant that failed, seconds per variant compiled and per
        worker's imports), once every worker has ended."""
        for _, job, _ in self._jobs:
            with contextlib.suppress(OSError):
                job.stdin.close()
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
            with contextlib.suppress(OSError):
                job.stdin.close()
        self._tmp.cleanup()


def compile_in_pool(variants: list[Variant], target: tuple, workers: int) -> list[str]:
    """Compile ``variants`` in ``workers`` fresh Python processes; returns one message per
    variant that failed."""
    pool = _Pool(target, workers)
    for v in variants:
        pool.send(v)
    return pool.finish()[0]


def _load_by_path(name: str, path: str) -> None:
    """Import the module at ``path`` as ``name`` without importing its parent packages."""
    import sys

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def _worker() -> None:
    """A worker process (this file run as a script): argv = target (JSON), then
    ``module=path`` of each kernel module. Compiles each variant read from stdin (one JSON
    line each) as it comes; at the end of input prints the failures and the seconds of
    each compile and of the imports as one JSON line."""
    import sys

    t0 = time.perf_counter()
    target = tuple(json.loads(sys.argv[1]))
    for spec in sys.argv[2:]:
        name, path = spec.split("=", 1)
        _load_by_path(name, path)
    import triton.compiler  # noqa: F401  (what compile_variant uses, loaded before the first variant comes)

    seconds = {f"(imports)@{os.getpid()}": time.perf_counter() - t0}
    failures = []
    for i, line in enumerate(sys.stdin):
        variant = Variant(**json.loads(line))
        t = time.perf_counter()
        try:
            compile_variant(variant, target)
        except Exception as exc:
            failures.append(f"{variant.qualname}: {type(exc).__name__}: {exc}"[:300])
        seconds[f"{variant.qualname}#{i}@{os.getpid()}"] = time.perf_counter() - t
    print(json.dumps(dict(failures=failures, seconds=seconds)))


def _cache_dir() -> str | None:
    """Triton's on-disk cache directory, or None when a cache manager other than its file
    cache is configured (then no manifest)."""
    from triton import knobs

    if knobs.cache.manager_class is not None:
        return None
    return knobs.cache.dir or None


def manifest_path(key: str, target: tuple) -> str | None:
    """Where the manifest of ``key`` lives for this Triton, GPU target and kernel sources."""
    import hashlib

    import triton

    cache_dir = _cache_dir()
    if cache_dir is None:
        return None
    sources = []
    for name in _Pool.MODULES:
        module = importlib.import_module(name)
        sources += sorted(f"{n}:{obj.cache_key}" for n, obj in vars(module).items()
                          if isinstance(obj, triton.runtime.jit.JITFunction))
    digest = hashlib.sha256(json.dumps([key, triton.__version__, list(target), sources]).encode()).hexdigest()
    return os.path.join(cache_dir, "graphrt-precompile", digest[:32] + ".json")


def _read_manifest(path: str | None) -> list[Variant] | None:
    """The manifest's variants when every one's cache entry is still on disk, else None."""
    if path is None or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            entries = json.load(f)["variants"]
        cache_dir = os.path.dirname(os.path.dirname(path))
        variants = []
        for e in entries:
            entry = os.path.join(cache_dir, os.path.basename(e["entry"]))
            if not os.path.isdir(entry) or not any(n.startswith("__grp__") for n in os.listdir(entry)):
                return None
            variants.append(Variant(e["module"], e["qualname"], e["data"]))
        return variants
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_manifest(path: str, entries: list[dict]) -> None:
    """Write whole (a temporary file renamed over it), as Triton writes its cache."""
    import tempfile

    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(dict(variants=entries), f)
    os.replace(tmp, path)


def forget_manifest(report: PrecompileReport | None) -> None:
    """Remove the manifest a capture read (it missed a variant): the next capture finds
    the variants again and writes a new one."""
    if report is not None and report.from_manifest and report.manifest:
        with contextlib.suppress(OSError):
            os.remove(report.manifest)


@contextlib.contextmanager
def watch_compiles(seen: list[str]):
    """Appends to ``seen`` the name of each kernel variant compiled (or loaded from disk)
    inside the block, while Triton goes on as usual."""

    def hook(*, fn, **_):
        seen.append(fn.name)
        return False             # compile as usual

    with _jit_cache_hook(hook):
        yield


def precompile(runs: Iterable[Callable[[], Any]], *, max_workers: int | None = None,
               key: str | None = None) -> PrecompileReport:
    """Find the kernel variants ``runs`` need (kernels skipped), compile them in parallel
    processes while the search goes on, and load them all into this process (module doc).
    CUDA only. ``max_workers``: at most this many worker processes (default: one per CPU
    core but one, up to 16). ``key``: what decides the variants, naming a manifest that
    lets a warm start skip the search (module doc)."""
    from triton.runtime import driver

    t0 = time.perf_counter()
    report = PrecompileReport()
    gpu = driver.active.get_current_target()
    target = (gpu.backend, gpu.arch, gpu.warp_size)
    if key is not None:
        report.manifest = manifest_path(key, target)
        listed = _read_manifest(report.manifest)
        report.phases["manifest"] = time.perf_counter() - t0
        if listed is not None:
            t = time.perf_counter()
            for v in listed:
                _kernel(v).preload(v.data)          # from the on-disk cache
            report.phases["load"] = time.perf_counter() - t
            report.variants = len(listed)
            report.from_manifest = True
            report.seconds = time.perf_counter() - t0
            return report
    pool = _Pool(target, max(1, min(max_workers or 16, (os.cpu_count() or 2) - 1)))
    try:
        variants = collect(runs, pool.send)
    except BaseException:
        pool.stop()
        raise
    report.workers = pool.started
    report.phases["collect"] = time.perf_counter() - t0
    report.variants = report.compiled_in_pool = len(variants)
    t = time.perf_counter()
    report.failures, report.compile_seconds = pool.finish()
    report.failed_in_pool = len(report.failures)
    report.phases["pool_wait"] = time.perf_counter() - t
    t = time.perf_counter()
    from triton.runtime.cache import get_cache_manager

    entries = []
    for v in variants:
        kernel = _kernel(v).preload(v.data)          # from the on-disk cache (or compiled here)
        if getattr(kernel, "hash", None):
            # the variant's directory in the cache (Triton names it after the kernel's hash)
            entries.append(dict(v.__dict__, entry=os.path.basename(get_cache_manager(kernel.hash).cache_dir)))
    report.phases["load"] = time.perf_counter() - t
    if report.manifest is not None and len(entries) == len(variants):
        with contextlib.suppress(OSError):
            _write_manifest(report.manifest, entries)
    report.seconds = time.perf_counter() - t0
    return report


if __name__ == "__main__":
    _worker()
