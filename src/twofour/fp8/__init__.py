"""FP8 with current scaling (docs/design.md, section 1): which GEMMs run in FP8 and how
(:class:`Precision` and its presets, :mod:`.precision`), quantization (:mod:`.quantize`), one FP8
GEMM through ``torch._scaled_mm`` or cuSPARSELt's FP8 2:4 GEMM (:mod:`.matmul`), and a linear
layer's three GEMMs in FP8 (:mod:`.linear`), each with its plain-torch reference."""

from .linear import FP8LinearFn, fp8_linear
from .matmul import refusals, scaled_mm, scaled_mm_available
from .precision import BF16, FP8, PRECISIONS, Precision, as_precision
from .quantize import (
    E4M3,
    E5M2,
    ROWWISE,
    SCALINGS,
    TENSORWISE,
    Scaling,
    dequantize,
    fake_fp8,
    quantize,
    quantize_t,
)

__all__ = ["fake_fp8", "E4M3", "E5M2", "Scaling", "TENSORWISE", "ROWWISE", "SCALINGS", "quantize", "quantize_t",
           "dequantize", "scaled_mm", "scaled_mm_available", "refusals", "fp8_linear", "FP8LinearFn", "Precision",
           "PRECISIONS", "BF16", "FP8", "as_precision"]
