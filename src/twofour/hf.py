"""Hugging Face ``Trainer`` integration: train a sparsified ``transformers`` model with ``Trainer``.

Needs ``transformers`` (``pip install 'twofour[hf]'``); importing ``twofour`` alone never imports it.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .optim import STEPAdamW
from .sparsify import add_masked_decay, advance, flip_rate, sparse_layers

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError("twofour.hf needs Hugging Face transformers: pip install 'twofour[hf]'") from e

__all__ = ["TwoFourCallback"]


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
        from twofour.hf import TwoFourCallback
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
            warnings.warn("TwoFourCallback: the model has no twofour.SparseLinear layer; call "
                          "twofour.sparsify(model, recipe) before creating the Trainer", stacklevel=2)
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
