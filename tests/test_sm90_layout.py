"""CUTLASS's sm90 2:4 layout (``benchmarks/gemm/sm90/layout.py``, the benchmark
``gemm/cutlass_sm90.py``'s GEMM, out of the package) and the library's builder, on the CPU; the
GEMM itself on an H100/H200 (marked gpu)."""

import sys
from pathlib import Path

import pytest
import torch

from twofour.functional import mask_24
from twofour.kernels import compress as ck
from twofour.kernels import layout as cslt
from twofour.kernels.triton_common import HAS_TRITON

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gemm"))
from sm90 import cutlass as builder  # noqa: E402
from sm90 import gemm as sm90  # noqa: E402
from sm90 import layout as sm90_layout  # noqa: E402


def _pruned(m: int, k: int, seed: int = 0) -> torch.Tensor:
    w = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).bfloat16()
    return w * mask_24(w)


@pytest.mark.parametrize("shape", [(64, 128), (8, 256), (200, 384), (1000, 1280)])
def test_round_trip(shape):
    a = _pruned(*shape)
    values, e = sm90_layout.compress_reference(a)
    assert values.shape == (shape[0], shape[1] // 2) and e.numel() == sm90_layout.meta_bytes(*shape)
    assert torch.equal(sm90_layout.decompress_reference(values, e, *shape), a)


def test_pack_unpack_codes_and_padding():
    codes = torch.tensor(cslt.VALID_CODES, dtype=torch.int32)[torch.randint(0, 6, (72, 64))]
    e = sm90_layout.pack_meta(codes)
    assert e.numel() == 128 * 64 // 2  # rows padded to 128
    assert torch.equal(sm90_layout.unpack_meta(e, 72, 256), codes)


def test_nibble_positions_follow_the_atom():
    """Spot checks of the atom's formula: row r = 16 r2 + 8 r1 + r0, group g = 8 g2 + 4 g1 + g0 at nibble
    g0 + 4 r1 + 8 g2 + 32 r0 + 256 g1 + 512 r2; atoms by column block, then row block."""
    m, k = 128, 256
    order = sm90_layout._nibble_order(torch.arange(m * k // 4).reshape(m, k // 4))
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel())
    pos = pos.reshape(m, k // 4)
    assert pos[0, 1] == 1 and pos[8, 0] == 4 and pos[0, 8] == 8 and pos[1, 0] == 32
    assert pos[0, 4] == 256 and pos[16, 0] == 512 and pos[64, 0] == 2048 and pos[0, 32] == 2 * 2048


def test_from_cusparselt_matches_the_reference():
    a = _pruned(192, 512, seed=1)
    values, e = sm90_layout.from_cusparselt(cslt.compress_reference(a), 192, 512)
    ref_v, ref_e = sm90_layout.compress_reference(a)
    assert torch.equal(values, ref_v) and torch.equal(e, ref_e)


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 128"):
        sm90_layout.compress_reference(torch.zeros(8, 64))
    with pytest.raises(ValueError, match="exactly two"):
        sm90_layout.compress_reference(torch.ones(8, 128))


def test_configs_are_distinct_and_flagged():
    names = [c.name for c in builder.CONFIGS]
    assert len(set(names)) == len(names)
    pp = builder.GemmConfig((128, 128, 128), (2, 1), pingpong=True)
    assert pp.name == "t128x128x128_c2x1_pp" and "-DTWOFOUR_PINGPONG" in pp.defines()
    assert "-DTWOFOUR_CM=2" in pp.defines() and "-DTWOFOUR_PINGPONG" not in builder.CONFIGS[0].defines()


def test_missing_toolchain_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("TWOFOUR_CUTLASS", str(tmp_path / "none"))
    monkeypatch.setenv("TWOFOUR_NVCC", str(tmp_path / "nvcc"))
    monkeypatch.setattr(builder, "_find_cutlass", lambda: None)
    with pytest.raises(RuntimeError, match="needs the CUTLASS headers: pip install") as ex:
        builder.toolchain()
    assert "\n" not in str(ex.value)


def _no_build_here(monkeypatch, tmp_path) -> list:
    """A toolchain that exists only by name, an empty cache, no prebuilt library; the list
    collects every build() call instead of compiling."""
    monkeypatch.delenv("TWOFOUR_SM90_LIB", raising=False)
    monkeypatch.setenv("TWOFOUR_CACHE", str(tmp_path))
    monkeypatch.setattr(builder, "toolchain", lambda: builder.Toolchain(tmp_path / "nvcc", tmp_path))
    monkeypatch.setattr(builder, "_key", lambda tc, configs: "k")
    calls = []
    monkeypatch.setattr(builder, "build", lambda *a, **kw: calls.append(kw) or tmp_path / "built.so")
    return calls


def test_library_is_built_only_when_asked(monkeypatch, tmp_path):
    """No compile at first use by default (minutes of nvcc inside a training step): a one-line
    error naming the ways to build; with build_missing the builder runs; a cached build or
    TWOFOUR_SM90_LIB is returned as it is."""
    calls = _no_build_here(monkeypatch, tmp_path)
    with pytest.raises(RuntimeError, match="not built .*python -m sm90.cutlass") as ex:
        builder.library_path()
    assert "\n" not in str(ex.value) and calls == []
    assert builder.library_path(build_missing=True) == tmp_path / "built.so" and len(calls) == 1
    cached = tmp_path / "sm90" / "k" / builder.LIB_NAME
    cached.parent.mkdir(parents=True)
    cached.touch()
    assert builder.library_path() == cached and len(calls) == 1
    monkeypatch.setenv("TWOFOUR_SM90_LIB", str(tmp_path / "pre.so"))
    assert builder.library_path() == tmp_path / "pre.so" and len(calls) == 1


def test_build_command_line(monkeypatch, tmp_path, capsys):
    from sm90.cutlass import __main__ as cli

    calls = []
    monkeypatch.setattr(cli, "build", lambda configs, out_dir, jobs: calls.append((configs, out_dir, jobs)) or
                        tmp_path / builder.LIB_NAME)
    cli.main(["--jobs", "3", "--out", str(tmp_path)])
    assert calls == [(builder.CONFIGS, str(tmp_path), 3)]
    assert str(tmp_path / builder.LIB_NAME) in capsys.readouterr().out


def test_unbuilt_library_is_skipped_and_logged_once_per_process(monkeypatch, tmp_path, caplog):
    """Where the library is not built, :func:`available` is False at once, with one warning for the
    whole process, whatever the number of calls; nothing is compiled unless
    ``cutlass.build_kernels`` allows it."""
    from twofour import dispatch

    calls = _no_build_here(monkeypatch, tmp_path)
    monkeypatch.setattr(dispatch, "_failures", {})
    monkeypatch.setattr(sm90, "_lib", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(builder, "build_kernels", False)
    with caplog.at_level("WARNING", logger="twofour"):
        for _ in range(3):
            assert not sm90.available()
    warned = [r for r in caplog.records if "sm90" in r.getMessage()]
    assert len(warned) == 1 and "not built" in warned[0].getMessage() and calls == []
    assert list(dispatch.failures()) == [("sm90-cutlass", "load")]
    monkeypatch.setattr(dispatch, "_failures", {})
    builder.set_build_kernels(True)  # opted in: the builder runs (its stand-in makes no file)
    assert not sm90.available() and len(calls) == 1


def test_extra_not_installed_is_logged_at_info(monkeypatch, caplog):
    """No nvcc or CUTLASS headers (not installed) is a choice, not a failure:
    the route is skipped with one INFO line, no warning, on every rank of a run."""
    from twofour import dispatch

    monkeypatch.setattr(dispatch, "_failures", {})
    monkeypatch.setattr(sm90, "_lib", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(builder, "_find_cutlass", lambda: None)
    monkeypatch.delenv("TWOFOUR_SM90_LIB", raising=False)
    monkeypatch.delenv("TWOFOUR_CUTLASS", raising=False)
    monkeypatch.setattr(builder, "build_kernels", False)
    with caplog.at_level("INFO", logger="twofour"):
        assert not sm90.available() and not sm90.available()
    (record,) = [r for r in caplog.records if "sm90" in r.getMessage()]
    assert record.levelname == "INFO" and "pip install nvidia-cuda-nvcc" in record.getMessage()
    assert issubclass(builder.ToolchainMissing, RuntimeError)


def _toolchain_or_skip():
    try:
        return builder.toolchain()
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.mark.slow
def test_offsets_match_cutes_layout(tmp_path):
    """The byte of each row's pair of groups, from cute's layout in the built library's host code."""
    tc = _toolchain_or_skip()
    lib = sm90.load(builder.build(configs=(), out_dir=tmp_path, tc=tc))
    for m, k in ((64, 128), (200, 384), (256, 1280)):
        order = sm90_layout._nibble_order(torch.arange(-(-m // 64) * 64 * k // 4).reshape(-1, k // 4))
        pos = torch.empty_like(order)
        pos[order] = torch.arange(order.numel())
        pos = pos.reshape(-1, k // 4)[:m, 0::2]
        assert bool((pos % 2 == 0).all())  # even groups take the low nibble
        assert torch.equal(pos // 2, sm90.layout_e_offsets(m, k, lib))


@pytest.mark.gpu
def test_gemm_every_config_against_dense():
    """Every configuration against the dense product, odd token counts included; the compression
    kernel's bytes against CUTLASS's own compressor."""
    if not torch.cuda.is_available() or not sm90.available():
        pytest.skip("needs an sm90 GPU and the sm90 library")
    for t, k, m in ((1, 128, 64), (77, 1280, 5120), (1000, 4096, 1104), (4097, 1280, 256)):
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        buf, wd = ck.compress(torch.randn(m, k, device="cuda"), "hard", dense_out=True, layout=ck.SM90)
        values, e = sm90_layout.split(buf, m, k)
        cv, ce = sm90.compress_cutlass(wd)
        assert torch.equal(sm90_layout.unpack_meta(ce, m, k), sm90_layout.unpack_meta(e, m, k))  # rows < m
        assert torch.equal(cv[:m].view(torch.int16), values.view(torch.int16))
        ref = x.float() @ wd.float().t()
        for cfg in sm90.configs():
            y = sm90.gemm(values, e, x, cfg).float()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            assert err < 2e-2, f"{cfg.name} at {(t, k, m)}: max relative error {err:.3g}"


@pytest.mark.triton
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("shape", [(64, 128), (200, 256), (72, 384)])
@pytest.mark.parametrize("tile", [(32, 2), (128, 4), (256, 8)])
def test_compression_kernel_writes_the_sm90_layout(shape, tile, device):
    """The fused kernel with ``layout=SM90``: values and E as the reference writes them, every tile width."""
    w = torch.randn(shape, device=device)
    buf, dense = ck.compress_tiled(w, "hard", tile=tile, dense_out=True, layout=ck.SM90)
    values, e = sm90_layout.split(buf, *shape)
    ref_v, ref_e = sm90_layout.compress_reference(dense.cpu())
    assert torch.equal(values.cpu(), ref_v) and torch.equal(e.cpu(), ref_e)
    with pytest.raises(ValueError, match="multiple of 128"):
        ck.compress(torch.randn(64, 96, device=device), "hard", layout=ck.SM90)
