"""``graphrt bench --quick`` keeps working: every benchmark runs and writes its JSON."""

import json
import subprocess
import sys

import pytest

REQUIRED = {"step": {"impl", "layers", "batch", "host_us", "wall_us"},
            "kernels": {"impl", "ms"},
            "runtime": {"impl", "layers", "batch", "host_us", "gpu_us", "host_bound", "wall_us", "h2d_bytes"},
            "capture": {"impl", "ms", "cache"},
            "soak": {"impl", "steps", "checked", "mismatches", "host_us", "host_us_windows"},
            "parallel": {"impl", "ranks", "batch", "wall_us", "host_us", "speedup_vs_1"}}


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_bench_quick(name, tmp_path):
    run = subprocess.run([sys.executable, "-m", "graphrt", "bench", name, "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    data = json.loads((tmp_path / f"{name}_quick.json").read_text())
    assert {"commit", "gpu", "torch", "triton"} <= set(data["env"])
    assert data["rows"], f"{name} wrote no rows"
    benches = {"decode", "prefill", "prefill_ranges", "mixed"} if name == "kernels" else {name}
    for row in data["rows"]:
        assert row["bench"] in benches and REQUIRED[name] <= set(row), row
    if name == "soak":
        assert data["rows"][0]["checked"] >= 2 and data["rows"][0]["mismatches"] == 0, data["rows"][0]
    if name == "capture":       # a cold Triton cache, then the same cache warm, each in a fresh process
        assert [r["cache"] for r in data["rows"] if r["bucket"] == "all"] == ["cold", "warm"], data["rows"]
    if name == "runtime":
        assert 1 in {r["layers"] for r in data["rows"]}, "no one-layer row"
    if name == "step":
        assert {r["impl"] for r in data["rows"]} >= {"per_layer_rebuild", "per_step_rebuild", "graphrt_eager"}


def test_host_pieces_script(tmp_path):
    """benchmarks/host_pieces.py (the per-piece host breakdown) keeps running."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "host_pieces.py"
    run = subprocess.run([sys.executable, str(script), "--quick", "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=900, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    rows = json.loads((tmp_path / "host_pieces_quick.json").read_text())["rows"]
    assert len(rows) == 2 and all(r["from_arrays_us"] > 0 and r["pack_us"] > 0 and r["step_us"] > 0 for r in rows)
