"""README's example runs as written, in a fresh interpreter."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README.md has no python example"
    script = tmp_path / "example.py"
    script.write_text("\n".join(blocks))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]


def test_demo_runs(tmp_path):
    run = subprocess.run([sys.executable, "-m", "graphrt", "demo", "--requests", "2", "--new-tokens", "2"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "worst error" in run.stdout and "(ok," in run.stdout, run.stdout[-3000:]


def test_demo_samples_in_the_step(tmp_path):
    run = subprocess.run([sys.executable, "-m", "graphrt", "demo", "--sample", "--requests", "2", "--new-tokens", "3"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    drawn = re.search(r"equal to the reference's draws: (\d+) of (\d+)", run.stdout)
    assert drawn and int(drawn[2]) > 0, run.stdout[-3000:]
    if "cpu," in run.stdout:        # fp32 on both sides: every draw the same
        assert drawn[1] == drawn[2], run.stdout[-3000:]


def test_demo_speculative(tmp_path):
    pytest.importorskip("transformers")
    run = subprocess.run([sys.executable, "-m", "graphrt", "demo", "--speculative"], capture_output=True, text=True,
                         timeout=900, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "tokens equal the target's greedy decoding: yes" in run.stdout, run.stdout[-3000:]
