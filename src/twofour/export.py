"""``twofour export``: a trained run's weights for inference, with every sparse layer's weight
replaced by its effective 2:4 weight, so the file loads into a plain dense model too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from . import sparse_layers
from .layer import RECIPE_BUFFERS
from .train import CKPT, TrainConfig, TrainError, build_model

__all__ = ["export"]


def export(run: str | Path, out: str | Path | None = None) -> dict[str, Any]:
    """Write ``model.safetensors`` (or ``.pt`` without safetensors) and ``model_config.json``."""
    path = Path(run)
    ckpt_path = path / CKPT if path.is_dir() else path
    if not ckpt_path.exists():
        raise TrainError(f"no checkpoint at {ckpt_path}")
    try:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        cfg = TrainConfig(**{k: v for k, v in ckpt["config"].items() if k in TrainConfig.__dataclass_fields__})
    except Exception as e:
        raise TrainError(f"{ckpt_path} is not a readable twofour checkpoint ({type(e).__name__})") from None
    vocab = ckpt["model"]["wte.weight"].shape[0]
    model = build_model(cfg, vocab)
    model.load_state_dict(ckpt["model"])
    sparse = 0
    with torch.no_grad():
        for _, layer in sparse_layers(model):
            if layer.recipe.sparse:
                layer.weight.copy_(layer.effective_weight())
                sparse += 1
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()
               if k.rpartition(".")[2] not in RECIPE_BUFFERS and k != "lm_head.weight"}
    out = Path(out) if out else ckpt_path.parent / "model.safetensors"
    try:
        from safetensors.torch import save_file  # noqa: PLC0415

        save_file(tensors, str(out))
    except ImportError:
        out = out.with_suffix(".pt")
        torch.save(tensors, out)
    meta = {"preset": cfg.model, "vocab_size": vocab, "block_size": cfg.seq_len, "recipe": cfg.recipe,
            "sparse_layers": sparse, "tied_lm_head": True, "step": ckpt["step"]}
    out.with_name("model_config.json").write_text(json.dumps(meta, indent=2))
    return {"weights": str(out), **meta}
