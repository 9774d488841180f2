"""twofour.training.hf.TwoFourCallback: a sparsified transformers model trained with Trainer (CPU, tiny config)."""

import importlib
import math
import sys

import pytest
import torch

import twofour

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer's own dependency

from twofour.training.hf import TwoFourCallback  # noqa: E402

VOCAB, SEQ = 64, 16


def _model(recipe: str, **options):
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=SEQ)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    twofour.sparsify(model, recipe, **options)
    return model


def _dataset(n=32):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def _trainer(model, tmp_path, optimizers=(None, None), callbacks=None):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, gradient_accumulation_steps=2, per_device_train_batch_size=2,
        logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", learning_rate=3e-3, disable_tqdm=True,
        dataloader_num_workers=0, seed=0)
    return transformers.Trainer(model=model, args=args, train_dataset=_dataset(), optimizers=optimizers,
                                callbacks=[TwoFourCallback()] if callbacks is None else callbacks)


class _CountingCallback(TwoFourCallback):
    decays = 0

    def on_pre_optimizer_step(self, *args, **kwargs):
        self.decays += 1
        return super().on_pre_optimizer_step(*args, **kwargs)


def test_trainer_advances_masks_once_per_optimizer_step_and_logs_flip_rate(tmp_path):
    model = _model("sr-ste")
    layers = [layer for _, layer in twofour.sparse_layers(model)]
    assert layers
    micro_batches = []
    model.register_forward_hook(lambda *a: micro_batches.append(1))
    cb = _CountingCallback()
    trainer = _trainer(model, tmp_path, callbacks=[cb])
    out = trainer.train()
    # 4 optimizer steps of 2 accumulated micro-batches: the masks moved 4 times, not 8
    assert trainer.state.global_step == 4 and len(micro_batches) == 8
    assert all(int(layer.step) == 4 for layer in layers)
    assert cb.decays == 4  # SR-STE's masked decay: once per optimizer step too
    train_logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(train_logs) == 4
    assert all("flip_rate" in h and 0.0 <= h["flip_rate"] <= 1.0 for h in train_logs)
    assert train_logs[-1]["flip_rate"] == twofour.flip_rate(model)["total"]
    assert all(math.isfinite(h["loss"]) for h in train_logs) and math.isfinite(out.training_loss)
    for layer in layers:  # still 2:4 where it is used
        w = layer.effective_weight().detach().reshape(-1, 4)
        assert int((w != 0).sum(dim=1).max()) <= 2


def test_step_recipe_needs_step_adamw(tmp_path):
    model = _model("step")
    with pytest.raises(TypeError, match="STEPAdamW"):
        _trainer(model, tmp_path).train()
    opt = twofour.STEPAdamW(model.parameters(), total_steps=4, lr=3e-3)
    trainer = _trainer(model, tmp_path, optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)))
    trainer.train()
    assert opt.steps == 4 and all(int(layer.step) == 4 for _, layer in twofour.sparse_layers(model))
    assert any("flip_rate" in h for h in trainer.state.log_history)


def test_warns_when_the_model_was_not_sparsified(tmp_path):
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=SEQ)
    with pytest.warns(UserWarning, match="twofour.sparsify"):
        _trainer(transformers.GPT2LMHeadModel(cfg), tmp_path).train()


def test_clear_import_error_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "twofour.training.hf")
    with pytest.raises(ImportError, match=r"pip install 'twofour\[hf\]'"):
        importlib.import_module("twofour.training.hf")


class _Recorder(transformers.TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_callbacks_before_it_see_flip_rate_once_it_is_moved_first(tmp_path):
    # what the docstring tells report_to users (Trainer runs its integrations before user callbacks)
    rec = _Recorder()
    trainer = _trainer(_model("s-ste"), tmp_path, callbacks=[rec, TwoFourCallback()])
    trainer.callback_handler.callbacks.insert(0, trainer.pop_callback(TwoFourCallback))
    trainer.train()
    train_logs = [h for h in rec.logs if "loss" in h]
    assert len(train_logs) == 4 and all("flip_rate" in h for h in train_logs)
