"""The compressed layout: reference against bytes cuSPARSELt 0.8 wrote on an H200, and round trips."""

from pathlib import Path

import pytest
import torch

from twofour.functional import mask_24
from twofour.kernels.layout import compress_reference, compressed_size, decompress_reference

DUMP = Path(__file__).parent / "data" / "cusparselt_compressed_h200.pt"


def test_matches_bytes_written_by_cusparselt():
    """benchmarks/gemm/probe_layout.py (since removed, in the git history) compressed these on the GPU; every
    byte must agree."""
    for rec in torch.load(DUMP):
        m, k = rec["m"], rec["k"]
        assert compressed_size(m, k) == rec["size"]
        for mask, dense, comp in zip(rec["masks"], rec["dense"], rec["comp"]):
            assert torch.equal(compress_reference(dense.view(torch.bfloat16), mask), comp)


@pytest.mark.parametrize("shape", [(64, 32), (100, 96), (128, 256), (7, 64)])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_round_trip(shape, dt):
    w = torch.randn(shape).to(dt)
    a = w * mask_24(w)
    buf = compress_reference(a, mask_24(w))
    assert buf.dtype == torch.uint8 and buf.numel() == compressed_size(*shape)
    assert torch.equal(decompress_reference(buf, *shape, dt), a)


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        compress_reference(torch.zeros(8, 16))
    with pytest.raises(ValueError, match="exactly two"):
        compress_reference(torch.ones(8, 32))


DUMP_E4M3 = Path(__file__).parent / "data" / "cusparselt_compressed_e4m3_h100.pt"


def test_e4m3_matches_bytes_written_by_cusparselt():
    """benchmarks/gemm/probe_layout_fp8.py (since removed, in the git history) compressed these e4m3
    matrices (random non-zero bytes kept) on the GPU, padding rows included; every byte must agree,
    and decompressing gives them back."""
    for rec in torch.load(DUMP_E4M3):
        m, k = rec["m"], rec["k"]
        for dense, comp in zip(rec["dense"], rec["comp"]):
            a = dense.view(torch.float8_e4m3fn)
            assert compressed_size(m, k, 1) == comp.numel()
            assert torch.equal(compress_reference(a), comp)
            assert torch.equal(decompress_reference(comp, m, k, torch.float8_e4m3fn).view(torch.uint8), dense)


def test_e4m3_needs_whole_64_column_tiles():
    with pytest.raises(ValueError, match="multiple of 64"):
        compress_reference(torch.zeros(64, 32).to(torch.float8_e4m3fn))
