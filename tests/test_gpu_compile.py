"""graphrt's Triton kernels compile for an sm_90 GPU, checked without one
(tests/_compile_for_gpu.py): the interpreter the CPU tests run accepts code a GPU's
compiler refuses (a constexpr reassigned in a loop did that once). Two sets: the sampling
and speculative kernels' variants listed by hand, and one variant per kind of launch the
CPU tests make (tests/gpu_launches.json, recorded by tests/_record_launches.py; regenerate
it when a kernel's parameters or switches change:

    TRITON_INTERPRET=1 GRAPHRT_LAUNCHES=$PWD/tests/gpu_launches.json PYTHONPATH=tests \\
        python -m pytest -q -n 2 -p _record_launches tests/test_paged_attention.py \\
        tests/test_kv_write.py tests/test_fp8_cache.py tests/test_linear.py tests/test_sampling.py \\
        tests/test_speculative.py tests/test_memory_safety.py tests/test_embeds.py
)."""

import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("_compile_for_gpu.py")
LAUNCHES = Path(__file__).with_name("gpu_launches.json")
KERNEL_MODULES = ("graphrt.kernels._attention_jit", "graphrt.kernels._kv_write_jit", "graphrt.kernels.linear",
                  "graphrt.kernels.sampling", "graphrt.kernels.speculative")


def _compile(*args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("triton.backends.nvidia")
    import torch
    if torch.cuda.is_available():   # the gpu tests compile and run these kernels for real there
        pytest.skip("a CUDA machine compiles the kernels in its gpu tests")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=1800, env=env)


def test_kernels_compile_for_sm90():
    run = _compile()
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-3000:]
    assert run.stdout.count("ok   ") >= 12, run.stdout


def test_recorded_launches_compile_for_sm90():
    run = _compile("--launches", str(LAUNCHES))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-3000:]
    assert run.stdout.count("ok   ") >= 20, run.stdout


def _kernels() -> dict[tuple[str, str], list[str]]:
    """Every Triton kernel of graphrt.kernels: (module, name) -> its parameter names."""
    found = {}
    for module_name in KERNEL_MODULES:
        module = importlib.import_module(module_name)
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)
            if name.startswith("_") and name.endswith("_kernel") and callable(fn):
                found[(module_name, name)] = list(inspect.signature(fn).parameters)
    return found


def test_recorded_launches_are_current():
    """Every kernel has a recorded launch, and each record names the kernel's parameters as
    they are now: a kernel changed since the recording fails here, cheaply, before the
    compile above would."""
    kernels = _kernels()
    assert len(kernels) >= 8, kernels
    recorded = json.loads(LAUNCHES.read_text())
    for e in recorded:
        key = (e["module"], e["name"])
        assert key in kernels, f"{key} is recorded but is no kernel now: record the launches again"
        names = set(e["params"]) | set(e["constexprs"])
        assert names == set(kernels[key]), (f"{key}: recorded parameters differ from the kernel's now "
                                            f"({sorted(names ^ set(kernels[key]))}): record the launches again")
    missing = set(kernels) - {(e["module"], e["name"]) for e in recorded}
    assert not missing, f"kernels no CPU test launched while recording: {sorted(missing)}"
