"""A trained model to its inference form and back: :func:`to_inference`, :func:`sparsify_for_inference`."""

from __future__ import annotations

import torch
from torch import nn

from ..sparse.convert import is_hf_conv1d, sparse_layers
from ..sparse.layer import SparseLinear
from .layer import FORMAT, FORMAT_VERSION, HF_CONFIG_KEY, SparseInferenceLinear


def _dense_layer(layer: SparseLinear) -> nn.Module:
    """A SparseLinear in a dense phase as the plain layer it stands for (nn.Linear, or Hugging
    Face's Conv1D where it came from one)."""
    w, b = layer.weight.detach(), layer.bias
    if layer.conv1d_layout:
        from transformers.pytorch_utils import Conv1D  # noqa: PLC0415 - only for models that came from transformers

        new = Conv1D(layer.out_features, layer.in_features)
        new.weight = nn.Parameter(w.t().contiguous(), requires_grad=False)
    else:
        new = nn.Linear(layer.in_features, layer.out_features, bias=b is not None, device="meta")
        new.weight = nn.Parameter(w, requires_grad=False)
    new.bias = None if b is None else nn.Parameter(b.detach(), requires_grad=False)
    return new


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, new)


@torch.no_grad()
def to_inference(model: nn.Module, *, packed_state: bool = False) -> list[str]:
    """Swap ``model``'s SparseLinear layers for inference ones, in place; returns the names of
    the 2:4 layers.

    A layer in its sparse phase becomes a :class:`SparseInferenceLinear` holding its effective
    weight (beta * S(W) for S-STE, W * mask otherwise); one in a dense phase (dense recipe,
    T-SR-STE's final dense fine-tune, STEP before its switch) becomes the plain layer it stands
    for. By default the state dict keeps the model's own layout (dense ``weight``, Conv1D's
    (in, out) for GPT-2), so ``save_pretrained`` writes a checkpoint any ``transformers`` loads;
    ``packed_state=True`` gives twofour's values + positions. A Hugging Face model's config
    records the 2:4 layers under ``twofour``, for :func:`sparsify_for_inference`.
    """
    sparse = []
    for name, layer in list(sparse_layers(model)):
        if layer.recipe.sparse and not layer.is_dense_phase:
            new = SparseInferenceLinear.from_weight(layer.effective_weight(), layer.bias, packed_state=packed_state,
                                                    conv1d=layer.conv1d_layout,
                                                    transposed_output=layer.transposed_output)
            sparse.append(name)
        else:
            new = _dense_layer(layer)
        _replace(model, name, new.to(layer.weight.device))
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):  # a Hugging Face PretrainedConfig
        setattr(config, HF_CONFIG_KEY, {"format": FORMAT, "format_version": FORMAT_VERSION, "sparse_layers": sparse})
    return sparse


def _as_out_in(mod: nn.Module) -> torch.Tensor:
    return mod.weight.detach().t() if is_hf_conv1d(mod) else mod.weight.detach()


@torch.no_grad()
def sparsify_for_inference(model: nn.Module, layers: list[str] | None = None) -> nn.Module:
    """Make ``model``'s 2:4 linear layers :class:`SparseInferenceLinear` again, in place (the
    state dict keeps the model's layout); returns the model.

    The layers are ``layers``, else those its Hugging Face config lists under ``twofour`` (what
    :func:`to_inference` recorded before ``save_pretrained``), else every ``nn.Linear`` or
    ``Conv1D`` whose weight is 2:4 and not all zeros. A listed layer that is missing or whose weight isn't 2:4 is
    a ValueError naming it, and then no layer has been changed.
    """
    if layers is None:
        recorded = getattr(getattr(model, "config", None), HF_CONFIG_KEY, None)
        if isinstance(recorded, dict) and isinstance(recorded.get("sparse_layers"), list):
            layers = [str(n) for n in recorded["sparse_layers"]]
    mods = dict(model.named_modules())
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}

    def linear(m: nn.Module) -> bool:
        return (isinstance(m, nn.Linear) and not isinstance(m, SparseLinear)) or is_hf_conv1d(m)

    new = {}
    if layers is None:  # detect: every linear whose weight is 2:4
        for name, mod in mods.items():
            # an all-zero weight (e.g. zero-initialized) is trivially 2:4, but nothing marks it sparse
            if (linear(mod) and id(mod.weight) not in tied and _as_out_in(mod).shape[1] % 4 == 0
                    and bool(mod.weight.detach().any())):
                try:
                    new[name] = SparseInferenceLinear.from_weight(_as_out_in(mod), mod.bias, packed_state=False,
                                                                  conv1d=is_hf_conv1d(mod))
                except ValueError:
                    continue
    else:
        for name in layers:
            mod = mods.get(name)
            if isinstance(mod, SparseInferenceLinear):
                continue
            if mod is None or not linear(mod):
                raise ValueError(f"{name}: listed as a 2:4 layer, but the model has no linear layer of that name")
            try:
                new[name] = SparseInferenceLinear.from_weight(_as_out_in(mod), mod.bias, packed_state=False,
                                                              conv1d=is_hf_conv1d(mod))
            except ValueError as e:
                raise ValueError(f"{name}: listed as a 2:4 layer, but its weight is {e}") from None
    for name, layer in new.items():
        _replace(model, name, layer.to(mods[name].weight.device))
    return model


# --------------------------------------------------------------------------------------------
# twofour's export folder
# --------------------------------------------------------------------------------------------
