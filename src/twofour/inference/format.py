"""The export folder (``model.safetensors`` + ``model_config.json``, docs/export-format.md):
:func:`save_inference`, :func:`read_export_config`, :func:`load_for_inference`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import stat
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import FormatError, missing_link, write_failure
from ..integrity import crc32_file
from ..models.common import FFN_IN_PATTERNS, GPTConfig, LlamaConfig
from ..models.gpt import GPT
from ..models.llama import Llama
from ..sparse.convert import matches, sparse_layers
from .convert import _replace, to_inference
from .layer import _DTYPES, FORMAT, FORMAT_VERSION, SparseInferenceLinear
from .packed import check_positions

#: The export folder's files: the weights (``model.pt`` instead when asked for) and the config.
WEIGHTS, MODEL_CONFIG = "model.safetensors", "model_config.json"
#: The weights file of each format ``save_inference`` writes.
WEIGHTS_FILES = {"safetensors": WEIGHTS, "pt": "model.pt"}
#: A training run's checkpoint (``twofour.training.checkpoint.CKPT``), named here for a one-line hint:
#: inference never imports training.
_RUN_CHECKPOINT = "ckpt.pt"


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
        with contextlib.suppress(OSError):  # (a folder in its way stays, and the first error is the one raised)
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
                   meta: dict[str, Any] | None = None, weights_format: str = "safetensors",
                   overwrite: bool = False) -> dict[str, Any]:
    """Write twofour's GPT or Llama ``model`` to the folder ``out`` for inference (docs/export-format.md):
    ``model.safetensors`` (``model.pt`` with ``weights_format="pt"``) with every 2:4 layer as values +
    positions and everything else dense, in ``dtype``, weights tied to another stored once; and
    ``model_config.json`` (the model's shape, the 2:4 layers, sizes, plus ``meta``). Converts
    ``model`` in place (:func:`to_inference`). Returns the config written.

    A folder that already holds an export is refused (FormatError) unless ``overwrite``: its files
    are then replaced, the other format's weights file removed."""
    arch = next((name for name, (cls, _) in _ARCHITECTURES.items() if type(model) is cls), None)
    if arch is None:
        raise TypeError(f"save_inference writes twofour's GPT or Llama; got {type(model).__name__} (for a Hugging "
                        "Face model use twofour.to_inference and save_pretrained)")
    dtype = _DTYPES[dtype] if isinstance(dtype, str) and dtype in _DTYPES else dtype
    name = _dtype_name(dtype)
    if weights_format not in WEIGHTS_FILES:
        raise ValueError(f"weights_format must be one of {', '.join(WEIGHTS_FILES)}, got {weights_format!r}")
    out = _export_folder(Path(out), overwrite)
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
    weights = _write_weights(out / WEIGHTS_FILES[weights_format], tensors, weights_format)
    config = {"format": FORMAT, "format_version": FORMAT_VERSION, "architecture": arch,
              "model": dataclasses.asdict(model.cfg),
              "dtype": name, "weights": weights.name, "weights_bytes": weights.stat().st_size,
              "weights_crc32": crc32_file(weights),
              "sparse_layers": sparse, "dense": not sparse, "dense_reason": reason, "tied_weights": tied,
              "sparse_layer_bytes": sparse_bytes, "sparse_layer_dense_bytes": dense_equiv,
              "sparse_layer_ratio": round(sparse_bytes / dense_equiv, 4) if dense_equiv else None, **(meta or {})}
    path = out / MODEL_CONFIG
    _write_atomically(path, lambda p: p.write_text(json.dumps(config, indent=2)))
    weights.chmod(stat.S_IMODE(path.stat().st_mode))  # safetensors creates its file private (0600)
    for name in WEIGHTS_FILES.values():  # an export replaced in the other format leaves one weights file
        if name != weights.name:
            (out / name).unlink(missing_ok=True)
    return config


def _export_folder(out: Path, overwrite: bool) -> Path:
    """``out``, created, after refusing a file in its place or (without ``overwrite``) an export
    it already holds (FormatError, one line)."""
    if out.exists() and not out.is_dir():
        raise FormatError(f"--out {out} exists and is not a folder")
    held = [n for n in (*WEIGHTS_FILES.values(), MODEL_CONFIG) if (out / n).exists()]
    if held and not overwrite:
        raise FormatError(f"{out} already holds an export ({', '.join(held)}); pass --overwrite to replace it, or "
                          "choose another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = missing_link(out) or e.strerror or e  # a link to nothing: not a bare "File exists"
        raise FormatError(f"cannot create the export folder {out}: {why}") from None
    return out


def _write_weights(weights: Path, tensors: dict[str, torch.Tensor], weights_format: str) -> Path:
    """``tensors`` written atomically to ``weights`` (torch.save or safetensors); FormatError on a
    read-only folder or a full disk."""
    try:
        if weights_format == "pt":
            _write_atomically(weights, lambda p: torch.save(tensors, p))
        else:
            _write_atomically(weights, lambda p: save_file(tensors, str(p)))
    except (OSError, RuntimeError, SafetensorError) as e:
        raise FormatError(f"cannot write {weights}: {write_failure(e)}") from None
    return weights


def read_export_config(path: str | Path) -> dict[str, Any]:
    """An export folder's ``model_config.json``, checked (format, version, weights file and its
    size); FormatError with one line saying what is wrong."""
    path = Path(path)
    if not path.is_dir():
        raise FormatError(f"{path}: no such export folder" if not path.exists() else
                         f"{path} is a file; give the export folder (the one with {MODEL_CONFIG})")
    cfg_path = path / MODEL_CONFIG
    if not cfg_path.exists():
        if (path / _RUN_CHECKPOINT).exists():
            raise FormatError(f"{path} is a run folder that has not been exported: run `twofour export {path}` first")
        raise FormatError(f"{path} is not a twofour export (no {MODEL_CONFIG})")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise FormatError(f"{cfg_path} is unreadable or not JSON ({type(e).__name__}: {e})") from None
    if not isinstance(cfg, dict) or cfg.get("format") != FORMAT:
        old = isinstance(cfg, dict) and isinstance(cfg.get("sparse_layers"), int)
        raise FormatError(f"{cfg_path} was written by an earlier twofour export (dense weights): export the run again"
                         if old else f"{cfg_path} is not a twofour export config (no format {FORMAT!r})")
    version = cfg.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise FormatError(f"{cfg_path}: format version {version!r} is not one this twofour reads (up to "
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
        crc = cfg.get("weights_crc32")
        if crc is not None and (not isinstance(crc, int) or isinstance(crc, bool)):
            raise ValueError(f"weights_crc32 must be a whole number, got {crc!r}")
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"{cfg_path} is incomplete or malformed ({type(e).__name__}: {e})") from None
    if not weights.exists():
        raise FormatError(f"{weights} is missing (named in {cfg_path})")
    if weights.stat().st_size != size:
        raise FormatError(f"{weights} has {weights.stat().st_size} bytes, {MODEL_CONFIG} says {size}: the file is "
                         "truncated or from another export")
    return cfg


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".pt":
            tensors = torch.load(path, map_location="cpu", weights_only=True)
        else:
            tensors = load_file(str(path))
    except pickle.UnpicklingError:  # torch's refusal reads as advice to load it anyway: say what it is
        raise FormatError(f"{path} is refused and was not loaded: it holds code, not only tensors, and unpickling "
                          "it could run that code") from None
    except Exception as e:
        raise FormatError(f"{path} is unreadable or corrupt ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
        raise FormatError(f"{path} does not hold a flat dict of tensors")
    return tensors


def _check_tensors(expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], sparse: list[str],
                   where: Path) -> None:
    """FormatError naming the first key, shape or dtype of ``tensors`` that doesn't fit the model."""
    for name in sparse:
        if f"{name}.weight" in tensors:
            raise FormatError(f"{where}: {name} is listed as 2:4 in {MODEL_CONFIG}, but the file stores a dense weight "
                             "for it, not values and positions")
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in expected]
    if missing or unexpected:
        parts = ([f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"] if missing else []) + \
                ([f"unexpected {', '.join(unexpected[:3])}{' ...' if len(unexpected) > 3 else ''}"] if unexpected
                 else [])
        raise FormatError(f"{where} does not match {MODEL_CONFIG}: {'; '.join(parts)}")
    for k, ref in expected.items():
        t = tensors[k]
        if t.shape != ref.shape:
            raise FormatError(f"{where}: {k} has shape {tuple(t.shape)}, {MODEL_CONFIG} needs {tuple(ref.shape)}")
        want = "uint8" if ref.dtype == torch.uint8 else "a float dtype"
        if (t.dtype == torch.uint8) if ref.dtype == torch.uint8 else t.dtype.is_floating_point:
            continue
        raise FormatError(f"{where}: {k} has dtype {t.dtype}, expected {want}")


def _skeleton(cfg: dict[str, Any], path: Path, stored: torch.dtype) -> GPT | Llama:
    """The export's model on the meta device, its 2:4 layers as :class:`SparseInferenceLinear`;
    FormatError for a listed 2:4 layer the model lacks."""
    with torch.device("meta"):
        model = _build(cfg)
    mods = dict(model.named_modules())
    for name in cfg["sparse_layers"]:
        lin = mods.get(name)
        if not isinstance(lin, nn.Linear):
            raise FormatError(f"{path / MODEL_CONFIG} lists {name!r} as a 2:4 layer, but the model has no linear layer "
                             "of that name")
        _replace(model, name, SparseInferenceLinear(lin.in_features, lin.out_features, lin.bias is not None,
                                                    device="meta", dtype=stored,
                                                    transposed_output=matches(name, FFN_IN_PATTERNS)))
    return model


def _as_dense(model: nn.Module, sparse: list[str], device: torch.device) -> None:
    """Each 2:4 layer named in ``sparse`` replaced by a plain ``nn.Linear`` with its weights, unpacked
    on ``device`` (where it runs: a 7B model's on the CPU is slow)."""
    for name in sparse:
        lin = model.get_submodule(name).to(device)
        plain = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
        plain.weight = nn.Parameter(lin.dense_weight(), requires_grad=False)
        plain.bias = lin.bias
        _replace(model, name, plain)


def load_for_inference(path: str | Path, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                       *, dense: bool = False) -> GPT | Llama:
    """The exported GPT or Llama in ``path``, ready to run: eval mode, on ``device`` (default: CUDA if
    available, else the CPU), in ``dtype`` (default: the stored dtype on a GPU, float32 on the
    CPU, where bf16 matmuls are slow; the stored values convert exactly).

    Its 2:4 layers are :class:`SparseInferenceLinear`, prepared at load: on a GPU with the fast
    path, cuSPARSELt's compressed operand is built once; elsewhere the exact dense matrix.
    ``dense=True`` loads them as plain ``nn.Linear`` with the same weights instead (the dense
    twin, for comparisons). Bad input (not an export, a truncated or mismatched file, positions
    that aren't 2:4) raises FormatError before anything is built."""
    path = Path(path)
    cfg = read_export_config(path)
    crc = cfg.get("weights_crc32")  # exports written before it have none
    if crc is not None and crc32_file(path / cfg["weights"]) != crc:
        raise FormatError(f"{path / cfg['weights']} is damaged (its bytes fail the CRC-32 that {MODEL_CONFIG} "
                          "records), so it was not loaded: export the run again")
    tensors = _read_tensors(path / cfg["weights"])
    sparse, tied = cfg["sparse_layers"], dict(cfg.get("tied_weights", {}))
    stored = _DTYPES[cfg["dtype"]]
    model = _skeleton(cfg, path, stored)
    mods = dict(model.named_modules())
    expected = {k: v for k, v in model.state_dict().items() if k not in tied}
    if any(src not in expected for src in tied.values()):
        raise FormatError(f"{path / MODEL_CONFIG}: tied_weights names a weight the model doesn't have")
    _check_tensors(expected, tensors, sparse, path / cfg["weights"])
    for name in sparse:
        try:
            check_positions(tensors[f"{name}.positions"], mods[name].in_features, f"{name}.positions")
        except ValueError as e:
            raise FormatError(f"{path / cfg['weights']}: {e}") from None
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
        _as_dense(model, sparse, device)
    model.to(device=device, dtype=dtype)
    model.requires_grad_(False)
    model.eval()
    for _, mod in model.named_modules():
        if isinstance(mod, SparseInferenceLinear):
            mod.prepare()
    return model
