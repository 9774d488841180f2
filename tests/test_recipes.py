import dataclasses

import pytest

from twofour.sparse.pruners import HARD, SOFT, TRANSPOSABLE
from twofour.sparse.recipes import RECIPES, Recipe, make_recipe, recipe_options


def test_names_and_defaults():
    assert RECIPES == ("dense", "ste", "sr-ste", "s-ste", "t-sr-ste", "step")
    assert make_recipe() == make_recipe("s-ste")
    s = make_recipe("s-ste")
    assert s.pruning is SOFT and s.mvue and not s.fp8 and s.decay == 0
    sr = make_recipe("sr-ste")
    assert sr.pruning is HARD and sr.decay == 2e-4 and not sr.mvue
    t = make_recipe("t-sr-ste")
    assert t.pruning is TRANSPOSABLE and t.mvue and t.mask_interval == 40 and t.dense_finetune == pytest.approx(1 / 6)
    assert make_recipe("step").starts_dense
    assert not make_recipe("dense").sparse and make_recipe("ste").sparse


def test_options_apply_and_round_trip():
    r = make_recipe("sr-ste", decay=6e-5, mvue=True)
    assert r.decay == 6e-5 and r.mvue
    assert make_recipe(r) == r and make_recipe(r, fp8=True).fp8
    d = r.to_dict()
    assert make_recipe(d.pop("name"), **{k: d[k] for k in ("decay", "mvue", "fp8")}) == r
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.decay = 1.0  # frozen value object


def test_unknown_name_lists_valid():
    with pytest.raises(ValueError, match="valid recipes: dense, ste, sr-ste, s-ste, t-sr-ste, step"):
        make_recipe("sste")


@pytest.mark.parametrize("name,opt", [("ste", "decay"), ("s-ste", "mask_interval"), ("dense", "mvue")])
def test_unknown_option_lists_valid(name, opt):
    with pytest.raises(ValueError, match=f"no option {opt}; valid options"):
        make_recipe(name, **{opt: 1})


@pytest.mark.parametrize("opts,says", [
    (dict(mvue="yes"), "mvue must be a bool"),
    (dict(decay=-1.0), "decay must be a finite number >= 0, got -1.0"),
    (dict(decay=float("inf")), "decay must be a finite number >= 0, got inf"),
    (dict(decay=float("nan")), "decay must be a finite number >= 0, got nan"),
    (dict(decay=True), "decay must be a finite number >= 0, got True"),
    (dict(mask_interval=0), "mask_interval must be an int >= 1, got 0"),
    (dict(dense_finetune=1.5), r"dense_finetune must be in \[0, 1\), got 1.5"),
    (dict(dense_finetune=float("nan")), r"dense_finetune must be in \[0, 1\), got nan"),
    (dict(dense_finetune=float("-inf")), r"dense_finetune must be in \[0, 1\), got -inf"),
    (dict(total_steps=0), "total_steps must be a positive int, got 0"),
    (dict(fp8=True, fp8_grad_e4m3="on"), "fp8_grad_e4m3 must be a bool"),
    (dict(fp8_grad_e4m3=False), "fp8_grad_e4m3=False needs fp8=True"),
    (dict(bf16_finetune=0.1, total_steps=10), "bf16_finetune=0.1 needs fp8=True"),
    (dict(fp8=True, bf16_finetune=1.0, total_steps=10), r"bf16_finetune must be in \[0, 1\), got 1.0"),
    (dict(fp8=True, bf16_finetune=float("nan"), total_steps=10), r"bf16_finetune must be in \[0, 1\), got nan"),
    (dict(fp8=True, bf16_finetune=0.1), "bf16_finetune needs total_steps"),
    (dict(fp8_backward=False), "fp8_backward=False needs fp8=True"),
    (dict(fp8=True, fp8_backward=0), "fp8_backward must be a bool"),
    (dict(fp8=True, fp8_backward=False, fp8_grad_e4m3=False), "fp8_grad_e4m3=False needs fp8_backward=True"),
    (dict(fp8_forward=False), "fp8_forward=False needs fp8=True"),
    (dict(fp8=True, fp8_forward=False, fp8_backward=False), "leaves no GEMM in FP8"),
])
def test_bad_option_values(opts, says):
    """Each bad value is refused with one line naming the recipe, the option and what it must be."""
    with pytest.raises((ValueError, TypeError), match=f"^recipe 't-sr-ste'.*{says}") as e:
        make_recipe("t-sr-ste", **opts)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["dense", "ste", "s-ste", "t-sr-ste"])
def test_fp8_defaults_to_e4m3_gradients(name):
    """With ``fp8`` the gradient is e4m3 unless ``fp8_grad_e4m3=False`` asks for e5m2; an FP8 option
    away from its default needs ``fp8=True``, while the defaults pass back in, given or not."""
    assert make_recipe(name, fp8=True).fp8_grad_e4m3
    assert not make_recipe(name, fp8=True, fp8_grad_e4m3=False).fp8_grad_e4m3
    with pytest.raises(ValueError, match="fp8_grad_e4m3=False needs fp8=True"):
        make_recipe(name, fp8_grad_e4m3=False)
    with pytest.raises(ValueError, match="fp8_rowwise=True needs fp8=True"):
        make_recipe(name, fp8_rowwise=True)
    assert not make_recipe(name, **recipe_options(name)).fp8
    plain = make_recipe(name)
    assert not make_recipe(plain).fp8 and make_recipe(plain, fp8=True).fp8_grad_e4m3
    assert not make_recipe(make_recipe(name, fp8=True, fp8_grad_e4m3=False)).fp8_grad_e4m3


def test_bad_recipe_type():
    with pytest.raises(TypeError):
        make_recipe(3)
    assert isinstance(make_recipe("ste"), Recipe)
