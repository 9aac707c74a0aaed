import os

import pytest
import torch

# Triton chooses compiled or interpreted kernels when they are defined, so decide before
# any test module imports graphrt.kernels.
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
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
