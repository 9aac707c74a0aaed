"""README's example runs as written, in a fresh interpreter."""

import re
import subprocess
import sys
from pathlib import Path

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
