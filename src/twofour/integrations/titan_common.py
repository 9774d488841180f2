"""What twofour's torchtitan 0.2.2 and 0.3 integrations share, none of it importing torchtitan:
the layer names they cover, the recipe a section or converter names (with torchtitan's limits),
and a checkpoint of a twofour run as one safetensors file of 2:4 weights (read through
torch.distributed.checkpoint).

    python -m twofour.integrations.torchtitan CHECKPOINT OUT.safetensors [--dtype bfloat16]
"""

import argparse
import tempfile
from pathlib import Path

import torch

from ..errors import TrainError
from ..sparse import Recipe, make_recipe
from ..sparse.layer import RECIPE_BUFFERS
from ..sparse.pruners import SOFT

__all__ = ["NAME", "FFN_LINEARS", "ATTENTION_LINEARS", "titan_recipe", "export_checkpoint", "main"]

#: The converter's name (``[model] converters`` in 0.2.2, torchtitan's logs in 0.3).
NAME = "twofour"
#: torchtitan's Llama 3 FFN linears (``layers.<i>.feed_forward.w1``), the default ``include``.
FFN_LINEARS: tuple[str, ...] = ("*.feed_forward.w1", "*.feed_forward.w2", "*.feed_forward.w3")
#: Its attention projections, to add to ``include`` for a 2:4 attention as well.
ATTENTION_LINEARS: tuple[str, ...] = ("*.attention.wq", "*.attention.wk", "*.attention.wv", "*.attention.wo")


def titan_recipe(name: str, precision: str, total_steps: int | None, options: dict) -> Recipe:
    """The :class:`~twofour.Recipe` a torchtitan job names (``options``: the recipe's, None left
    out), or TrainError in one line: a bad recipe or option, ``step`` (its STEPAdamW is not one
    torchtitan builds), a dense phase at the end without ``total_steps`` (it would never come)."""
    try:
        recipe = make_recipe(name, precision=precision, total_steps=total_steps,
                             **{k: v for k, v in options.items() if v is not None})
    except (TypeError, ValueError) as e:
        raise TrainError(f"[twofour] {e}") from None
    if recipe.starts_dense:
        raise TrainError(f"[twofour] recipe {name!r} needs twofour.STEPAdamW as its optimizer, which "
                         "torchtitan does not build: pick dense, ste, sr-ste, s-ste or t-sr-ste")
    if recipe.dense_finetune and recipe.total_steps is None:
        raise TrainError(f"[twofour] recipe {name!r} ends with a dense phase (dense_finetune="
                         f"{recipe.dense_finetune:.3g}): give total_steps, the run's training.steps, or "
                         "dense_finetune=0")
    return recipe


@torch.no_grad()
def export_checkpoint(checkpoint: str | Path, out: str | Path, dtype: torch.dtype | None = None) -> list[str]:
    """A torchtitan checkpoint folder (``.../checkpoint/step-N``) of a twofour run -> one safetensors
    file of the model in torchtitan's names, each 2:4 layer's weight replaced by the 2:4 weight its
    forward used (S-STE: ``beta * soft_threshold(W)``; the others: ``W * mask``) and the recipe
    buffers dropped. torchtitan's plain Llama 3 loads it (``load_state_dict``); then
    :func:`twofour.sparsify_for_inference` makes those layers 2:4 inference layers. Returns their names."""
    from safetensors.torch import save_file  # noqa: PLC0415
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:  # its file mapped while the tensors are read
        dcp_to_torch_save(str(checkpoint), Path(tmp) / "full.pt")
        full = torch.load(Path(tmp) / "full.pt", weights_only=True, mmap=True)  # tensors read when used
        states = full["model"] if isinstance(full.get("model"), dict) else full  # nested, or torchtitan's flat
        weights = {k: v for k, v in states.items() if isinstance(v, torch.Tensor)}
        layers = sorted(k.removesuffix(".mask") for k in weights
                        if k.endswith(".mask") and k.removesuffix("mask") + "weight" in weights)
        if not layers:
            raise TrainError(f"{checkpoint}: no 2:4 layer (a '.mask' beside a '.weight') in this checkpoint")
        sparse = []
        for name in layers:
            w, mask, beta = weights[f"{name}.weight"], weights[f"{name}.mask"], weights.get(f"{name}.beta")
            if bool(weights.get(f"{name}.dense", torch.tensor(False))):
                continue  # in a dense phase (STEP's first, a final dense fine-tune): its weight as it is
            weights[f"{name}.weight"] = SOFT.effective(w, beta, mask) if beta is not None else w * mask
            sparse.append(name)
        model = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
                 for k, v in weights.items() if k.rsplit(".", 1)[-1] not in RECIPE_BUFFERS}
        save_file(model, str(out), metadata={"twofour_sparse_layers": ",".join(sparse)})
    return sparse


def main(argv: list[str] | None = None) -> None:
    """``python -m twofour.integrations.torchtitan CHECKPOINT OUT.safetensors [--dtype bfloat16]``."""
    parser = argparse.ArgumentParser(prog="python -m twofour.integrations.torchtitan",
                                     description="Export a torchtitan checkpoint of a twofour run (2:4 weights).")
    parser.add_argument("checkpoint", help="a torchtitan checkpoint folder, e.g. outputs/x/checkpoint/step-1000")
    parser.add_argument("out", help="the safetensors file to write")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    args = parser.parse_args(argv)
    names = export_checkpoint(args.checkpoint, args.out, getattr(torch, args.dtype) if args.dtype else None)
    print(f"{len(names)} 2:4 layers -> {args.out}")
