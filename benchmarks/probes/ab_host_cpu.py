"""An A/B of the host pieces of a decode step (``probe_host_cpu.py``) on two source trees,
on this machine's CPU, in one session: A, B, A, B, ... each in a fresh process, each tree
with its own C helper where it was built (``python setup.py build_ext --inplace`` in it).
Writes ``--out`` (JSON): every run, and per batch the median over rounds of each figure
for A and B and their ratio A / B.

    python benchmarks/probes/ab_host_cpu.py --a . --b /tmp/base --labels head,base --out ab_host_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ab import importable  # noqa: E402

PROBE = Path(__file__).resolve().with_name("probe_host_cpu.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", type=Path, required=True)
    parser.add_argument("--b", type=Path, required=True)
    parser.add_argument("--labels", default="a,b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    labels = args.labels.split(",")
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    with tempfile.TemporaryDirectory() as tmp:
        harness = args.a.resolve()
        sites = {label: importable(tree.resolve(), Path(tmp) / label, harness)
                 for label, tree in zip(labels, (args.a, args.b))}
        for r in range(args.rounds):
            for label in labels:
                env = {**os.environ, "PYTHONPATH": str(sites[label])}
                run = subprocess.run([sys.executable, str(PROBE), "--label", label], env=env, cwd=tmp, check=True,
                                     capture_output=True, text=True)
                result = json.loads(run.stdout.strip().splitlines()[-1])
                assert result["graphrt"].startswith(str(sites[label])), result["graphrt"]
                runs[label].append(result)
                print(f"round {r} {label}: " + "; ".join(
                    f"b{x['batch']} pack {x['pack_us']:.1f} us" for x in result["rows"]), flush=True)
    a, b = labels
    rows = []
    for i, first in enumerate(runs[a][0]["rows"]):
        row = dict(batch=first["batch"], context=first["context"])
        for field in [k for k in first if k.endswith("_us") or k == "copy_bytes"]:
            for label in labels:
                row[f"{field}_{label}"] = statistics.median(run["rows"][i][field] for run in runs[label])
            row[f"{field}_{a}_over_{b}"] = row[f"{field}_{a}"] / row[f"{field}_{b}"]
        rows.append(row)
        print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                        if "over" in k or k in ("batch",)))
    env = dict(cpu=runs[a][0]["cpu"], python=sys.version.split()[0],
               fast_helper={label: runs[label][0]["fast_helper"] for label in labels})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(a=a, b=b, rounds=args.rounds, env=env, rows=rows, runs=runs), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
