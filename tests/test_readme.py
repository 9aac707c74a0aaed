"""README's examples run as written, in a fresh interpreter; so do each docs page's, after
README's (a page's examples continue README's loop: its ``cfg``, ``model``, ``device``)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# the docs pages with examples meant to run (```python blocks); a sketch is a plain ``` block
PAGES = sorted(p.name for p in (ROOT / "docs").glob("*.md") if "```python" in p.read_text())


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def run_script(tmp_path, blocks: list[str]) -> None:
    script = tmp_path / "example.py"
    script.write_text("\n".join(blocks))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]


def test_readme_example_runs(tmp_path):
    blocks = python_blocks(README)
    assert blocks, "README.md has no python example"
    run_script(tmp_path, blocks)


def test_docs_have_examples():
    assert {"kernels.md", "compile.md", "sampling.md", "transformers.md"} <= set(PAGES), PAGES


@pytest.mark.parametrize("page", PAGES)
def test_docs_examples_run(page, tmp_path):
    run_script(tmp_path, python_blocks(README) + python_blocks(ROOT / "docs" / page))


def test_docs_pages_open_with_their_purpose():
    """Each page: a title, then a paragraph saying what a reader does there."""
    for page in sorted((ROOT / "docs").glob("*.md")):
        lines = page.read_text().splitlines()
        assert lines[0].startswith("# ") and not lines[1].strip(), page.name
        first = lines[2]
        assert first and not first.startswith(("#", "|", "`", "-")), f"{page.name} opens with {first!r}"


def test_readme_is_short_and_links_every_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 210, len(text.splitlines())
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if f"(docs/{p.name})" not in text]
    assert not missing, f"README links no docs page {missing}"


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


def test_demo_speculative_sampled(tmp_path):
    """``graphrt demo --speculative --sample``: every emitted token inside the target's kept
    set at its place (fp32 on the CPU: all of them, none at an edge), the same tokens again
    from the same seeds."""
    pytest.importorskip("transformers")
    run = subprocess.run([sys.executable, "-m", "graphrt", "demo", "--speculative", "--sample"], capture_output=True,
                         text=True, timeout=900, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    kept = re.search(r"tokens inside the target's kept set at their place: (\d+) of (\d+)", run.stdout)
    assert kept and int(kept[2]) > 0, run.stdout[-3000:]
    if "cpu," in run.stdout:
        assert kept[1] == kept[2], run.stdout[-3000:]
    assert "a second run with the same seeds emits the same tokens: yes" in run.stdout, run.stdout[-3000:]


def test_demo_sample_refused_with_a_transformers_model(tmp_path):
    run = subprocess.run([sys.executable, "-m", "graphrt", "demo", "--sample", "--model", "llama"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 2 and "--sample runs with the toy model or with --speculative" in run.stderr, \
        run.stderr[-2000:]
