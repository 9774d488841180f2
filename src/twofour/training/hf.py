"""Hugging Face ``Trainer`` integration: train a sparsified ``transformers`` model with ``Trainer``.

Needs ``transformers`` (``pip install 'twofour[hf]'``); importing ``twofour`` alone never imports it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..errors import warn
from ..sparse.convert import add_masked_decay, advance, flip_rate, sparse_layers
from ..sparse.layer import RECIPE_BUFFERS
from ..sparse.optim import STEPAdamW

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError("twofour.training.hf needs Hugging Face transformers: pip install 'twofour[hf]'") from e

__all__ = ["TwoFourCallback", "load_recipe_state"]


def _unwrap(optimizer: Any) -> Any:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` (and similar wrappers)."""
    seen = 0
    while optimizer is not None and isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer, seen = optimizer.optimizer, seen + 1
        if seen > 8:
            break
    return optimizer


class TwoFourCallback(TrainerCallback):
    """Drives a sparsified model's 2:4 layers from ``transformers.Trainer``.

    Sparsify the model first, then pass the callback to ``Trainer``::

        import twofour
        from twofour.training.hf import TwoFourCallback
        from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

        model = AutoModelForCausalLM.from_config(config)        # or .from_pretrained(...) to fine-tune
        twofour.sparsify(model, "s-ste")                        # FFN and attention linears become 2:4
        trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                          callbacks=[TwoFourCallback()])
        trainer.train()                                         # logs gain "flip_rate"

    Once per optimizer step, however many micro-batches ``gradient_accumulation_steps``
    accumulates, it adds SR-STE's masked decay to the gradients (after the Trainer's gradient
    clipping, before ``optimizer.step()``: :func:`twofour.add_masked_decay`) and then advances
    masks, flip counts and phases (:func:`twofour.advance`, from ``on_step_end``; a step the
    optimizer skipped, such as an fp16 overflow, is not counted). Each training log (every
    ``logging_steps``) gets ``flip_rate``: the fraction of mask positions that changed at the
    last optimizer step (:func:`twofour.flip_rate`), also in ``trainer.state.log_history``.

    The ``step`` recipe needs :class:`twofour.STEPAdamW` as the Trainer's optimizer
    (``Trainer(..., optimizers=(twofour.STEPAdamW(model.parameters(), total_steps=max_steps), None))``);
    with another optimizer ``on_train_begin`` raises ``TypeError``. Do not also call
    :func:`twofour.attach` on the Trainer's optimizer: the masks would advance twice per step.

    ``Trainer`` runs the ``report_to`` integrations (TensorBoard, W&B, ...) before the callbacks
    you pass, so they log without ``flip_rate``; to send it to them too, put this callback first:
    ``trainer.callback_handler.callbacks.insert(0, trainer.pop_callback(TwoFourCallback))``.
    """

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None:
            return
        layers = [layer for _, layer in sparse_layers(model)]
        if not layers:
            warn("TwoFourCallback: the model has no twofour.SparseLinear layer; call "
                 "twofour.sparsify(model, recipe) before creating the Trainer")
            return
        opt = _unwrap(optimizer)
        if any(layer.recipe.starts_dense for layer in layers) and not isinstance(opt, STEPAdamW):
            raise TypeError("TwoFourCallback: the 'step' recipe needs twofour.STEPAdamW as the Trainer's optimizer "
                            f"(got {type(opt).__name__}): pass Trainer(..., optimizers=(twofour.STEPAdamW("
                            "model.parameters(), total_steps=...), None))")
        if any(layer.recipe.decay for layer in layers) and "on_pre_optimizer_step" not in vars(TrainerCallback):
            raise RuntimeError("TwoFourCallback: masked decay (sr-ste, t-sr-ste, step) needs a transformers with "
                               "the on_pre_optimizer_step callback event; upgrade transformers")

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is not None:
            add_masked_decay(model)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None or getattr(optimizer, "step_was_skipped", False):
            return
        advance(model, _unwrap(optimizer))

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if model is None or logs is None or "loss" not in logs:  # training logs only, not eval or the summary
            return
        fr = flip_rate(model)["total"]
        logs["flip_rate"] = fr
        # Trainer appends a copy of ``logs`` to the history before calling the callbacks
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step and "loss" in last:
            last["flip_rate"] = fr


def load_recipe_state(model: torch.nn.Module, folder: str | Path) -> list[str]:
    """Restore the recipe state (S-STE's ``beta``, masks, step counters, phases) that
    ``save_pretrained`` wrote beside the weights, into a model loaded with ``from_pretrained``
    and sparsified again with the same recipe and patterns::

        model.save_pretrained(folder)                            # weights and recipe buffers
        model = AutoModelForCausalLM.from_pretrained(folder)     # dense masters; buffers reported unexpected
        twofour.sparsify(model, "s-ste", include=FFN_PATTERNS)   # same recipe and patterns as saved
        twofour.training.hf.load_recipe_state(model, folder)              # the saved beta and masks, not fresh ones

    Without it the sparsified model would compute a new ``beta`` and masks from the loaded
    weights (another function for S-STE). Reads ``model.safetensors`` or the shards its index
    names; returns the names of the layers restored. Raises ValueError where the folder and the
    model's sparse layers don't match (a layer without saved state, saved state for a layer
    that is not sparse here)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{folder}: no model.safetensors (or model.safetensors.index.json) to read the recipe "
                         "state from")
    from safetensors import safe_open  # noqa: PLC0415  (a dependency of transformers)

    saved: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as fh:
            for key in fh.keys():
                if key.rpartition(".")[2] in RECIPE_BUFFERS:
                    saved[key] = fh.get_tensor(key)
    restored, used = [], set()
    for name, layer in sparse_layers(model):
        wanted = [b for b in RECIPE_BUFFERS if getattr(layer, b) is not None]
        if not wanted:
            continue  # a dense-recipe layer keeps no state (unless its FP8 phase ends: a step count)
        keys = {b: f"{name}.{b}" for b in wanted}
        missing = [k for k in keys.values() if k not in saved]
        if missing:
            raise ValueError(f"{folder} holds no twofour state for {name} (no {', '.join(missing)}): it was saved "
                             f"from a model without this sparse layer or with other recipe options than "
                             f"{layer.recipe.name!r} and its {', '.join(wanted)}")
        layer.load_state_dict({b: saved[k] for b, k in keys.items()}, strict=False)
        layer.compressed.clear()  # beta or the mask changed under an unchanged weight
        used.update(keys.values())
        restored.append(name)
    extra = sorted({k.rpartition(".")[0] for k in saved if k not in used})
    if extra:
        raise ValueError(f"{folder} holds twofour state for layers that are not sparse in this model: "
                         f"{', '.join(extra)}; sparsify it with the recipe and patterns it was saved with")
    return restored
