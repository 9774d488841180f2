import dataclasses

import pytest
import torch

from twofour.fp8 import BF16, E4M3, E5M2, FP8, PRECISIONS, ROWWISE, TENSORWISE, Precision, as_precision
from twofour.sparse.pruners import HARD, SOFT, TRANSPOSABLE
from twofour.sparse.recipes import RECIPES, Recipe, make_recipe, recipe_options


def test_names_and_defaults():
    assert RECIPES == ("dense", "ste", "sr-ste", "s-ste", "t-sr-ste", "step")
    assert make_recipe() == make_recipe("ste")  # the smaller gap to dense in docs/RESULTS.md
    s = make_recipe("s-ste")
    assert s.pruning is SOFT and s.mvue and s.precision == BF16 and not s.precision.fp8 and s.decay == 0
    assert s.beta_interval == 0 and make_recipe("s-ste", beta_interval=100).beta_interval == 100
    sr = make_recipe("sr-ste")
    assert sr.pruning is HARD and sr.decay == 2e-4 and not sr.mvue
    t = make_recipe("t-sr-ste")
    assert t.pruning is TRANSPOSABLE and t.mvue and t.mask_interval == 40 and t.dense_finetune == pytest.approx(1 / 6)
    assert make_recipe("step").starts_dense
    assert not make_recipe("dense").sparse and make_recipe("ste").sparse


def test_one_constant_is_every_default():
    """``twofour train``, TrainConfig and SparseLinear default to DEFAULT_RECIPE: switching the
    default recipe is one line in recipes.py."""
    import inspect  # noqa: PLC0415

    from twofour.cli import build_parser  # noqa: PLC0415
    from twofour.sparse import DEFAULT_RECIPE, SparseLinear  # noqa: PLC0415
    from twofour.training.config import TrainConfig  # noqa: PLC0415

    assert TrainConfig().recipe == DEFAULT_RECIPE == make_recipe().name
    assert inspect.signature(SparseLinear).parameters["recipe"].default == DEFAULT_RECIPE
    assert build_parser().parse_args(["train"]).recipe == DEFAULT_RECIPE


def test_options_apply_and_round_trip():
    r = make_recipe("sr-ste", decay=6e-5, mvue=True)
    assert r.decay == 6e-5 and r.mvue
    assert make_recipe(r) == r and make_recipe(r, precision="fp8").precision == FP8
    d = r.to_dict()
    assert d["precision"] == "bf16" and d["pruning"] == "hard"
    assert make_recipe(d.pop("name"), precision=d["precision"], **{k: d[k] for k in ("decay", "mvue")}) == r
    fp8 = make_recipe(r, precision="fp8-rowwise")
    assert make_recipe(fp8) == fp8 and make_recipe(fp8, decay=1e-4).precision.scaling == ROWWISE
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.decay = 1.0  # frozen value object


def test_unknown_name_lists_valid():
    with pytest.raises(ValueError, match="valid recipes: dense, ste, sr-ste, s-ste, t-sr-ste, step"):
        make_recipe("sste")


@pytest.mark.parametrize("name,opt", [("ste", "decay"), ("s-ste", "mask_interval"), ("dense", "mvue"),
                                      ("ste", "beta_interval")])
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
    (dict(precision="fp8", bf16_finetune=1.0, total_steps=10), r"bf16_finetune must be in \[0, 1\), got 1.0"),
    (dict(precision="fp8", bf16_finetune=float("nan"), total_steps=10), r"bf16_finetune must be in \[0, 1\), got nan"),
    (dict(bf16_finetune=0.1, total_steps=10), "bf16_finetune=0.1 needs an FP8 precision"),
    (dict(precision="fp8", bf16_finetune=0.1), "bf16_finetune needs total_steps"),
    (dict(precision="fp9"), "unknown precision 'fp9'; valid precisions: bf16, fp8, "),
    (dict(fp8=True), "no option fp8; .*FP8 is the recipe's precision"),
])
def test_bad_option_values(opts, says):
    """Each bad value is refused with one line naming the recipe, the option and what it must be."""
    with pytest.raises((ValueError, TypeError), match=f"^recipe 't-sr-ste'.*{says}") as e:
        make_recipe("t-sr-ste", **opts)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_bad_beta_interval(value):
    with pytest.raises(ValueError, match=f"^recipe 's-ste': beta_interval must be an int >= 0, got {value}$"):
        make_recipe("s-ste", beta_interval=value)


def test_precision_presets():
    """Every valid combination has one preset, named from its fields; the presets the command line
    documents are there with the numerics their names say."""
    assert list(PRECISIONS)[:2] == ["bf16", "fp8"] and len(PRECISIONS) == 11
    assert all(p.name == name for name, p in PRECISIONS.items())
    assert not BF16.fp8 and BF16 == Precision()
    assert FP8 == Precision(True, E4M3, TENSORWISE)
    assert PRECISIONS["fp8-rowwise"] == Precision(True, E4M3, ROWWISE)
    assert PRECISIONS["fp8-e5m2"] == Precision(True, E5M2)
    assert PRECISIONS["fp8-forward"] == Precision(True, None)
    assert PRECISIONS["fp8-backward"] == Precision(False, E4M3)
    assert PRECISIONS["fp8-backward-rowwise-e5m2"] == Precision(False, E5M2, ROWWISE)
    assert as_precision("fp8-forward") is PRECISIONS["fp8-forward"] and as_precision(FP8) is FP8
    with pytest.raises(TypeError, match="precision must be a name or a Precision"):
        as_precision(True)


@pytest.mark.parametrize("fields,says", [
    (dict(scaling=ROWWISE), "rowwise scaling needs a GEMM in FP8"),
    (dict(forward=True, grad=torch.bfloat16), "grad must be torch.float8_e4m3fn, torch.float8_e5m2 or None"),
    (dict(forward=1), "forward must be a bool"),
    (dict(forward=True, scaling="rowwise"), "scaling must be TENSORWISE or ROWWISE"),
])
def test_precision_refuses_what_makes_no_sense(fields, says):
    with pytest.raises(ValueError, match=f"^Precision: {says}") as e:
        Precision(**fields)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["dense", "ste", "s-ste", "t-sr-ste"])
def test_every_recipe_takes_a_precision(name):
    """Every recipe, dense included, takes a precision by name or object; its options stay its own."""
    assert make_recipe(name).precision == BF16
    assert make_recipe(name, precision="fp8").precision == FP8
    custom = Precision(False, E5M2, ROWWISE)
    assert make_recipe(name, precision=custom).precision is custom
    assert not make_recipe(name, **recipe_options(name)).precision.fp8
    assert make_recipe(make_recipe(name, precision="fp8-e5m2")).precision.grad == E5M2
    assert make_recipe(name, precision="fp8", bf16_finetune=0.5, total_steps=4).bf16_finetune == 0.5
    assert "precision" not in recipe_options(name)


def test_bad_recipe_type():
    with pytest.raises(TypeError):
        make_recipe(3)
    assert isinstance(make_recipe("ste"), Recipe)
