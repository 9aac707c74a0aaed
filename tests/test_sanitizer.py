"""CUDA compute-sanitizer over graphrt's kernels and a captured runtime: memcheck on both,
racecheck on the kernels; each must report 0 errors (docs/sanitizer.md has the commands
for the whole GPU suite). GPU only; skipped where the sanitizer is not installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

WORKLOAD = Path(__file__).with_name("_sanitize_workload.py")


def find_sanitizer() -> str | None:
    for candidate in (shutil.which("compute-sanitizer"),
                      os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "compute-sanitizer"),
                      "/usr/local/cuda/bin/compute-sanitizer"):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


@pytest.mark.gpu
@pytest.mark.parametrize("tool,workload", [("memcheck", "kernels"), ("memcheck", "runtime"),
                                           ("racecheck", "kernels-small")])
def test_sanitizer_reports_no_errors(tool, workload):
    sanitizer = find_sanitizer()
    if sanitizer is None:
        pytest.skip("compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    env = dict(os.environ)
    if workload.startswith("kernels"):
        # one cudaMalloc per tensor, so that an access past a tensor is past its allocation
        # (inside the caching allocator's pooled segments memcheck could not see it)
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    run = subprocess.run([sanitizer, "--tool", tool, "--error-exitcode", "97", sys.executable, str(WORKLOAD), workload],
                         capture_output=True, text=True, env=env, timeout=1200)
    text = run.stdout + run.stderr
    if "Device not supported" in text:       # e.g. under a sandboxing runtime (gVisor)
        pytest.skip("compute-sanitizer does not support this device here")
    summary = re.findall(r"========= (?:ERROR|RACECHECK) SUMMARY: .*", text)
    print(f"{tool} {workload}: {summary[-1] if summary else 'no summary'}; "
          f"{re.findall(r'graphrt sanitize workload .*', text)}")
    assert run.returncode == 0, f"{tool} on {workload}: exit {run.returncode}\n{text[-6000:]}"
    assert summary, f"no sanitizer summary in the output:\n{text[-3000:]}"
    assert re.search(r"SUMMARY: 0 (errors|hazards)", summary[-1]), summary[-1]
