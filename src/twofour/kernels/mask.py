"""The per-step mask refresh of SparseLinear layers in one Triton kernel launch: each layer's new
2:4 mask (2 largest |w| of every group of 4, ties to the lower index, as ``functional.mask_24``)
written over the old one, and the number of positions that changed added to that layer's device
counter.

The plain-torch version (``functional._mask_24``, a comparison and a sum) builds a 4 x 4
comparison per group, a sizeable part of a step (docs/notes/fastpath-experiments.md); this
kernel reads each weight and old mask once, a block of groups' 4 values at a time and a group's 4
mask bytes as one 32-bit word, and writes the new mask. All the layers of a model go in one launch (the kernel reads
their addresses from a table on the device), so that a step's refresh costs one launch of host
time, not three a layer. Tested against the reference on the CPU under Triton's interpreter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import dispatch
from .triton_common import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .triton_common import rank_keep

    @triton.jit
    def _refresh_kernel(table, w0, n_layers, BG: tl.constexpr, WORDS: tl.constexpr):
        """Program (b, i): groups b*BG.. of layer i. ``table`` holds, for n layers, the weights'
        addresses, the masks', the counters' and the group counts; ``w0`` (the first weight) gives
        the weights' element type. The groups' weights come as one [BG, 4] block; with ``WORDS``
        (every mask 4-byte aligned) a group's 4 mask bytes are read and written as one int32."""
        i = tl.program_id(1)
        n_groups = tl.load(table + 3 * n_layers + i)
        g = tl.program_id(0).to(tl.int64) * BG + tl.arange(0, BG)
        if tl.program_id(0).to(tl.int64) * BG < n_groups:
            w = tl.load(table + i).to(w0.dtype)
            mask = tl.load(table + n_layers + i)
            flips = tl.load(table + 2 * n_layers + i).to(tl.pointer_type(tl.int64))
            ok = g < n_groups
            a = tl.abs(tl.load(w + g[:, None] * 4 + tl.arange(0, 4)[None, :], mask=ok[:, None], other=0.0))
            even, odd = tl.split(tl.reshape(a.to(tl.float32), (BG, 2, 2)))  # columns (0, 2) and (1, 3)
            a0, a2 = tl.split(even)
            a1, a3 = tl.split(odd)
            k0, k1, k2, k3 = rank_keep(a0, a1, a2, a3)
            new = k0.to(tl.int32) | (k1.to(tl.int32) << 8) | (k2.to(tl.int32) << 16) | (k3.to(tl.int32) << 24)
            if WORDS:
                words = mask.to(tl.pointer_type(tl.int32))
                old = tl.load(words + g, mask=ok, other=0)
                tl.store(words + g, new, mask=ok)
            else:
                byte = mask.to(tl.pointer_type(tl.uint8)) + g[:, None] * 4 + tl.arange(0, 4)[None, :]
                shift = tl.arange(0, 4)[None, :] * 8
                old = tl.sum(tl.load(byte, mask=ok[:, None], other=0).to(tl.int32) << shift, axis=1)
                tl.store(byte, ((new[:, None] >> shift) & 1).to(tl.uint8), mask=ok[:, None])
            diff = (new ^ old) & 0x01010101  # one bit per byte: mask bytes are 0 or 1
            changed = (diff & 1) + ((diff >> 8) & 1) + ((diff >> 16) & 1) + ((diff >> 24) & 1)
            tl.atomic_add(flips, tl.sum(tl.where(ok, changed, 0), axis=0).to(tl.int64))


__all__ = ["refresh_mask_", "refresh_masks_", "CONFIGS"]

_BG = 1024  # groups of 4 per program, with 4 warps, where nothing was measured (the interpreter, a capture)
#: (groups per program, warps) the GPU times once per set of weight shapes (the launch's bytes are the
#: same whatever the tile, so the fastest leaves the masks and counts as they are).
CONFIGS = ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (512, 4))
_tables: dict[tuple, tuple[torch.Tensor, bool]] = {}  # the address tables on the device, by their contents


def _table(weights: Sequence[torch.Tensor], masks: Sequence[torch.Tensor],
           flips: Sequence[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """The kernel's table on the device and whether every mask is 4-byte aligned (the kernel's
    ``WORDS``), built once per set of addresses and sizes: a model's weights are updated in
    place, so the same table serves every step (a blocking copy the first time only)."""
    key = (weights[0].device, *(t.data_ptr() for t in (*weights, *masks, *flips)),
           *(w.numel() // 4 for w in weights))
    hit = _tables.get(key)
    if hit is None:
        if len(_tables) >= 64:
            _tables.clear()
        n = len(weights)
        hit = _tables[key] = (torch.tensor(key[1:], dtype=torch.int64, device=weights[0].device),
                              all(ptr % 4 == 0 for ptr in key[1 + n:1 + 2 * n]))
    return hit


def refresh_masks_(weights: Sequence[torch.Tensor], masks: Sequence[torch.Tensor],
                   flips: Sequence[torch.Tensor]) -> None:
    """For every i: ``flips[i] = (mask_24(weights[i]) != masks[i]).sum(); masks[i][:] =
    mask_24(weights[i])``, in place, on the device, in one kernel launch per device and weight
    dtype. Each weight a contiguous float tensor, its mask a contiguous bool tensor of its shape,
    its counter a one-element int64 tensor, the three on one device."""
    if not HAS_TRITON:
        raise RuntimeError("refresh_masks_ needs Triton (pip install triton)")
    if not len(weights) == len(masks) == len(flips):
        raise ValueError(f"refresh_masks_: {len(weights)} weights, {len(masks)} masks and {len(flips)} counters")
    groups: dict[tuple, list[int]] = {}
    for i, (w, mask, f) in enumerate(zip(weights, masks, flips, strict=True)):
        if not (w.is_contiguous() and mask.is_contiguous() and mask.shape == w.shape and mask.dtype == torch.bool
                and w.shape[-1] % 4 == 0 and f.numel() == 1 and f.dtype == torch.int64
                and w.device == mask.device == f.device):
            raise ValueError(f"refresh_masks_: needs a contiguous weight with last dimension a multiple of 4, a "
                             f"bool mask of its shape and an int64 counter on its device; got {tuple(w.shape)} on "
                             f"{w.device}, {mask.dtype} {tuple(mask.shape)} on {mask.device}, {f.dtype} "
                             f"{tuple(f.shape)} on {f.device}")
        if w.numel():
            groups.setdefault((w.device, w.dtype), []).append(i)
    if flips:
        torch._foreach_zero_(list(flips))
    for idx in groups.values():
        ws = [weights[i] for i in idx]
        table, words = _table(ws, [masks[i].view(torch.uint8) for i in idx], [flips[i] for i in idx])
        bg, warps = _config(ws)
        blocks = max(triton.cdiv(w.numel() // 4, bg) for w in ws)
        _refresh_kernel[(blocks, len(ws))](table, ws[0], len(ws), BG=bg, WORDS=words, num_warps=warps)


_configs: dict[tuple, tuple[int, int]] = {}  # (device, dtype, largest shape, layers) -> (groups, warps)
dispatch.on_choice_change(_configs.clear)  # a pinned or forgotten choice is read again


def _config(ws: Sequence[torch.Tensor]) -> tuple[int, int]:
    """(groups per program, warps) for a launch over ``ws``: on the GPU each of :data:`CONFIGS` timed
    once (:func:`twofour.dispatch.measure`, key ``refresh:...``) on the largest weight with a scratch
    mask and counter, the fastest kept (and looked up once: the refresh runs every step); the
    default where nothing may be measured."""
    w = max(ws, key=lambda t: t.numel())
    cached = (w.device, w.dtype, tuple(w.shape), len(ws))
    if cached in _configs:
        return _configs[cached]
    key = dispatch.choice_key("refresh", w.shape[0], w.numel() // w.shape[0], len(ws), "row", w.dtype,
                              [f"{bg}x{warps}" for bg, warps in CONFIGS])
    choice = dispatch.recorded(key)
    if choice is None and w.is_cuda and dispatch.can_measure():
        mask = torch.zeros(w.shape, dtype=torch.bool, device=w.device)
        counter = torch.zeros((), dtype=torch.long, device=w.device)
        table, words = _table([w], [mask.view(torch.uint8)], [counter])

        def launch(bg: int, warps: int) -> None:
            _refresh_kernel[(triton.cdiv(w.numel() // 4, bg), 1)](table, w, 1, BG=bg, WORDS=words, num_warps=warps)

        choice = dispatch.measure(key, {f"{bg}x{warps}": (lambda bg=bg, warps=warps: launch(bg, warps))
                                        for bg, warps in CONFIGS})
    if choice is None:
        return _BG, 4
    bg, warps = choice.split("x")
    _configs[cached] = (int(bg), int(warps))
    return _configs[cached]


def refresh_mask_(w: torch.Tensor, mask: torch.Tensor, flips: torch.Tensor) -> None:
    """``flips = (mask_24(w) != mask).sum(); mask[:] = mask_24(w)`` for one layer
    (:func:`refresh_masks_`)."""
    refresh_masks_([w], [mask], [flips])
