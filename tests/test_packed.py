"""The export's 2:4 format (values + 2-bit positions) and the GEMV kernel that reads it, against
plain torch (the kernel under Triton's interpreter on the CPU)."""

import pytest
import torch

from twofour.functional import mask_24, soft_threshold_24, transposable_mask_24
from twofour.inference.packed import check_positions, pack_24
from twofour.kernels.gemv24 import HAS_TRITON, MAX_TOKENS, gemv24, reference
from twofour.kernels.layout import (
    compress_codes,
    compress_reference,
    decompress_reference,
    position_codes,
    positions_width,
    unpack_24,
)


def random_24(shape, kind="hard", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    if kind == "soft":  # S-STE's: some groups keep fewer than two non-zeros
        w = soft_threshold_24(w)
    elif kind == "transposable":
        w = w * transposable_mask_24(w)
    else:
        w = w * mask_24(w)
    w[0, :8] = 0  # whole groups of zeros
    return w.to(dtype)


@pytest.mark.parametrize("kind", ["hard", "soft", "transposable"])
@pytest.mark.parametrize("shape", [(16, 32), (12, 36), (7, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip(kind, shape, dtype):
    w = random_24(shape, kind if shape[0] % 4 == 0 or kind != "transposable" else "hard", dtype)
    values, positions = pack_24(w)
    assert values.shape == (shape[0], shape[1] // 2) and values.dtype == dtype
    assert positions.shape == (shape[0], positions_width(shape[1])) and positions.dtype == torch.uint8
    assert torch.equal(unpack_24(values, positions, shape[1]), w)
    check_positions(positions, shape[1])  # every stored code names two distinct positions


def test_bytes_in_bf16_are_0_5625_of_dense():
    w = random_24((256, 1024), dtype=torch.bfloat16)
    values, positions = pack_24(w)
    assert (values.nbytes + positions.nbytes) / w.nbytes == 0.5625


def test_codes_are_the_kept_positions():
    w = torch.tensor([[0.0, 3.0, 0.0, -1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 6.0]])
    values, positions = pack_24(w)
    assert values.tolist() == [[3.0, -1.0, 2.0, 0.0, 5.0, 6.0]]
    # i0 | i1 << 2: (1, 3) -> 13, (0, 1) -> 4 (a lone value keeps the lowest free slot), (2, 3) -> 14
    assert position_codes(positions, 12).tolist() == [[13, 4, 14]]
    assert positions.tolist() == [[13 | 4 << 4, 14]]  # two groups a byte, a last odd group alone


def test_not_24_is_refused_by_name():
    w = random_24((8, 32))
    w[5, 8:12] = torch.tensor([1.0, 1.0, 1.0, 0.0])
    with pytest.raises(ValueError, match="row 5, columns 8-11 hold 3 non-zeros"):
        pack_24(w)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_24(torch.zeros(4, 6))


def test_invalid_positions_are_refused():
    _, positions = pack_24(random_24((4, 32)))
    positions[2, 1] = 0x55  # code 5 = positions 1 and 1
    with pytest.raises(ValueError, match="row 2, group 2 holds code 5"):
        check_positions(positions, 32, "fc.positions")


@pytest.mark.parametrize("shape", [(64, 32), (100, 96), (7, 128)])
def test_cusparselt_operand_from_values_and_codes(shape):
    """The GPU builds cuSPARSELt's compressed operand from the stored values and positions; it
    must be byte for byte the reference compression of the dense matrix."""
    w = random_24(shape, dtype=torch.bfloat16)
    values, positions = pack_24(w)
    buf = compress_codes(values, position_codes(positions, shape[1]))
    keep = unpack_24(torch.ones_like(values), positions, shape[1]) != 0
    assert torch.equal(buf, compress_reference(w, keep))
    assert torch.equal(decompress_reference(buf, *shape, torch.bfloat16), w)


needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


@needs_triton
@pytest.mark.parametrize("pairs", [False, True], ids=["tiles", "pairs"])
@pytest.mark.parametrize("tokens", [1, 3, MAX_TOKENS])
@pytest.mark.parametrize("shape", [(64, 128), (40, 96), (33, 260)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_gemv_kernel_matches_reference(tokens, shape, dtype, tol, device, pairs):
    n, k = shape
    w = random_24(shape, dtype=dtype)
    values, positions = (t.to(device) for t in pack_24(w))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, k, generator=g).to(dtype).to(device)
    bias = torch.randn(n, generator=g).to(dtype).to(device)
    for b in (bias, None):
        want = reference(x.float(), values.float(), positions, None if b is None else b.float())
        got = gemv24(x, values, positions, b, config=(16, 128, 4, 1, pairs))
        assert got.shape == (tokens, n) and got.dtype == dtype
        assert ((got.float() - want).abs().max() / want.abs().max()).item() < tol


@needs_triton
def test_gemv_kernel_split_k_matches_reference(device):
    """Inputs split over programs (partials summed by a second kernel, bias added once): any split,
    a short last split included."""
    w = random_24((40, 288))
    values, positions = (t.to(device) for t in pack_24(w))
    x = torch.randn(3, 288, device=device)
    bias = torch.randn(40, device=device)
    for b in (bias, None):
        want = reference(x, values, positions, b)
        for config in [(8, 32, 4, 2), (8, 64, 4, 4), (16, 32, 4, 9), (8, 128, 4, 5), (8, 64, 4, 4, True),
                       (16, 32, 4, 9, True)]:
            torch.testing.assert_close(gemv24(x, values, positions, b, config=config), want, rtol=1e-5, atol=1e-5)


@needs_triton
def test_gemv_kernel_reads_strided_input_and_any_tile(device):
    w = random_24((48, 128))
    values, positions = (t.to(device) for t in pack_24(w))
    x = torch.randn(128, 4, device=device).t()  # column-major (4, 128)
    want = reference(x, values, positions)
    # both kernels (pair loads last), split-K too
    for config in [(4, 256, 2), (16, 128, 4), (32, 64, 4), (8, 32, 4, 3), (4, 64, 2, 8), (4, 256, 2, 1, True),
                   (32, 64, 4, 3, True)]:
        torch.testing.assert_close(gemv24(x, values, positions, config=config), want, rtol=1e-5, atol=1e-5)


@needs_triton
def test_gemv_kernel_bad_input():
    values, positions = pack_24(random_24((8, 32)))
    with pytest.raises(ValueError, match="1 to 8 tokens"):
        gemv24(torch.zeros(9, 32), values, positions)
    with pytest.raises(ValueError, match="don't describe"):
        gemv24(torch.zeros(1, 64), values, positions)
    with pytest.raises(TypeError, match="share a dtype"):
        gemv24(torch.zeros(1, 32, dtype=torch.float16), values, positions)
