"""Two small, readable decoder-only models (after nanoGPT) and the presets twofour trains.

:class:`GPT` (GPT-2): LayerNorm, learned positions, a GELU FFN. Its FFN linears are ``mlp.fc``
and ``mlp.proj``; attention uses ``attn.qkv`` and ``attn.proj``; the output head ``lm_head`` is
tied to the token embedding.

:class:`Llama` (Llama-style): RMSNorm, rotary positions, no biases, a gated FFN (SwiGLU,
``down(silu(gate(x)) * up(x))``) whose gate and up are one linear ``mlp.gate_up`` with their
output rows interleaved (:mod:`twofour.activations`), and ``mlp.down``; attention ``attn.qkv`` and
``attn.proj`` as GPT's; the head is tied to the embedding only if the config says so.
"""

from .common import ATTN_PATTERNS, FFN_IN_PATTERNS, FFN_PATTERNS, GPTConfig, KVCache, LlamaConfig
from .gpt import GPT
from .llama import GatedMLP, Llama
from .presets import PRESETS, Preset, build_model, from_preset

__all__ = ["GPTConfig", "GPT", "LlamaConfig", "Llama", "GatedMLP", "KVCache", "Preset", "PRESETS", "FFN_PATTERNS",
           "FFN_IN_PATTERNS", "ATTN_PATTERNS", "build_model",
           "from_preset"]
