"""Shared by the benchmarks: environment record and JSON output."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def env() -> dict:
    """Run facts. The commit comes from GRAPHRT_COMMIT when set (a copied tree without
    git metadata), else from git."""
    commit = os.environ.get("GRAPHRT_COMMIT")
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                          cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        commit = None
    import triton

    cuda = torch.cuda.is_available()
    return dict(commit=commit, gpu=torch.cuda.get_device_name() if cuda else None, torch=torch.__version__,
                triton=triton.__version__, cuda=torch.version.cuda, python=platform.python_version())


def write(name: str, rows: list[dict], extra_env: dict | None = None, folder: str | None = None) -> Path:
    out = RESULTS / (folder or ("h200" if torch.cuda.is_available() else "cpu"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(dict(env={**env(), **(extra_env or {})}, rows=rows), indent=1))
    return path
