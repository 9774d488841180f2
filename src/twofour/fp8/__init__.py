"""FP8 with current scaling (docs/design.md, section 1): quantization (:mod:`.quantize`), one FP8
GEMM through ``torch._scaled_mm`` or cuSPARSELt's FP8 2:4 GEMM (:mod:`.matmul`), and a linear
layer's three GEMMs in FP8 (:mod:`.linear`), each with its plain-torch reference."""

from .linear import FP8LinearFn, fp8_linear
from .matmul import refusals, scaled_mm, scaled_mm_available
from .quantize import (
    DEFAULT_SCALING,
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

__all__ = ["fake_fp8", "E4M3", "E5M2", "Scaling", "TENSORWISE", "ROWWISE", "SCALINGS", "DEFAULT_SCALING",
           "quantize", "quantize_t", "dequantize", "scaled_mm", "scaled_mm_available", "refusals", "fp8_linear",
           "FP8LinearFn"]
