"""Running from a graphrt checkout's root: its top-level ``kernels/`` (graphrt.kernels) is on
sys.path there under the name ``kernels``, the PyPI package that transformers >= 5.25 imports.
Scripts, ``python -c`` and ``python -m graphrt`` started there still get the PyPI package.
Each check runs in a fresh process whose working directory is the checkout's root."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run


def _pypi_kernels() -> Path:
    spec = importlib.util.find_spec("kernels")
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    if origin is None or origin.parent == ROOT / "kernels":
        pytest.skip("the PyPI package 'kernels' is not installed (transformers >= 5.25 brings it)")
    return origin


def test_import_kernels_from_the_root_is_the_pypi_package():
    want = _pypi_kernels()
    run = _run("-c", "import sys, kernels, transformers.integrations.hub_kernels as hub; "
                     "print(sys.path[0] == '', kernels.__file__, hasattr(hub, 'CUDAProperties'))")
    first_is_cwd, path, has_props = run.stdout.split()
    assert first_is_cwd == "True", "the check did not start with the checkout on sys.path"
    assert Path(path).resolve() == want, f"'import kernels' from the checkout's root gave {path}, not {want}"
    assert has_props == "True", "transformers' hub_kernels did not find the PyPI package's names"


def test_python_m_graphrt_from_the_root():
    want = _pypi_kernels()
    run = _run("-m", "graphrt", "info")
    lines = dict(line.strip().split(": ", 1) for line in run.stdout.splitlines() if ": " in line)
    assert str(want.parent) in lines["kernels (PyPI)"], run.stdout
    assert lines["graphrt._fast"].startswith(("built", "not built")), run.stdout


def test_graphrt_kernels_still_imports_under_its_own_name():
    run = _run("-c", "import kernels, graphrt.kernels as g; print(g.__name__, g.AttentionMetadata.__module__, "
                     "kernels is not g)")
    assert run.stdout.split() == ["graphrt.kernels", "graphrt.kernels.metadata", "True"], run.stdout


def test_pythonpath_entries_are_on_sys_path():
    """What PYTHONPATH names is importable here, in a pytest-xdist worker too (workers take
    the parent's sys.path; tests/conftest.py drops only the checkout's root from it)."""
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    on_path = {Path(p or ".").resolve() for p in sys.path}
    missing = [p for p in entries if Path(p).resolve() != ROOT and Path(p).resolve() not in on_path]
    assert not missing, f"PYTHONPATH entries missing from sys.path: {missing}"


def _collected(*args: str) -> list[str]:
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                          "tests/test_buckets.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return [line for line in run.stdout.splitlines() if "::" in line]


def test_shards_split_the_suite_into_disjoint_parts_that_cover_it():
    """``--shard K/N`` (tests/conftest.py): a GPU suite longer than one call runs as N calls."""
    whole = _collected()
    parts = [_collected("--shard", f"{k}/3") for k in (1, 2, 3)]
    assert len(whole) >= 6 and all(parts), [len(p) for p in parts]
    assert sorted(sum(parts, [])) == sorted(whole), "the parts do not cover the suite exactly once"
    assert parts[0] == whole[0::3] and parts[2] == whole[2::3], "a part is not every third test in order"


@pytest.mark.parametrize("spec", ["3/2", "0/2", "1", "a/b"])
def test_a_bad_shard_is_refused(spec):
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                          "tests/test_buckets.py", "--shard", spec], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode != 0 and "--shard" in run.stderr + run.stdout, run.stdout[-1000:] + run.stderr[-1000:]
