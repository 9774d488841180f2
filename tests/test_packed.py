"""The export's 2:4 format (values + 2-bit positions) and the GEMV kernel that reads it, against
plain torch (the kernel under Triton's interpreter on the CPU)."""

import pytest
import torch

from twofour import dispatch
from twofour.functional import mask_24, soft_threshold_24, transposable_mask_24
from twofour.inference.packed import check_positions, pack_24
from twofour.kernels import gemv24 as gemv_module
from twofour.kernels.gemv24 import (
    CONFIGS,
    DOT_MIN,
    HAS_TRITON,
    MAX_TOKENS,
    MULTI_TOKENS,
    Config,
    configs_for,
    gemv24,
    permute_x,
    reference,
)
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


#: one configuration of each kernel, small enough for the interpreter
QUAD, MULTI, PAIRS = Config("quad", 16, 128, 4), Config("quad_multi", 16, 32, 4), Config("pairs", 16, 128, 4)
MMA = Config("quad_mma", 16, 128, 4)


def _check_gemv(x, values, positions, bias, config, tol):
    want = reference(x.float(), values.float(), positions, None if bias is None else bias.float())
    got = gemv24(x, values, positions, bias, config=config)
    assert got.shape == want.shape and got.dtype == x.dtype
    assert ((got.float() - want).abs().max() / want.abs().max()).item() < tol, config


@needs_triton
@pytest.mark.parametrize("tokens", [1, 2, 3, 8, MAX_TOKENS])
@pytest.mark.parametrize("shape", [(64, 128), (40, 96), (33, 264)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_gemv_kernel_matches_reference(tokens, shape, dtype, tol, device):
    """Every kernel that reads the dtype, with and without bias, rows and inputs not multiples of
    the tile (masked loads). The interpreter's tl.dot is wrong for bf16 (Triton 3.9 on the CPU):
    the tensor-core kernels in bf16 are checked on the GPU (test_gpu_gemv_configs_match_reference)."""
    n, k = shape
    w = random_24(shape, dtype=dtype)
    values, positions = (t.to(device) for t in pack_24(w))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, k, generator=g).to(dtype).to(device)
    bias = torch.randn(n, generator=g).to(dtype).to(device)
    configs = [PAIRS] + ([QUAD] if tokens == 1 and dtype != torch.float32 else [])
    configs += [MULTI] if tokens <= MULTI_TOKENS and dtype != torch.float32 else []
    configs += [MMA] if dtype == torch.float16 or (dtype == torch.bfloat16 and device.type == "cuda") else []
    for b in (bias, None):
        for config in configs:
            _check_gemv(x, values, positions, b, config, tol)


@needs_triton
def test_gemv_kernel_split_k_matches_reference(device):
    """Inputs split over programs (partials summed by a second kernel, bias added once): any split,
    a short last split included, for every kernel."""
    w = random_24((40, 288), dtype=torch.float16)
    values, positions = (t.to(device) for t in pack_24(w))
    bias = torch.randn(40, device=device).half()
    for tokens in (1, 3):
        x = torch.randn(tokens, 288, device=device).half()
        for b in (bias, None):
            for config in [Config("pairs", 8, 32, 4, 2), Config("pairs", 16, 32, 4, 9),
                           Config("quad_mma", 16, 128, 4, 2), Config("quad_mma", 32, 128, 4, 3),
                           Config("quad_mma", 16, 128, 4, 9),
                           Config("quad_multi", 16, 32, 4, 2), Config("quad_multi", 8, 64, 2, 5)]:
                _check_gemv(x, values, positions, b, config, 2e-3)
            if tokens == 1:
                for config in [Config("quad", 8, 64, 2, 4), Config("quad", 16, 128, 4, 2), Config("quad", 8, 64, 2, 5)]:
                    _check_gemv(x, values, positions, b, config, 2e-3)


@needs_triton
def test_gemv_kernel_reads_strided_input_and_any_tile(device):
    w = random_24((48, 128), dtype=torch.float16)
    values, positions = (t.to(device) for t in pack_24(w))
    x = torch.randn(128, 4, device=device).half().t()  # column-major (4, 128)
    for config in [Config("pairs", 4, 256, 2), Config("pairs", 32, 64, 4, 3), Config("quad_mma", 16, 256, 4),
                   Config("quad_mma", 64, 128, 4, 2), Config("quad_multi", 32, 32, 4)]:
        _check_gemv(x, values, positions, None, config, 2e-3)
    for config in [Config("quad", 8, 256, 2), Config("quad", 32, 64, 4, 3)]:
        _check_gemv(x[:1], values, positions, None, config, 2e-3)


def test_gemv_configs_per_token_count():
    """What the GPU measures: the one-token quad kernel only at one token, the multi-token CUDA-core
    one from 2 to MULTI_TOKENS, the tensor-core kernels at every count, the pairs kernel where it fits
    (alone for weights the quad kernels can't read)."""
    for tokens in range(1, MAX_TOKENS + 1):
        kinds = {c.kernel for c in configs_for(tokens)}
        want = ({"quad_mma"} | ({"quad"} if tokens == 1 else set())
                | ({"quad_multi"} if 1 < tokens <= MULTI_TOKENS else set()) | ({"pairs"} if tokens <= 8 else set()))
        assert kinds == want  # past 8 tokens no pairs tile fits
        assert {c.kernel for c in configs_for(tokens, quad=False)} == {"pairs"}
    assert len({c.name for c in CONFIGS}) == len(CONFIGS)


def test_gemv_configs_build_only_dots_triton_accepts():
    """Triton refuses a tl.dot with a dimension under 16 on the GPU (the interpreter doesn't check):
    every shipped tensor-core configuration is at or above it, and a smaller one can't be made."""
    dots = [c.dot_shape for c in CONFIGS if c.kernel == "quad_mma"]
    assert {c.kernel for c in CONFIGS if c.dot_shape} == {"quad_mma"}
    assert all(min(d) >= DOT_MIN for d in dots)
    assert all(c.dot_shape is None for c in CONFIGS if c.kernel != "quad_mma")
    for bad in [("quad_mma", 16, 64, 4), ("quad_mma", 8, 128, 4), ("quad", 16, 100, 4), ("pairs", 12, 64, 4),
                ("pairs", 16, 2, 4), ("quad_mma", 64, 256, 4, 0), ("quad_dot", 64, 256, 4), ("gemm", 16, 128, 4)]:
        with pytest.raises(ValueError, match="gemv24 Config"):
            Config(*bad)


@needs_triton
@pytest.mark.parametrize("tokens", [1, 5, MAX_TOKENS])
def test_gemv_launch_gives_tl_dot_at_least_16(tokens, monkeypatch):
    """What each measured tensor-core configuration hands the kernel: tokens padded to 16, rows and
    quads a step (tl.dot's M, N, K) all >= 16, whatever the split."""
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((kw["BO"], kw["BT"], kw["BQ"]) if "BQ" in kw else None)

    kernels = {k: Recorder() for k in ("quad", "quad_multi", "quad_mma")}
    monkeypatch.setattr(gemv_module, "quad_kernels", lambda: kernels)
    monkeypatch.setattr(gemv_module, "_sum_splits", Recorder())  # the partials' sum: recorded apart
    values, positions = pack_24(random_24((96, 1376), dtype=torch.float16))
    x, y = torch.zeros(tokens, 1376, dtype=torch.float16), torch.empty(tokens, 96, dtype=torch.float16)
    dot = [c for c in configs_for(tokens) if c.kernel == "quad_mma"]
    for config in dot:
        gemv_module.launch(x, values, positions, None, y, config)
    dots = [shape for shape in seen if shape is not None]
    assert len(dots) == len(dot) and all(min(shape) >= DOT_MIN for shape in dots)


def test_gemv_choice_is_looked_up_once_per_shape(monkeypatch):
    """The measured configuration is kept per shape, token bucket, dtype and bias, so a decoding step
    does not rebuild the candidates at every call; a choice set or cleared, or another
    TWOFOUR_GEMM mode, looks it up again, and a capture's unmeasured stand-in is not kept."""
    calls = []
    monkeypatch.setattr(gemv_module, "_choose", lambda *a: calls.append(a) or CONFIGS[len(calls) % len(CONFIGS)])
    monkeypatch.setattr(gemv_module, "_chosen", {})
    monkeypatch.setattr(dispatch, "can_measure", lambda: True)  # as on a GPU outside a capture
    values, positions = pack_24(random_24((32, 64), dtype=torch.float16))
    x, y = torch.zeros(3, 64, dtype=torch.float16), torch.empty(3, 32, dtype=torch.float16)
    first = gemv_module._config(x, values, positions, None, y, True)
    assert gemv_module._config(x[:4], values, positions, None, y, True) == first and len(calls) == 1
    gemv_module._config(x[:1], values, positions, None, y, True)  # another token bucket
    gemv_module._config(x, values, positions, y[0], y, True)  # with a bias
    assert len(calls) == 3
    dispatch.clear_choices()
    gemv_module._config(x, values, positions, None, y, True)
    with dispatch.override(gemm="dense"):
        gemv_module._config(x, values, positions, None, y, True)
    assert len(calls) == 5
    monkeypatch.setattr(dispatch, "can_measure", lambda: False)
    monkeypatch.setattr(gemv_module, "_chosen", {})
    for _ in range(2):
        gemv_module._config(x, values, positions, None, y, True)
    assert len(calls) == 7


@needs_triton
def test_gemv_kernel_bad_input():
    values, positions = pack_24(random_24((8, 32)))
    with pytest.raises(ValueError, match=f"1 to {MAX_TOKENS} tokens"):
        gemv24(torch.zeros(MAX_TOKENS + 1, 32), values, positions)
    with pytest.raises(ValueError, match="16-bit values"):  # float32: only the pairs kernel reads it
        gemv24(torch.zeros(1, 32), values, positions, config=QUAD)
    half = (values.half(), positions)
    with pytest.raises(ValueError, match="at most 1 token"):
        gemv24(torch.zeros(2, 32, dtype=torch.float16), *half, config=QUAD)
    with pytest.raises(ValueError, match=f"at most {MULTI_TOKENS} token"):
        gemv24(torch.zeros(MULTI_TOKENS + 1, 32, dtype=torch.float16), *half, config=MULTI)
    with pytest.raises(ValueError, match="don't describe"):
        gemv24(torch.zeros(1, 64), values, positions)
    with pytest.raises(TypeError, match="share a dtype"):
        gemv24(torch.zeros(1, 32, dtype=torch.float16), values, positions)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 512), (96, 1376)])
def test_gpu_gemv_configs_match_reference(shape):
    """Every configuration the GPU measures, bf16, at 1, 2, 5 and 16 tokens: rows and quads that fill
    whole tiles, and ones that don't (1376 inputs: 172 quads)."""
    n, k = shape
    values, positions = (t.cuda() for t in pack_24(random_24(shape, dtype=torch.bfloat16)))
    bias = torch.randn(n, device="cuda").bfloat16()
    for tokens in (1, 2, 5, MAX_TOKENS):
        x = torch.randn(tokens, k, device="cuda").bfloat16()
        for config in configs_for(tokens):
            _check_gemv(x, values, positions, bias, config, 2e-2)
        _check_gemv(x, values, positions, None, None, 2e-2)  # the measured choice


@needs_triton
def test_gemv_permuted_input_is_x_by_position_in_quad(device):
    """The tensor-core kernel's operand: entry (e, q, t) is x[t, 8 q + e], tokens past x's zero, from
    row-major and strided inputs alike."""
    x = torch.randn(64, 3, device=device).half().t()  # column-major (3, 64)
    got = permute_x(x, 16)
    want = torch.zeros(8, 8, 16, dtype=torch.float16, device=device)
    want[:, :, :3] = x.reshape(3, 8, 8).permute(2, 1, 0)
    assert torch.equal(got, want)
