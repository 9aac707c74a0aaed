import os
import sys
from pathlib import Path

# `python -m pytest` run from a graphrt checkout puts the checkout first on sys.path, and
# with it the top-level kernels/ directory as a module named "kernels", hiding the PyPI
# package of that name (transformers >= 5.25 imports it when installed). graphrt is
# installed (its kernels as graphrt.kernels), so the tests do not need that entry.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]
if "kernels" in sys.modules and Path(getattr(sys.modules["kernels"], "__file__", "") or "").parent == _ROOT / "kernels":
    del sys.modules["kernels"]

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# Hypothesis profiles. "ci" (the default, what the README's test command runs) draws the
# same examples on every run: the seed comes from each test's source, and no database of
# earlier failures is read, so a CI result can be reproduced on any machine. "random"
# draws fresh examples, ten times as many (`_cases.examples`), for a developer's longer
# run: `python -m pytest -m hypothesis --hypothesis-profile=random` (add
# `--hypothesis-seed=N` to replay one). Either prints the blob that reproduces a failure.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("random", database=None, print_blob=True)
settings.load_profile("ci")

# Triton chooses compiled or interpreted kernels when they are defined, so decide before
# any test module imports graphrt.kernels.
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run the K-th of N parts of the collected tests (every N-th test from the K-th on, "
                          "in collection order, so that a parametrised family spreads over the parts): "
                          "a suite longer than one GPU call runs as N calls")


def shard_of(spec: str) -> tuple[int, int]:
    """(k, n) of a ``--shard K/N`` value, 1 <= k <= n."""
    try:
        k, n = (int(v) for v in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard takes K/N (two integers), got {spec!r}") from None
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard K/N needs 1 <= K <= N, got {spec!r}")
    return k, n


def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--shard")
    if spec is not None:
        k, n = shard_of(spec)
        kept = [item for i, item in enumerate(items) if i % n == k - 1]
        config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % n != k - 1])
        items[:] = kept
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    seed = os.environ.get("GRAPHRT_TEST_SEED", "fresh per test")
    mode = "cuda" if HAS_CUDA else "cpu (TRITON_INTERPRET=1)"
    return f"graphrt: kernels on {mode}; random seed {seed}"


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")
