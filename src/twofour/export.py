"""``twofour export``: a trained run's weights for inference, with every sparse layer's weight
replaced by its effective 2:4 weight, so the file loads into a plain dense model too."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import torch

from . import sparse_layers
from .config import TrainConfig, TrainError
from .layer import RECIPE_BUFFERS
from .runs import MODEL_CONFIG, WEIGHTS, read_checkpoint
from .train import build_model

__all__ = ["export"]


def export(run: str | Path, out: str | Path | None = None) -> dict[str, Any]:
    """Write ``model.safetensors`` (or ``.pt`` without safetensors) and ``model_config.json``.

    Weights tied to another (the model's ``tied_weights``, e.g. GPT's output head) are stored
    once, under their source's name."""
    ckpt = read_checkpoint(run)
    try:
        cfg = TrainConfig.from_dict(ckpt["config"])
        model = build_model(cfg, cfg.recipe_object(), ckpt["vocab_size"])
        model.load_state_dict(ckpt["model"])
    except TrainError:
        raise
    except Exception as e:
        raise TrainError(f"{run} is not a readable twofour checkpoint ({type(e).__name__}: {e})") from None
    sparse = 0
    with torch.no_grad():
        for _, layer in sparse_layers(model):
            if layer.recipe.sparse:
                layer.weight.copy_(layer.effective_weight())
                sparse += 1
    tied = dict(getattr(model, "tied_weights", {}))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()
               if k.rpartition(".")[2] not in RECIPE_BUFFERS and k not in tied}
    path = Path(run)
    out = Path(out) if out else (path if path.is_dir() else path.parent) / WEIGHTS
    try:
        from safetensors.torch import save_file  # noqa: PLC0415

        save_file(tensors, str(out))
    except ImportError:
        out = out.with_suffix(".pt")
        torch.save(tensors, out)
    meta = {"preset": cfg.model, "vocab_size": model.vocab_size, "block_size": cfg.seq_len, "recipe": cfg.recipe,
            "sparse_layers": sparse, "tied_lm_head": bool(tied), "tied_weights": tied, "step": ckpt["step"]}
    config = out.with_name(MODEL_CONFIG)
    config.write_text(json.dumps(meta, indent=2))
    out.chmod(stat.S_IMODE(config.stat().st_mode))  # safetensors creates its file private (0600)
    return {"weights": str(out), **meta}
