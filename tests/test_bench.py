"""``graphrt bench --quick`` keeps working: every benchmark runs and writes its JSON."""

import json
import subprocess
import sys

import pytest
import torch

REQUIRED = {"step": {"impl", "layers", "batch", "host_us", "wall_us"},
            "kernels": {"impl", "ms"},
            "runtime": {"impl", "layers", "batch", "host_us", "gpu_us", "host_bound", "wall_us", "h2d_bytes"},
            "capture": {"impl", "ms", "cache"},
            "host": {"impl", "layers", "batch", "from_arrays_us", "validate_us", "pack_us", "copy_us", "step_us"},
            "soak": {"impl", "steps", "checked", "mismatches", "host_us", "host_us_windows"},
            "parallel": {"impl", "ranks", "batch", "wall_us", "host_us", "speedup_vs_1"},
            "sampling": {"impl", "vocab", "batch", "setting", "ms"},
            "speculative": {"batch", "drafts", "draft", "acceptance", "plain_tok_s", "spec_tok_s", "speedup",
                            "tokens_equal"},
            "model": {"model", "batch", "prompt", "graphrt_ms", "graphrt_compiled_ms", "compiled_capture_s",
                      "compiled_tokens_agree", "hf_eager_ms", "floor_ms", "first_token_ms",
                      "tokens_agree", "compiled_eager_logit_diff", "eager_logit_error", "compiled_logit_error",
                      "hf_logit_error"}}


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
    if name == "model" and not torch.cuda.is_available():    # fp32, wide weights: the compiled loop's tokens
        assert all(r["compiled_tokens_agree"] == r["new_tokens"] for r in data["rows"]), data["rows"]   # are eager's
        # and so are its logits; both are transformers' fp32 forward's to rounding
        assert all(r["compiled_eager_logit_diff"] < 1e-5 and max(r["eager_logit_error"], r["compiled_logit_error"])
                   < 1e-5 for r in data["rows"]), data["rows"]
    if name == "sampling":      # every cell timed both ways
        assert {r["impl"] for r in data["rows"]} == {"graphrt", "torch_eager"} and all(r["ms"] > 0 for r in data["rows"])
    if name == "speculative":   # the exact draft accepts every draft, the independent one (nearly) none; the
        # emitted tokens are the target's greedy ones (fp32 on the CPU: exactly)
        by = {r["draft"]: r for r in data["rows"]}
        exact = 1.0 if not torch.cuda.is_available() else 0.9       # (bf16: the verify's tiles against the draft's)
        assert by["same"]["acceptance"] >= exact and by["independent"]["acceptance"] < 0.5, data["rows"]
        if not torch.cuda.is_available():
            assert all(r["tokens_equal"] == 1.0 for r in data["rows"]), data["rows"]
    if name == "soak":
        assert data["rows"][0]["checked"] >= 2 and data["rows"][0]["mismatches"] == 0, data["rows"][0]
    if name == "capture":       # a cold Triton cache, then the same cache warm, each in a fresh process;
        # then the same with precompile in a second directory
        totals = [(r["cache"], r["precompile"]) for r in data["rows"] if r["bucket"] == "all"]
        assert totals == [("cold", False), ("warm", False), ("cold", True), ("warm", True)], data["rows"]
    if name == "kernels":      # what SDPA ran is on record beside its time
        sdpa = [r for r in data["rows"] if r["impl"] == "sdpa"]
        assert sdpa and all(r["sdpa_backend"] in {"MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION",
                                                  "CUDNN_ATTENTION", "OVERRIDEABLE"} for r in sdpa), sdpa
    if name == "runtime":
        assert 1 in {r["layers"] for r in data["rows"]}, "no one-layer row"
    if name == "model":        # graphrt's greedy tokens are transformers' on every new token (fp32, tiny models)
        assert {r["model"] for r in data["rows"]} == {"llama-tiny", "gemma3-tiny"}
        assert all(r["tokens_agree"] == r["new_tokens"] for r in data["rows"]), data["rows"]
    if name == "step":
        assert {r["impl"] for r in data["rows"]} >= {"per_layer_rebuild", "per_step_rebuild", "graphrt_eager"}



def test_bench_speculative_sampled_quick(tmp_path):
    """The sampled form: both loops sample; the exact draft accepts every draft (its
    distributions are the target's: u q < p always holds)."""
    pytest.importorskip("transformers")
    run = subprocess.run([sys.executable, "-m", "graphrt.bench.speculative", "--quick", "--sampled", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    rows = json.loads((tmp_path / "speculative_quick_sampled.json").read_text())["rows"]
    by = {r["draft"]: r for r in rows}
    assert all(r["sampled"] and r["tokens_equal"] is None and r["spec_tok_s"] > 0 for r in rows), rows
    assert by["same"]["acceptance"] >= (1.0 if not torch.cuda.is_available() else 0.9), rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host runs the GPU cells")
def test_bench_host_on_a_cpu_host_times_the_host_pieces(tmp_path):
    """Without a GPU and without --quick, ``graphrt bench host`` times the host's own pieces
    (no whole step, which there is the interpreted model) at batch 1, 64 and 256, in rounds
    (what ab.py compares between two trees on a CPU machine)."""
    from graphrt.bench.host import ROUNDS, run

    rows = run(quick=False, out=tmp_path, quiet=True)
    assert [(r["layers"], r["batch"], r["context"]) for r in rows] == [(1, 1, 1024), (1, 64, 1024), (1, 256, 1024)]
    for r in rows:
        assert "step_us" not in r and "replay_us" not in r, sorted(r)
        for piece in ("from_arrays", "validate", "pack", "copy", "bare_copy"):
            assert len(r[f"{piece}_us_rounds"]) == ROUNDS and r[f"{piece}_us"] > 0, r
    assert [r["copy_bytes"] for r in rows] == sorted(r["copy_bytes"] for r in rows) and rows[0]["copy_bytes"] > 0
    assert (tmp_path / "host.json").exists()


def test_ab_script_interleaves_two_trees(tmp_path):
    """benchmarks/ab.py runs a benchmark on two trees in turn and writes per-cell ratios (the
    step bench: seconds on a GPU, where the capture bench's four cold-cache captures per tree
    took minutes beside the rest of the suite)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "ab.py"), "--a", str(root), "--b", str(root),
                          "--labels", "x,y", "--which", "step", "--rounds", "1", "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    data = json.loads((tmp_path / "ab_step.json").read_text())
    assert (data["a"], data["b"]) == ("x", "y") and data["rows"]
    assert all(r["wall_us_x_over_y"] > 0 and r["host_us_x_over_y"] > 0 for r in data["rows"]), data["rows"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run times it instead (h200_checks)")
def test_prefill_tma_probe_matches_the_reference(tmp_path):
    """benchmarks/probes/probe_prefill_tma.py's kernel (host and device descriptors, the
    warp-specialized one-loop form, a paged cache through 3-d descriptors) against a float64
    reference, under the interpreter."""
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "probes" / "probe_prefill_tma.py")], capture_output=True,
                         text=True, timeout=600, cwd=tmp_path, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert run.stdout.count("max |err|") == 10, run.stdout
