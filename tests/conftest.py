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
    if not HAS_CUDA:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    elif os.environ.get("TRITON_INTERPRET") != "1":  # a GPU machine: Triton compiles for the GPU alone
        skip = pytest.mark.skip(reason="a Triton kernel takes CPU tensors only under TRITON_INTERPRET=1")
        for item in items:
            on_cpu = getattr(item, "callspec", None) and item.callspec.params.get("device") == "cpu"
            cpu_only = "gpu" not in item.keywords and "device" not in item.fixturenames
            if "triton" in item.keywords and (on_cpu or cpu_only):
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from a clean Dynamo: a layer traced in one mode (FP8, say) left state that
    broke the next test's full-graph trace of another mode on the GPU (torch 2.11)."""
    yield
    torch._dynamo.reset()


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
