"""The sampling and speculative kernels compile for an sm_90 GPU, checked without one
(tests/_compile_for_gpu.py): the interpreter the CPU tests run accepts code a GPU's
compiler refuses (a constexpr reassigned in a loop did that once)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("_compile_for_gpu.py")


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-3000:]
    assert run.stdout.count("ok   ") >= 12, run.stdout
