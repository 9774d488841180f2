"""From a trained 2:4 model to one that runs: compressed files, 2:4 kernels, Hugging Face round trips.

* :class:`SparseInferenceLinear`: a linear layer whose weight is 2:4 and stored as kept values
  and 2-bit positions (:mod:`twofour.packed`). On a GPU with the fast path (sm80+, bf16/fp16,
  both dimensions multiples of 32) it builds cuSPARSELt's compressed operand once from them and
  runs 2:4 kernels only: cuSPARSELt's GEMM, or for up to 8 tokens the streaming kernel of
  :mod:`twofour.kernels.gemv24`, whichever measured faster for the shape. Elsewhere it
  multiplies by the dense matrix the values and positions stand for (exact).
* :func:`to_inference`: a trained model's :class:`~twofour.SparseLinear` layers become
  SparseInferenceLinear (their effective 2:4 weights) or, in a dense phase, plain layers.
* :func:`sparsify_for_inference`: the way back for a model saved with ``save_pretrained`` and
  loaded with ``from_pretrained``: its 2:4 layers become SparseInferenceLinear again.
* :func:`save_inference` / :func:`load_for_inference`: twofour's GPT or Llama to and from an export
  folder (``model.safetensors`` + ``model_config.json``, docs/export-format.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .config import TrainError
from .kernels import gemv24 as _gemv
from .kernels import ops
from .kernels.layout import compress_codes
from .layer import SparseLinear
from .model import FFN_IN_PATTERNS, GPT, GPTConfig, Llama, LlamaConfig
from .packed import check_positions, pack_24, position_codes, positions_width, unpack_24
from .runs import CKPT, MODEL_CONFIG, WEIGHTS
from .sparsify import is_hf_conv1d, matches, sparse_layers

__all__ = ["SparseInferenceLinear", "to_inference", "sparsify_for_inference", "save_inference",
           "load_for_inference", "read_export_config", "FORMAT", "FORMAT_VERSION", "HF_CONFIG_KEY"]

#: ``model_config.json``'s ``format`` and the version this code writes and reads.
FORMAT, FORMAT_VERSION = "twofour-inference", 1
#: The attribute of a Hugging Face model's config that lists its 2:4 layers (saved in config.json).
HF_CONFIG_KEY = "twofour"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class SparseInferenceLinear(nn.Module):
    """y = x W^T + b for a fixed 2:4 weight W (out, in), held as ``values`` (out, in/2) and
    ``positions`` (out, ceil(in/8)) uint8 buffers (:mod:`twofour.packed`), for inference.

    ``packed_state`` (default): the state dict holds ``values``, ``positions`` and ``bias``
    (twofour's export format). Otherwise it holds a dense ``weight`` as ``nn.Linear`` does, or
    (in, out) as Hugging Face's ``Conv1D`` does with ``conv1d``, so that ``save_pretrained`` and
    ``from_pretrained`` see the model's own layout; loading a weight that isn't 2:4 fails.

    ``transposed_output`` (as :class:`~twofour.SparseLinear`'s): the GPU may return the output
    column-major where that GEMM is faster; right for an FFN's first linear, whose output feeds
    only the activation and the second linear (which reads it in place).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, device: Any = None,
                 dtype: torch.dtype | None = None, packed_state: bool = True, conv1d: bool = False,
                 transposed_output: bool = False):
        super().__init__()
        self.transposed_output = transposed_output
        if in_features % 4 or in_features <= 0 or out_features <= 0:
            raise ValueError(f"SparseInferenceLinear: in_features must be a positive multiple of 4, got "
                             f"{in_features} (out_features {out_features})")
        self.in_features, self.out_features = in_features, out_features
        self.packed_state, self.conv1d = packed_state, conv1d
        self.register_buffer("values", torch.zeros(out_features, in_features // 2, device=device, dtype=dtype))
        self.register_buffer("positions", torch.full((out_features, positions_width(in_features)), 0x44,
                                                     dtype=torch.uint8, device=device))
        self.bias = (nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype), requires_grad=False)
                     if bias else None)
        self._packed: torch.Tensor | None = None  # cuSPARSELt's operand; ``values`` is a view into it
        self._packed_key: tuple | None = None
        self._dense: torch.Tensor | None = None  # the fallback's dense weight
        self._dense_key: tuple | None = None

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, packed_state: bool = True,
                    conv1d: bool = False, transposed_output: bool = False) -> SparseInferenceLinear:
        """From a 2:4 ``weight`` (out, in); ValueError naming the first group that isn't 2:4."""
        values, positions = pack_24(weight.detach())
        out_f, in_f = weight.shape
        new = cls(in_f, out_f, bias is not None, device="meta", packed_state=packed_state, conv1d=conv1d,
                  transposed_output=transposed_output)
        new.values, new.positions = values, positions
        if bias is not None:
            new.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return new

    def dense_weight(self) -> torch.Tensor:
        """The dense (out, in) 2:4 matrix, in ``values``' dtype and device."""
        return unpack_24(self.values, self.positions, self.in_features)

    # -- state dict in the dense layout ------------------------------------------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.packed_state:
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        w = self.dense_weight()
        destination[prefix + "weight"] = w.t().contiguous() if self.conv1d else w
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        if not self.packed_state and key in state_dict:
            w = state_dict.pop(key)
            w = w.t() if self.conv1d else w
            try:
                state_dict[prefix + "values"], state_dict[prefix + "positions"] = pack_24(w)
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _apply(self, fn, recurse=True):
        self._packed = self._packed_key = self._dense = self._dense_key = None  # rebuilt where they're next needed
        return super()._apply(fn, recurse)

    # -- forward -----------------------------------------------------------------------------

    def runs_sparse(self) -> bool:
        """Whether the forward runs 2:4 kernels: a CUDA weight in bf16/fp16, both dimensions
        multiples of 32, and the fast path available (:func:`twofour.kernels.ops.fast_available`)."""
        v = self.values
        return (v.is_cuda and v.dtype in (torch.bfloat16, torch.float16) and self.in_features % 32 == 0
                and self.out_features % 32 == 0 and ops.fast_available())

    def prepare(self) -> None:
        """Build what the forward multiplies by, now rather than at the first call: cuSPARSELt's
        compressed operand (``values`` then lives inside it, no second copy) where the layer
        runs sparse, else the dense matrix. The forward builds it again if the buffers change."""
        if self.runs_sparse():
            packed = compress_codes(self.values, position_codes(self.positions, self.in_features))
            n = self.values.numel() * self.values.element_size()
            self.values = packed[:n].view(self.values.dtype).view(self.out_features, self.in_features // 2)
            self._packed, self._packed_key = packed, self._key()
        else:
            self._dense, self._dense_key = self.dense_weight(), self._key()

    def _key(self) -> tuple:
        return (self.values.data_ptr(), self.values._version, self.positions.data_ptr(), self.positions._version)

    def nbytes(self) -> int:
        """Bytes the layer holds for its forward: the compressed operand and positions where it
        runs sparse, else values, positions and the dense matrix (bias not counted)."""
        held = [self.positions] + ([self._packed] if self._packed is not None else [self.values])
        held += [self._dense] if self._dense is not None else []
        return sum(t.numel() * t.element_size() for t in held)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.runs_sparse():
            cdt, n = self.values.dtype, self.out_features
            x2 = ops.as_2d(x.to(cdt))
            order = ops.order(x2)
            routes = _working(self.routes(x2), (n, self.in_features, x2.shape[0], order, cdt, self.bias is not None))
            choice = ops.choose("inf" if self.bias is None else "inf+bias", n, self.in_features, x2.shape[0], order,
                                cdt, routes)
            return routes[choice]().reshape(*x.shape[:-1], n)
        if self._dense_key != self._key():
            self.prepare()
        return F.linear(x, self._dense, self.bias)

    def routes(self, x2: torch.Tensor) -> dict[str, Any]:
        """The 2:4 kernels that compute y = x2 W^T + b for a (tokens, in) ``x2`` in the layer's
        dtype, row- or column-major, as calls: ``sparse`` (cuSPARSELt's GEMM, the tokens padded
        to its multiple of 8; y row-major), with ``transposed_output`` also ``sparse_dr`` (the
        same writing y^T row-major: a column-major y), and for up to 8 tokens ``sparse_gemv``
        (:mod:`twofour.kernels.gemv24`). The forward runs the one
        :func:`twofour.kernels.ops.choose` measured fastest for the shape. Only where
        :meth:`runs_sparse`."""
        if self._packed_key != self._key():
            self.prepare()
        n, k, t = self.out_features, self.in_features, x2.shape[0]
        b = None if self.bias is None else self.bias.to(x2.dtype)

        def cusparselt(row_major: bool) -> torch.Tensor:
            pad = -t % 8
            xp = torch.cat([x2, x2.new_zeros(pad, k)]) if pad else x2
            return ops.spmm(self._packed, xp.t(), n, row_major, b).t()[:t]

        routes = {"sparse": lambda: cusparselt(True)}
        if self.transposed_output and t % 8 == 0:  # padded, y^T's slice is no longer one column-major tensor
            routes["sparse_dr"] = lambda: cusparselt(False)
        if t <= _gemv.MAX_TOKENS and not torch.compiler.is_compiling():
            routes["sparse_gemv"] = lambda: _gemv.gemv24(x2, self.values, self.positions, b)
        return routes

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"2:4 {'values+positions' if self.packed_state else 'dense-layout'} state"
                + (", transposed_output=True" if self.transposed_output else ""))


_tried: set[tuple] = set()
_failed: dict[tuple, str] = {}


def _working(routes: dict[str, Any], shape: tuple) -> dict[str, Any]:
    """``routes`` less those that raised the first time they ran at this shape (each is run once
    per shape, outside CUDA-graph capture; a failure is a warning, and the others carry on)."""
    if shape not in _tried and not torch.cuda.is_current_stream_capturing():
        _tried.add(shape)
        for name, fn in routes.items():
            try:
                fn()
            except Exception as e:
                _failed[(name, shape)] = f"{type(e).__name__}: {e}"
                warnings.warn(f"SparseInferenceLinear: the {name} kernel failed at out x in x tokens "
                              f"{shape[0]}x{shape[1]}x{shape[2]} ({_failed[(name, shape)][:200]}); not using it there",
                              stacklevel=3)
    left = {name: fn for name, fn in routes.items() if (name, shape) not in _failed}
    if not left:
        raise RuntimeError(f"every 2:4 kernel failed at out x in x tokens {shape[0]}x{shape[1]}x{shape[2]}: "
                           + "; ".join(_failed[(n, shape)][:200] for n in routes))
    return left


# --------------------------------------------------------------------------------------------
# converting models
# --------------------------------------------------------------------------------------------


def _dense_layer(layer: SparseLinear) -> nn.Module:
    """A SparseLinear in a dense phase as the plain layer it stands for (nn.Linear, or Hugging
    Face's Conv1D where it came from one)."""
    w, b = layer.weight.detach(), layer.bias
    if layer._conv1d_layout:
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
                                                    conv1d=layer._conv1d_layout,
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


def _dtype_name(dtype: torch.dtype) -> str:
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"export dtype must be one of {', '.join(_DTYPES)}, got {dtype}")


def _write_atomically(path: Path, write) -> None:
    """``write(tmp)`` then rename tmp to ``path``: a reader never sees half a file, and a failed
    write leaves nothing behind."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


#: The models an export holds, by the name its config gives (``architecture``).
_ARCHITECTURES: dict[str, tuple[type[nn.Module], type]] = {"GPT": (GPT, GPTConfig), "Llama": (Llama, LlamaConfig)}


def _build(cfg: dict[str, Any]) -> nn.Module:
    """The (meta-device) model an export config describes."""
    model_cls, config_cls = _ARCHITECTURES[cfg["architecture"]]
    return model_cls(config_cls(**cfg["model"]))


@torch.no_grad()
def save_inference(model: GPT | Llama, out: str | Path, *, dtype: torch.dtype | str = torch.bfloat16,
                   meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write twofour's GPT or Llama ``model`` to the folder ``out`` for inference (docs/export-format.md):
    ``model.safetensors`` (``model.pt`` without safetensors) with every 2:4 layer as values +
    positions and everything else dense, in ``dtype``, weights tied to another stored once; and
    ``model_config.json`` (the model's shape, the 2:4 layers, sizes, plus ``meta``). Converts
    ``model`` in place (:func:`to_inference`). Returns the config written."""
    arch = next((name for name, (cls, _) in _ARCHITECTURES.items() if type(model) is cls), None)
    if arch is None:
        raise TypeError(f"save_inference writes twofour's GPT or Llama; got {type(model).__name__} (for a Hugging "
                        "Face model use twofour.to_inference and save_pretrained)")
    dtype = _DTYPES[dtype] if isinstance(dtype, str) and dtype in _DTYPES else dtype
    name = _dtype_name(dtype)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise TrainError(f"--out {out} exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TrainError(f"cannot create the export folder {out}: {e.strerror or e}") from None
    recipes = {layer.recipe.name for _, layer in sparse_layers(model)}
    dense_phase = [n for n, layer in sparse_layers(model) if layer.recipe.sparse and layer.is_dense_phase]
    sparse = to_inference(model, packed_state=True)
    model.to(dtype)
    tied = dict(getattr(model, "tied_weights", {}))
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items() if k not in tied}
    sparse_bytes = sum(tensors[f"{n}.{b}"].nbytes for n in sparse for b in ("values", "positions"))
    dense_equiv = sum(tensors[f"{n}.values"].numel() * 2 * tensors[f"{n}.values"].element_size() for n in sparse)
    reason = None
    if not sparse:
        reason = (f"the run ended in a dense phase of its recipe ({', '.join(sorted(recipes))}: {len(dense_phase)} "
                  "layers train dense at the end, e.g. t-sr-ste's dense fine-tune), so it is exported dense"
                  if dense_phase else "the model has no 2:4 layer, so it is exported dense")
    weights = out / WEIGHTS
    try:
        from safetensors.torch import save_file  # noqa: PLC0415

        _write_atomically(weights, lambda p: save_file(tensors, str(p)))
    except ImportError:
        weights = weights.with_suffix(".pt")
        _write_atomically(weights, lambda p: torch.save(tensors, p))
    config = {"format": FORMAT, "format_version": FORMAT_VERSION, "architecture": arch,
              "model": dataclasses.asdict(model.cfg),
              "dtype": name, "weights": weights.name, "weights_bytes": weights.stat().st_size,
              "sparse_layers": sparse, "dense": not sparse, "dense_reason": reason, "tied_weights": tied,
              "sparse_layer_bytes": sparse_bytes, "sparse_layer_dense_bytes": dense_equiv,
              "sparse_layer_ratio": round(sparse_bytes / dense_equiv, 4) if dense_equiv else None, **(meta or {})}
    path = out / MODEL_CONFIG
    _write_atomically(path, lambda p: p.write_text(json.dumps(config, indent=2)))
    weights.chmod(stat.S_IMODE(path.stat().st_mode))  # safetensors creates its file private (0600)
    return config


def read_export_config(path: str | Path) -> dict[str, Any]:
    """An export folder's ``model_config.json``, checked (format, version, weights file and its
    size); TrainError with one line saying what is wrong."""
    path = Path(path)
    if not path.is_dir():
        raise TrainError(f"{path}: no such export folder" if not path.exists() else
                         f"{path} is a file; give the export folder (the one with {MODEL_CONFIG})")
    cfg_path = path / MODEL_CONFIG
    if not cfg_path.exists():
        if (path / CKPT).exists():
            raise TrainError(f"{path} is a run folder that has not been exported: run `twofour export {path}` first")
        raise TrainError(f"{path} is not a twofour export (no {MODEL_CONFIG})")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise TrainError(f"{cfg_path} is unreadable or not JSON ({type(e).__name__}: {e})") from None
    if not isinstance(cfg, dict) or cfg.get("format") != FORMAT:
        old = isinstance(cfg, dict) and isinstance(cfg.get("sparse_layers"), int)
        raise TrainError(f"{cfg_path} was written by an earlier twofour export (dense weights): export the run again"
                         if old else f"{cfg_path} is not a twofour export config (no format {FORMAT!r})")
    version = cfg.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise TrainError(f"{cfg_path}: format version {version!r} is not one this twofour reads (up to "
                         f"{FORMAT_VERSION}); upgrade twofour")
    cfg.setdefault("architecture", "GPT")  # written before Llama exports existed: GPT was the only model
    try:
        if cfg["architecture"] not in _ARCHITECTURES:
            raise ValueError(f"unknown architecture {cfg['architecture']!r}")
        _, config_cls = _ARCHITECTURES[cfg["architecture"]]
        config_cls(**cfg["model"])
        weights = path / cfg["weights"]
        size = int(cfg["weights_bytes"])
        if Path(cfg["weights"]).name != cfg["weights"] or cfg["dtype"] not in _DTYPES:
            raise ValueError("bad weights name or dtype")
        if not isinstance(cfg["sparse_layers"], list) or not isinstance(cfg.get("tied_weights", {}), dict):
            raise ValueError("sparse_layers must be a list and tied_weights a dict")
    except (KeyError, TypeError, ValueError) as e:
        raise TrainError(f"{cfg_path} is incomplete or malformed ({type(e).__name__}: {e})") from None
    if not weights.exists():
        raise TrainError(f"{weights} is missing (named in {cfg_path})")
    if weights.stat().st_size != size:
        raise TrainError(f"{weights} has {weights.stat().st_size} bytes, {MODEL_CONFIG} says {size}: the file is "
                         "truncated or from another export")
    return cfg


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".pt":
            tensors = torch.load(path, map_location="cpu", weights_only=True)
        else:
            from safetensors.torch import load_file  # noqa: PLC0415

            tensors = load_file(str(path))
    except ImportError:
        raise TrainError(f"reading {path} needs safetensors: pip install 'twofour[export]'") from None
    except Exception as e:
        raise TrainError(f"{path} is unreadable or corrupt ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
        raise TrainError(f"{path} does not hold a flat dict of tensors")
    return tensors


def _check_tensors(expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], sparse: list[str],
                   where: Path) -> None:
    """TrainError naming the first key, shape or dtype of ``tensors`` that doesn't fit the model."""
    for name in sparse:
        if f"{name}.weight" in tensors:
            raise TrainError(f"{where}: {name} is listed as 2:4 in {MODEL_CONFIG}, but the file stores a dense weight "
                             "for it, not values and positions")
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in expected]
    if missing or unexpected:
        parts = ([f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"] if missing else []) + \
                ([f"unexpected {', '.join(unexpected[:3])}{' ...' if len(unexpected) > 3 else ''}"] if unexpected
                 else [])
        raise TrainError(f"{where} does not match {MODEL_CONFIG}: {'; '.join(parts)}")
    for k, ref in expected.items():
        t = tensors[k]
        if t.shape != ref.shape:
            raise TrainError(f"{where}: {k} has shape {tuple(t.shape)}, {MODEL_CONFIG} needs {tuple(ref.shape)}")
        want = "uint8" if ref.dtype == torch.uint8 else "a float dtype"
        if (t.dtype == torch.uint8) if ref.dtype == torch.uint8 else t.dtype.is_floating_point:
            continue
        raise TrainError(f"{where}: {k} has dtype {t.dtype}, expected {want}")


def load_for_inference(path: str | Path, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                       *, dense: bool = False) -> GPT | Llama:
    """The exported GPT or Llama in ``path``, ready to run: eval mode, on ``device`` (default: CUDA if
    available, else the CPU), in ``dtype`` (default: the stored dtype on a GPU, float32 on the
    CPU, where bf16 matmuls are slow; the stored values convert exactly).

    Its 2:4 layers are :class:`SparseInferenceLinear`, prepared at load: on a GPU with the fast
    path, cuSPARSELt's compressed operand is built once; elsewhere the exact dense matrix.
    ``dense=True`` loads them as plain ``nn.Linear`` with the same weights instead (the dense
    twin, for comparisons). Bad input (not an export, a truncated or mismatched file, positions
    that aren't 2:4) raises TrainError before anything is built."""
    path = Path(path)
    cfg = read_export_config(path)
    tensors = _read_tensors(path / cfg["weights"])
    sparse, tied = cfg["sparse_layers"], dict(cfg.get("tied_weights", {}))
    stored = _DTYPES[cfg["dtype"]]
    with torch.device("meta"):
        model = _build(cfg)
    mods = dict(model.named_modules())
    for name in sparse:
        lin = mods.get(name)
        if not isinstance(lin, nn.Linear):
            raise TrainError(f"{path / MODEL_CONFIG} lists {name!r} as a 2:4 layer, but the model has no linear layer "
                             "of that name")
        _replace(model, name, SparseInferenceLinear(lin.in_features, lin.out_features, lin.bias is not None,
                                                    device="meta", dtype=stored,
                                                    transposed_output=matches(name, FFN_IN_PATTERNS)))
    expected = {k: v for k, v in model.state_dict().items() if k not in tied}
    if any(src not in expected for src in tied.values()):
        raise TrainError(f"{path / MODEL_CONFIG}: tied_weights names a weight the model doesn't have")
    _check_tensors(expected, tensors, sparse, path / cfg["weights"])
    for name in sparse:
        try:
            check_positions(tensors[f"{name}.positions"], mods[name].in_features, f"{name}.positions")
        except ValueError as e:
            raise TrainError(f"{path / cfg['weights']}: {e}") from None
    model.load_state_dict({**tensors, **{alias: tensors[src] for alias, src in tied.items()}}, strict=True,
                          assign=True)
    for alias, src in tied.items():  # one parameter under both names again
        owner, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(src))
    model.reset_buffers()  # what the file doesn't hold (Llama's rotary tables)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if dtype is None:
        dtype = stored if device.type == "cuda" else torch.float32
    if dense:
        for name in sparse:
            lin = model.get_submodule(name)
            plain = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
            plain.weight = nn.Parameter(lin.dense_weight(), requires_grad=False)
            plain.bias = lin.bias
            _replace(model, name, plain)
    model.to(device=device, dtype=dtype)
    model.requires_grad_(False)
    model.eval()
    for _, mod in model.named_modules():
        if isinstance(mod, SparseInferenceLinear):
            mod.prepare()
    return model
