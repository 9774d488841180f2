"""twofour's own CUTLASS sm90 2:4 GEMM, kept as a benchmark (it never beat cuSPARSELt:
docs/notes/own-gemm.md): ``layout.py`` its metadata layout in plain torch, ``cutlass/`` the
library's sources and builder, ``gemm.py`` the ctypes binding. ``gemm/cutlass_sm90.py`` and
``tests/test_sm90_layout.py`` import it with ``benchmarks/gemm`` on ``sys.path``."""
