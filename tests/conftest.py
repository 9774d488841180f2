import os
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:  # Triton kernels run under its interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: Every device-agnostic test runs on the CPU and, where there is one, on the GPU.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).split(".")[-1])
def dtype(request):
    return request.param


def seeded(seed, device="cpu"):
    return torch.Generator(device=device).manual_seed(seed)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small text file, so the tests don't read the whole standard library each time."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    src = Path(torch.__file__).parent / "nn" / "modules"
    path.write_bytes(b"".join(p.read_bytes() for p in sorted(src.glob("*.py"))[:8]))
    return str(path)
