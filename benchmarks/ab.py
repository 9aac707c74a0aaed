"""Interleaved A/B runs of ``graphrt bench`` on two source trees in one session.

    python benchmarks/ab.py --a . --b /path/to/old/tree --rounds 2 --which runtime --out results/ab

Each tree (a checkout or a ``git archive``) is laid out as an importable package in a
scratch directory (``graphrt/`` with ``kernels/`` and ``capture/`` inside, as the
installed package maps them), then the benchmark runs A, B, A, B, ... each in a fresh
process, so neither tree always runs first (on a machine just started, or while its clocks
settle). Writes every run's JSON under ``--out/<label>_<round>/`` and ``ab_<which>.json``:
per cell, the median over rounds of each numeric figure for A and B and their ratio A / B.
Without a GPU, ``--which host`` compares the host pieces of a step (``graphrt bench host``'s
CPU cells: batch 1, 64 and 256).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

KEYS = ("bench", "impl", "layers", "batch", "context", "nvtx", "tokens", "cache", "bucket", "prefills", "decodes",
        "vocab", "setting", "draft", "drafts")


def importable(tree: Path, scratch: Path, harness: Path | None = None) -> Path:
    """A directory whose ``graphrt`` package is ``tree``'s, kernels and capture included,
    with ``harness``'s ``graphrt/bench`` in place of the tree's own when given."""
    root = scratch / "site"
    shutil.copytree(tree / "graphrt", root / "graphrt", ignore=shutil.ignore_patterns("__pycache__"))
    for sub in ("kernels", "capture"):
        shutil.copytree(tree / sub, root / "graphrt" / sub, ignore=shutil.ignore_patterns("__pycache__"))
    if harness is not None:
        shutil.rmtree(root / "graphrt" / "bench")
        shutil.copytree(harness / "graphrt" / "bench", root / "graphrt" / "bench",
                        ignore=shutil.ignore_patterns("__pycache__"))
    return root


def cell(row: dict) -> tuple:
    return tuple((k, row[k]) for k in KEYS if k in row)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", type=Path, required=True, help="tree A (e.g. the working tree)")
    parser.add_argument("--b", type=Path, required=True, help="tree B (e.g. a git archive of the base)")
    parser.add_argument("--labels", default="a,b", help="names of A and B in the output (e.g. two commits)")
    parser.add_argument("--which", default="runtime", help="one graphrt bench name")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--harness", choices=("own", "a"), default="own",
                        help="own: each tree runs its own graphrt/bench; a: both run A's (one measuring "
                             "harness for both, where B's runtime API allows it)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    labels = args.labels.split(",")
    runs: dict[str, list[list[dict]]] = {label: [] for label in labels}
    with tempfile.TemporaryDirectory() as tmp:
        harness = args.a.resolve() if args.harness == "a" else None
        sites = {label: importable(tree.resolve(), Path(tmp) / label, harness)
                 for label, tree in zip(labels, (args.a, args.b))}
        for label, site in sites.items():
            _check_own_modules(label, site, tmp)
        for r in range(args.rounds):
            for label in labels:
                out = args.out / f"{label}_{r}"
                env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(sites[label]), os.environ.get("PYTHONPATH", "")]),
                       "GRAPHRT_COMMIT": label}
                cmd = [sys.executable, "-m", "graphrt", "bench", args.which, "--out", str(out)]
                cmd += ["--quick"] if args.quick else []
                print(f"== round {r} {label}: {' '.join(cmd[1:])}", flush=True)
                subprocess.run(cmd, env=env, check=True, cwd=tmp)
                full = out / f"{args.which}.json"      # (a bench that runs its quick cells without a GPU
                quick = out / f"{args.which}_quick.json"  # writes the quick file)
                path = quick if args.quick or not full.exists() else full
                runs[label].append(json.loads(path.read_text())["rows"])
    a, b = labels
    rows = []
    for key in [cell(row) for row in runs[a][0]]:
        row = dict(key)
        for label in labels:
            matches = [x for rnd in runs[label] for x in rnd if cell(x) == key]
            if not matches:           # a cell one tree's benchmark does not have
                continue
            for field, value in matches[0].items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and field not in row:
                    row[f"{field}_{label}"] = statistics.median(m[field] for m in matches)
        for field in [f[: -len(a) - 1] for f in row if f.endswith(f"_{a}")]:
            vb = row.get(f"{field}_{b}")
            if vb:
                row[f"{field}_{a}_over_{b}"] = row[f"{field}_{a}"] / vb
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"ab_{args.which}.json").write_text(json.dumps(dict(a=a, b=b, rounds=args.rounds, harness=args.harness,
                                                                    rows=rows), indent=1))
    for row in rows:
        ratios = "  ".join(f"{k.split('_' + a)[0]} {v:.3f}" for k, v in row.items() if k.endswith(f"_over_{b}"))
        print(" ".join(f"{k}={v}" for k, v in row.items() if k in KEYS), "|", ratios)


def _check_own_modules(label: str, site: Path, cwd: str) -> None:
    """A tree's graphrt must import its own modules: where it lacks one (an unbuilt C
    helper), an editable install of graphrt elsewhere supplies that module from its own tree
    instead, and the A/B would time the wrong code."""
    code = ("import importlib.util, graphrt; spec = importlib.util.find_spec('graphrt._fast'); "
            "print(graphrt.__file__); print(spec.origin if spec else '')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    lines = subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    for origin in lines:
        if origin and not Path(origin).resolve().is_relative_to(site.resolve()):
            raise SystemExit(f"tree {label}: {origin} is imported from outside its tree (build its C helper: "
                             f"python setup.py build_ext --inplace in that tree)")


if __name__ == "__main__":
    main()
