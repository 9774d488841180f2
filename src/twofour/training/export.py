"""``twofour export``: a trained run as an inference folder (docs/export-format.md): every 2:4
layer's effective weight as kept values + 2-bit positions, the dense layers as they are, and
``model_config.json`` with what :func:`twofour.load_for_inference` needs to rebuild it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import TrainError
from ..inference.format import save_inference
from ..inference.sampling import BYTES, CharCodec, Codec, IdCodec
from .checkpoint import load_model, read_checkpoint
from .config import TrainConfig
from .data import is_shard_folder, read_meta
from .loop import build_model

__all__ = ["export", "run_codec", "run_model"]


def run_codec(cfg: TrainConfig, vocab_size: int) -> Codec:
    """How a run's tokens map to text: bytes for every text corpus (vocabulary 256), nanoGPT's
    characters for token shards whose ``meta.pkl`` has ``itos``, else bare token ids."""
    data = cfg.data
    folder = Path(data) if data and not data.startswith("hf:") else None
    if folder is not None and is_shard_folder(folder):
        meta = folder / "meta.pkl"
        itos = read_meta(meta).get("itos") if meta.exists() else None
        if isinstance(itos, dict) and sorted(itos) == list(range(vocab_size)):
            itos = [itos[i] for i in range(vocab_size)]
        if isinstance(itos, list) and len(itos) == vocab_size and all(isinstance(s, str) for s in itos):
            return CharCodec(itos)
        return IdCodec(vocab_size)
    return BYTES if vocab_size == 256 else IdCodec(vocab_size)


def run_model(run: str | Path) -> tuple[torch.nn.Module, TrainConfig, dict[str, Any]]:
    """The model a run's checkpoint holds (a run folder or checkpoint file; an FSDP2 run's shards
    too, read into the whole model in one process), on the CPU, with the run's config and the
    checkpoint. TrainError, one line, for a checkpoint that can't be read."""
    ckpt = read_checkpoint(run)
    try:
        cfg = TrainConfig.from_dict(ckpt["config"])
        model = build_model(cfg, cfg.recipe_object(), ckpt["vocab_size"])
        load_model(ckpt, model)
    except TrainError:
        raise
    except Exception as e:
        raise TrainError(f"{run} is not a readable twofour checkpoint ({type(e).__name__}: {e})") from None
    return model, cfg, ckpt


def export(run: str | Path, out: str | Path | None = None, dtype: str = "bfloat16", *,
           weights_format: str = "safetensors", overwrite: bool = False) -> dict[str, Any]:
    """Write the run's model for inference into the folder ``out`` (default: the run's folder):
    ``model.safetensors`` (``model.pt`` with ``weights_format="pt"``) and ``model_config.json``;
    an export already there is refused unless ``overwrite``.

    A run that ended in a dense phase (t-sr-ste's dense fine-tune) is exported dense, and the
    returned config says so (``dense``, ``dense_reason``). Returns the config written."""
    model, cfg, ckpt = run_model(run)
    path = Path(run)
    out = Path(out) if out else (path if path.is_dir() else path.parent)
    try:
        codec = run_codec(cfg, model.vocab_size)
    except Exception:  # a meta.pkl that moved or broke: the model is still worth exporting
        codec = IdCodec(model.vocab_size)
    meta = {"preset": cfg.model, "recipe": cfg.recipe, "step": ckpt["step"], "tokenizer": codec.to_dict()}
    with torch.no_grad():
        return {"out": str(out), **save_inference(model, out, dtype=dtype, meta=meta, weights_format=weights_format,
                                                  overwrite=overwrite)}
