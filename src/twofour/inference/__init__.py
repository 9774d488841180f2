"""From a trained 2:4 model to one that runs: compressed files, 2:4 kernels, Hugging Face round trips.

* :class:`SparseInferenceLinear`: a linear layer whose weight is 2:4 and stored as kept values
  and 2-bit positions (:mod:`twofour.inference.packed`). On a GPU with the fast path (sm80+, bf16/fp16,
  both dimensions multiples of 32) it builds cuSPARSELt's compressed operand once from them and
  runs 2:4 kernels only: cuSPARSELt's GEMM, or for up to 16 tokens the streaming kernels of
  :mod:`twofour.kernels.gemv24`, whichever measured faster for the shape. Elsewhere it
  multiplies by the dense matrix the values and positions stand for (exact).
* :func:`to_inference`: a trained model's :class:`~twofour.SparseLinear` layers become
  SparseInferenceLinear (their effective 2:4 weights) or, in a dense phase, plain layers.
* :func:`sparsify_for_inference`: the way back for a model saved with ``save_pretrained`` and
  loaded with ``from_pretrained``: its 2:4 layers become SparseInferenceLinear again.
* :func:`save_inference` / :func:`load_for_inference`: twofour's GPT or Llama to and from an export
  folder (``model.safetensors`` + ``model_config.json``, docs/export-format.md).
"""

from .convert import sparsify_for_inference, to_inference
from .format import FORMAT, FORMAT_VERSION, load_for_inference, read_export_config, save_inference
from .layer import HF_CONFIG_KEY, SparseInferenceLinear
from .sampling import generate

__all__ = ["SparseInferenceLinear", "to_inference", "sparsify_for_inference", "save_inference",
           "load_for_inference", "read_export_config", "FORMAT", "FORMAT_VERSION", "HF_CONFIG_KEY", "generate"]
