"""Each recipe trains a small transformer on the CPU; step-based state advances per optimizer step."""

import copy

import pytest
import torch

import twofour
from twofour.sparse import flip_rate, sparsify

from .helpers import batches, make_optimizer, tiny_gpt, tiny_llama

STEPS = 60


def train(recipe, steps=STEPS, accum=1, device="cpu", make=tiny_gpt, bf16=False, **opts):
    model = make().to(device)
    if recipe == "t-sr-ste":
        opts.setdefault("total_steps", steps)
    sparsify(model, recipe, **opts)
    opt = make_optimizer(model, recipe, steps)
    twofour.attach(model, opt)
    losses, flips = [], []
    data = batches(steps * accum)
    for _ in range(steps):
        total = 0.0
        for _ in range(accum):
            x, y = next(data)
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
                _, loss = model(x.to(device), y.to(device))
            (loss / accum).backward()
            total += loss.item() / accum
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        flips.append(flip_rate(model)["total"])
    return model, opt, losses, flips


@pytest.mark.parametrize("recipe", twofour.RECIPES)
def test_recipe_lowers_the_loss(recipe, device):
    model, opt, losses, flips = train(recipe, device=device)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, (recipe, first, last)
    assert all(0 <= f <= 1 for f in flips)
    if recipe != "dense":  # masks really move during training (t-sr-ste's at its refresh, step 40; step's once on)
        assert max(flips) > 0
    if recipe != "dense":
        layers = [layer for _, layer in twofour.sparse_layers(model)]
        assert len(layers) == 8 and all(layer.step_count == STEPS for layer in layers)  # 2 blocks x 4 linears


@pytest.mark.parametrize("recipe", twofour.RECIPES)
def test_llama_trains_with_every_recipe(recipe):
    """The Llama-style model (RMSNorm, rotary positions, SwiGLU FFN with one fused gate|up
    linear) learns with every recipe on its FFN and attention linears, which end up 2:4."""
    from twofour.models import ATTN_PATTERNS, FFN_IN_PATTERNS, FFN_PATTERNS

    opts = {"dense_finetune": 0.0} if recipe == "t-sr-ste" else {}  # end in the sparse phase
    model, _, losses, _ = train(recipe, steps=40, make=tiny_llama, include=FFN_PATTERNS + ATTN_PATTERNS,
                                transposed_output=FFN_IN_PATTERNS, **opts)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, (recipe, first, last)
    layers = dict(twofour.sparse_layers(model))
    assert set(layers) == {f"h.{i}.{m}" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.gate_up",
                                                                      "mlp.down")}
    assert layers["h.0.mlp.gate_up"].transposed_output and not layers["h.0.mlp.down"].transposed_output
    for layer in layers.values():
        assert layer.is_dense_phase == (recipe == "dense")
        if recipe != "dense":
            assert ((layer.effective_weight().reshape(-1, 4) != 0).sum(1) <= 2).all()


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", twofour.RECIPES)
def test_gpu_llama_trains_with_every_recipe_on_the_fast_path(recipe):
    """Under bf16 autocast with widths and token counts the fast path takes (multiples of 32),
    the Llama-style model learns with every recipe on the GPU's kernels."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from twofour.models import FFN_IN_PATTERNS, FFN_PATTERNS

    opts = {"dense_finetune": 0.0} if recipe == "t-sr-ste" else {}
    model, _, losses, _ = train(recipe, steps=40, device="cuda", bf16=True,
                                make=lambda: tiny_llama(n_embd=64, n_head=2), include=FFN_PATTERNS,
                                transposed_output=FFN_IN_PATTERNS, **opts)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, (recipe, first, last)
    layers = [layer for _, layer in twofour.sparse_layers(model)]
    assert len(layers) == 4  # 2 blocks x (fused gate|up, down)
    for layer in layers:
        if recipe != "dense":
            assert ((layer.effective_weight().reshape(-1, 4) != 0).sum(1) <= 2).all()


def test_step_counters_advance_once_per_optimizer_step_under_accumulation():
    model, _, _, _ = train("t-sr-ste", steps=8, accum=4, mask_interval=2)
    layers = [layer for _, layer in twofour.sparse_layers(model)]
    assert len(layers) == 8 and all(layer.step_count == 8 for layer in layers)


def test_step_recipe_switches_from_dense_to_sparse():
    model, opt, losses, flips = train("step", steps=40)
    assert opt.switched and opt.t_min <= opt.switched_at <= opt.t_max
    assert all(f == 0 for f in flips[: opt.switched_at])  # phase 1 is dense: no masks
    for _, layer in twofour.sparse_layers(model):
        assert not layer.is_dense_phase
        assert ((layer.effective_weight().reshape(-1, 4) != 0).sum(1) <= 2).all()


def test_step_recipe_needs_step_optimizer():
    model = sparsify(tiny_gpt(), "step")
    with pytest.raises(TypeError, match="STEPAdamW"):
        twofour.attach(model, torch.optim.AdamW(model.parameters()))


def test_step_optimizer_state_round_trip():
    model, opt, _, _ = train("step", steps=30)
    opt2 = twofour.STEPAdamW(model.parameters(), total_steps=30)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.switched_at == opt.switched_at and opt2.steps == opt.steps
    with pytest.raises(ValueError):
        twofour.STEPAdamW(model.parameters(), total_steps=0)


def test_flip_rate_counts_changed_positions():
    model = sparsify(tiny_gpt(), "ste")
    before = {n: m.mask.clone() for n, m in twofour.sparse_layers(model)}
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    twofour.attach(model, opt)
    x, y = next(batches(1))
    model(x, y)[1].backward()
    opt.step()
    rates = flip_rate(model)
    changed = total = 0
    for name, layer in twofour.sparse_layers(model):
        diff = (layer.mask != before[name]).sum().item()
        assert rates[name] == pytest.approx(diff / layer.weight.numel())
        changed, total = changed + diff, total + layer.weight.numel()
    assert rates["total"] == pytest.approx(changed / total) and changed > 0


def test_model_state_round_trip_resumes_identically():
    torch.manual_seed(0)
    model, opt, _, _ = train("sr-ste", steps=10)
    sd_model, sd_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())  # as torch.save would
    fresh = sparsify(tiny_gpt(seed=9), "sr-ste")
    fresh.load_state_dict(sd_model)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=3e-3)
    opt2.load_state_dict(sd_opt)
    twofour.attach(fresh, opt2)
    x, y = next(batches(1, seed=5))
    for m, o in ((model, opt), (fresh, opt2)):
        m(x, y)[1].backward()
        o.step()
        o.zero_grad()
    pairs = list(zip(twofour.sparse_layers(model), twofour.sparse_layers(fresh)))
    assert len(pairs) == 8  # 2 blocks x 4 linears, in both models
    for (_, a), (_, b) in pairs:
        assert torch.equal(a.weight, b.weight) and torch.equal(a.mask, b.mask) and a.step_count == b.step_count == 11


@pytest.mark.parametrize("scale", [1.0, 1e-3])
def test_step_switch_does_not_depend_on_the_loss_scale(scale):
    """An absolute threshold on |v_t - v_{t-1}| switched at t_min whenever gradients were small;
    the relative criterion sees the same run whatever the scale of the loss."""
    switched = []
    for s in (1.0, scale):
        model = sparsify(tiny_gpt(), "step")
        opt = twofour.STEPAdamW(model.parameters(), total_steps=80, lr=3e-3, eps=1e-30)
        twofour.attach(model, opt)
        for x, y in batches(80):
            (model(x, y)[1] * s).backward()
            opt.step()
            opt.zero_grad()
        switched.append(opt.switched_at)
        assert opt.variance_change() > 0
    assert switched[0] == switched[1]
    assert opt.t_min < switched[0] <= opt.t_max  # the criterion decides, not the t_min floor


def test_config_turns_the_recipe_name_into_a_recipe_once():
    from twofour.errors import TrainError
    from twofour.training.config import TrainConfig
    from twofour.training.loop import build_model

    rec = TrainConfig(recipe="t-sr-ste", steps=50).recipe_object()
    assert isinstance(rec, twofour.Recipe) and rec.total_steps == 50  # filled from steps
    assert TrainConfig(recipe="t-sr-ste", recipe_options={"total_steps": 7}).recipe_object().total_steps == 7
    assert TrainConfig().recipe_object().name == twofour.DEFAULT_RECIPE
    assert TrainConfig(recipe="step").recipe_object().starts_dense
    with pytest.raises(TrainError, match="valid options"):
        TrainConfig(recipe="ste", recipe_options={"decay": 1.0}).recipe_object()
    model = build_model(TrainConfig(seq_len=32), rec, vocab_size=64)
    layers = dict(twofour.sparse_layers(model))
    assert layers and all(layer.recipe == rec for layer in layers.values())
    assert model.fsdp_units() == list(model.h) and model.vocab_size == 64


def test_authors_regime_settings():
    from twofour.training.config import TrainConfig, lr_at

    ours = TrainConfig(model="gpt2-124m", steps=600)
    authors = TrainConfig(model="gpt2-124m", steps=600, regime="authors")
    assert (ours.peak_lr, ours.floor_ratio, ours.warmup_steps, ours.micro_batches()) == (6e-4, 0.1, 30, 1)
    assert authors.peak_lr == 1.5e-4 and authors.peak_lr * authors.floor_ratio == pytest.approx(1e-5)
    assert authors.warmup_steps == 60 and TrainConfig(regime="authors", steps=300_000).warmup_steps == 3000
    assert lr_at(authors, 599) == pytest.approx(1e-5, rel=1e-3)
    # about 0.5M tokens per step through accumulation, unless --grad-accum is given
    big = TrainConfig(regime="authors", batch_size=32, seq_len=1024)
    assert big.micro_batches(world=1) == 16 and big.micro_batches(world=2) == 8
    assert TrainConfig(regime="authors", batch_size=24, seq_len=1000).micro_batches() == 22  # ceil(524288 / 24000)
    assert TrainConfig(regime="authors", grad_accum=3).micro_batches(world=4) == 3
    # SR-STE's decay: 6e-5 where the recipe takes it and it wasn't given; the user's value wins
    assert TrainConfig(recipe="sr-ste", regime="authors").recipe_object().decay == 6e-5
    assert TrainConfig(recipe="sr-ste").recipe_object().decay == 2e-4
    assert TrainConfig(recipe="sr-ste", regime="authors", recipe_options={"decay": 1e-4}).recipe_object().decay == 1e-4
    assert TrainConfig(recipe="s-ste", regime="authors").recipe_object().decay == 0
    # explicit options win over the regime
    custom = TrainConfig(regime="authors", lr=1e-3, min_lr_ratio=0.5, warmup=7)
    assert (custom.peak_lr, custom.floor_ratio, custom.warmup_steps) == (1e-3, 0.5, 7)


def test_validation_windows_do_not_depend_on_the_seed():
    """Runs of different seeds are scored on the same text: the same weights, the same val loss."""
    import contextlib

    import numpy as np

    from twofour.training.config import TrainConfig
    from twofour.training.data import TokenData
    from twofour.training.loop import evaluate, val_windows

    rng = np.random.default_rng(0)
    data = TokenData(rng.integers(0, 64, 5000).astype(np.uint16), rng.integers(0, 64, 3000).astype(np.uint16),
                     64, "random")
    a, b = (TrainConfig(seed=s, batch_size=4, seq_len=32, eval_iters=3) for s in (1, 2))
    starts = val_windows(data, a)
    assert np.array_equal(starts, val_windows(data, b)) and len(set(starts.tolist())) == 12
    assert starts[0] == 0 and starts[-1] == len(data.val) - 33  # spread over the whole split
    model = tiny_gpt()
    losses = [evaluate(model, data, cfg, "cpu", contextlib.nullcontext()) for cfg in (a, b)]
    assert losses[0] == losses[1] and losses[0] > 0


def test_a_sparse_gpu_run_without_the_fast_path_is_warned_about(monkeypatch):
    """A sparse recipe on a GPU without the fast path's bindings gets a message (it runs the slower
    reference math); none for dense, the CPU, a fast path present, or one turned off on purpose."""
    from twofour import dispatch  # noqa: PLC0415
    from twofour.kernels import ops  # noqa: PLC0415
    from twofour.sparse import make_recipe
    from twofour.training.loop import slow_path_warning  # noqa: PLC0415

    cuda, sste = torch.device("cuda"), make_recipe("s-ste")
    monkeypatch.setattr(ops, "fast_available", lambda: False)
    with dispatch.override(fast=True):
        assert "pip install 'twofour[gpu]'" in slow_path_warning(cuda, sste)
        assert slow_path_warning(cuda, make_recipe("dense")) is None
        assert slow_path_warning(torch.device("cpu"), sste) is None
    with dispatch.override(fast=False):
        assert slow_path_warning(cuda, sste) is None
    monkeypatch.setattr(ops, "fast_available", lambda: True)
    with dispatch.override(fast=True):
        assert slow_path_warning(cuda, sste) is None


def test_a_runs_decisions_are_made_once_in_its_plan():
    """plan_run: the options and the processes come to one Plan (recipe, device, micro-batches,
    precision, graphs, optimizer) that set-up and the loop read."""
    from twofour.training.config import TrainConfig
    from twofour.training.parallel import Parallel
    from twofour.training.plan import plan_run

    one = Parallel()
    plan = plan_run(TrainConfig(model="tiny", recipe="step", device="cpu", grad_accum=3), one)
    assert plan.recipe.name == "step" and plan.optimizer == "step-adamw" and plan.accum == 3
    assert plan.device.type == "cpu" and not plan.autocast and plan.precision == "float32" and plan.graphs == ""
    assert not plan.plan_layers
    plan = plan_run(TrainConfig(model="tiny", recipe="s-ste", device="cpu", compile=True), one)
    assert plan.optimizer == "adamw" and plan.recipe.name == "s-ste" and not plan.plan_layers  # no autocast on a CPU
