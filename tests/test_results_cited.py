"""The result files the READMEs and docs pages cite exist, and the figures their sentences
quote are the ones in the JSON they cite (in the page that cites it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "h200"
# what the documents say was measured (a "Not yet run" section names files still to come)
DOCS = {name: (ROOT / name).read_text().split("## Not yet run")[0]
        for name in ["README.md", "benchmarks/README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))}
MUST_CITE = ("README.md", "benchmarks/README.md", "docs/profiling.md", "docs/kernels.md", "docs/compile.md")


def cited(text: str) -> set[str]:
    """Result files a text names, relative to benchmarks/results/: paths under results/<card>/
    and bare `*.json` / `*.png` names in backticks (the H200's)."""
    names = set(re.findall(r"results/((?:h200|h100)/[A-Za-z0-9_./*-]+\.(?:json|png|log|txt))", text))
    names |= {f"h200/{n}" for n in re.findall(r"`((?:kept/|logs/)?[A-Za-z0-9_.-]+\.(?:json|png))`", text)}
    return names


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_cited_results_exist(doc):
    names = cited(DOCS[doc])
    assert names or doc not in MUST_CITE, f"{doc} cites no result file"
    base = RESULTS.parent
    missing = [n for n in sorted(names) if not (list(base.glob(n)) if "*" in n else (base / n).exists())]
    assert not missing, f"{doc} cites result files that are not in {base.relative_to(ROOT)}: {missing}"


def test_every_kept_run_has_its_reason():
    listed = (RESULTS / "kept" / "README.md").read_text()
    files = sorted(p.name for p in (RESULTS / "kept").glob("*.json"))
    assert files and all(f"`{f}`" in listed for f in files), files


def rows(name: str) -> list[dict]:
    return json.loads((RESULTS / name).read_text())["rows"]


def flat(text: str) -> str:
    return " ".join(text.split())


def in_readme(figure: str, source: str) -> None:
    """``figure`` is quoted by README or a docs page that cites ``source`` (line breaks as spaces)."""
    pages = [d for d, text in DOCS.items() if d != "benchmarks/README.md" and source in text]
    assert pages, f"no page cites {source}"
    assert any(flat(figure) in flat(DOCS[d]) for d in pages), f"{pages} should quote {figure!r}, what {source} holds"


def test_headline_kernel_figures_are_the_cited_runs():
    ab = "ab_kernels_9058019_vs_5b9007f.json"
    decode = [r for r in rows(ab) if r["bench"] == "decode"]
    big = [r["of_copy_9058019"] for r in decode
           if r["impl"] == "graphrt" and r["batch"] >= 64 and r["context"] >= 8192]
    in_readme(f"decode at {min(big):.2f}–{max(big):.2f}x the device copy", ab)
    fp8 = {(r["batch"], r["context"]): r["of_bf16_9058019"] for r in decode if r["impl"] == "graphrt_fp8"}
    long = [v for (b, c), v in fp8.items() if b >= 8 and c >= 8192]
    in_readme(f"takes {min(long):.2f}–{max(long):.2f}x the bf16 cache's time", ab)
    in_readme(f"{fp8[(1, 1024)]:.2f}x at batch 1, context 1k", ab)

    new = "kernels_prefill_mixed_fa0b2dd.json"
    tf = {(r["impl"], r["tokens"]): r["tflops"] for r in rows(new) if r["bench"] == "prefill"}
    of_sdpa = [tf[("graphrt", n)] / tf[("sdpa", n)] for n in (4096, 16384)]
    in_readme(f"{of_sdpa[0]:.2f}x / {of_sdpa[1]:.2f}x torch SDPA at 4k / 16k", new)
    cache = sorted(tf[("graphrt_cache", n)] / tf[("sdpa", n)] for n in (4096, 16384))
    in_readme(f"({cache[0]:.2f}–{cache[1]:.2f}x over a cache", new)
    flex = [tf[("graphrt", n)] / tf[("flex", n)] for n in (4096, 16384)]
    in_readme(f"{flex[0]:.1f}x / {flex[1]:.1f}x compiled flex_attention", new)
    gain = sorted(tf[("graphrt", n)] / tf[("graphrt_cache", n)] for n in (4096, 16384))
    in_readme(f"{gain[0]:.1f}–{gain[1]:.1f}x faster on prefills", new)


def test_headline_capture_figures_are_the_cited_run():
    total = {(r["cache"], r["precompile"]): r["ms"] / 1e3 for r in rows("capture.json") if r["bucket"] == "all"}
    in_readme(f"{total[('cold', True)]:.1f} s from a cold cache with it, {total[('cold', False)]:.1f} s", "capture.json")
    in_readme(f"from a warm cache {total[('warm', True)]:.1f} s with it and {total[('warm', False)]:.1f} s without",
              "capture.json")


def test_compiled_model_figures_are_the_cited_run():
    """README's compiled-step sentence quotes the H200 model run it cites."""
    cell = next(r for r in json.loads((RESULTS / "model.json").read_text())["rows"]
                if r["model"] == "llama-1b" and r["batch"] == 1)
    in_readme(f"{cell['graphrt_compiled_ms']:.2f} ms per token compiled against {cell['graphrt_ms']:.2f} eager", "model.json")
    in_readme(f"({cell['compiled_of_floor']:.2f}x /\n{cell['of_floor']:.2f}x its read floor", "model.json")
    in_readme(f"{cell['hf_static_ms'] / cell['graphrt_compiled_ms']:.1f}x faster than transformers' static-cache", "model.json")


def test_readme_why_figures_are_the_cited_run():
    step = {(r["impl"], r["layers"], r["batch"]): r for r in rows("step.json")}
    cell = lambda impl: step[(impl, 32, 8)]  # noqa: E731
    in_readme(f"takes {cell('per_layer_rebuild')['wall_us'] / 1e3:.2f} ms when the metadata is rebuilt", "step.json")
    in_readme(f"{cell('per_step_rebuild')['wall_us'] / 1e3:.2f} ms when that is done once per step", "step.json")
    in_readme(f"{cell('graphrt_graph')['wall_us'] / 1e3:.2f} ms as graphrt's one pinned copy and replay, its GPU busy "
              f"for {cell('graphrt_graph')['gpu_over_wall']:.2f} of the wall time", "step.json")
