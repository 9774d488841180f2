"""The 2:4 pruning math (docs/design.md, section 1), in plain torch.

Groups are 4 consecutive elements along the last dimension. Every public function validates
its input (shape, dtype, finiteness) and raises a clear error; the underscore versions skip
the checks and are what the layer calls on its hot path.
"""

from __future__ import annotations

import itertools

import torch

__all__ = [
    "mask_24",
    "hard_threshold_24",
    "soft_threshold_24",
    "transposable_mask_24",
    "prune_transpose_24",
    "mvue_24",
    "fixed_scale",
    "transposable_patterns",
    "mvue_inclusion_probability",
]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check(x: torch.Tensor, name: str, *, both_dims: bool = False, finite: bool = True) -> None:
    """Raise a clear TypeError/ValueError if ``x`` cannot be split into groups of 4."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{name}: expected a floating-point tensor (float32, bfloat16, float16, float64), "
            f"got dtype {x.dtype}"
        )
    if x.dim() == 0:
        raise ValueError(f"{name}: expected at least one dimension, got a 0-dim tensor")
    if x.numel() == 0:
        raise ValueError(f"{name}: got an empty tensor of shape {tuple(x.shape)}")
    if x.shape[-1] % 4 != 0:
        raise ValueError(
            f"{name}: the last dimension must be a multiple of 4 to form 2:4 groups, "
            f"got shape {tuple(x.shape)}"
        )
    if both_dims and (x.dim() < 2 or x.shape[-2] % 4 != 0):
        raise ValueError(
            f"{name}: both of the last two dimensions must be multiples of 4 for a "
            f"transposable mask, got shape {tuple(x.shape)}"
        )
    if finite and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name}: the input holds NaN or Inf values, which would poison the mask")


# ---------------------------------------------------------------------------------------------
# hard 2:4
# ---------------------------------------------------------------------------------------------


def _mask_24(w: torch.Tensor) -> torch.Tensor:
    """Keep the 2 largest |w| of each group; ties go to the lower index (exactly 2 kept)."""
    a = w.detach().reshape(-1, 4).abs()
    ai, aj = a.unsqueeze(2), a.unsqueeze(1)  # (n,4,1) element k, (n,1,4) competitor j
    lower = torch.ones(4, 4, dtype=torch.bool, device=w.device).tril(-1)  # lower[k, j] = j < k
    beats = (aj > ai) | ((aj == ai) & lower)  # j beats k
    return (beats.sum(2) < 2).reshape(w.shape)


def mask_24(w: torch.Tensor) -> torch.Tensor:
    """Bool mask keeping the 2 entries of largest magnitude in every group of 4."""
    _check(w, "mask_24")
    return _mask_24(w)


def hard_threshold_24(w: torch.Tensor) -> torch.Tensor:
    """``w * mask_24(w)``: the hard 2:4 pruning of STE and SR-STE."""
    _check(w, "hard_threshold_24")
    return w * _mask_24(w)


# ---------------------------------------------------------------------------------------------
# soft threshold and its fixed scale (S-STE)
# ---------------------------------------------------------------------------------------------


def _soft_threshold_24(w: torch.Tensor) -> torch.Tensor:
    g = w.reshape(-1, 4)
    t = g.abs().sort(dim=1).values[:, 1:2]  # second-smallest |a_i| of each group
    return (torch.sign(g) * torch.clamp(g.abs() - t, min=0)).reshape(w.shape)


def soft_threshold_24(w: torch.Tensor) -> torch.Tensor:
    """S(a)_i = sign(a_i) * max(|a_i| - t, 0), t the second-smallest |a_i| of the group.

    Continuous in ``w`` with at most 2 non-zeros per group: S-STE's pruning function.
    """
    _check(w, "soft_threshold_24")
    return _soft_threshold_24(w)


def _fixed_scale(w: torch.Tensor) -> torch.Tensor:
    w32 = w.detach().float()
    s = _soft_threshold_24(w32)
    num, den = (w32 * s).sum(), (s * s).sum()
    # an all-zero S(W) has no scale to fit: fall back to 1 instead of 0/0
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(torch.float32).tiny), num.new_ones(()))


def fixed_scale(w: torch.Tensor) -> torch.Tensor:
    """beta = <W, S(W)> / <S(W), S(W)>: the least-squares scale of S(W) to W (0-dim float32)."""
    _check(w, "fixed_scale")
    return _fixed_scale(w)


# ---------------------------------------------------------------------------------------------
# transposable masks (T-SR-STE)
# ---------------------------------------------------------------------------------------------

_PATTERNS: dict[torch.device, torch.Tensor] = {}


def transposable_patterns(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 90 4x4 0/1 patterns with exactly two ones in every row and column, as (90, 16) float."""
    device = torch.device(device)
    if device not in _PATTERNS:
        rows = [r for r in itertools.product((0, 1), repeat=4) if sum(r) == 2]
        pats = [
            p
            for p in itertools.product(rows, repeat=4)
            if all(sum(p[i][j] for i in range(4)) == 2 for j in range(4))
        ]
        _PATTERNS[device] = torch.tensor(pats, dtype=torch.float32, device=device).reshape(-1, 16)
    return _PATTERNS[device]


def _transposable_mask_24(w: torch.Tensor) -> torch.Tensor:
    *lead, r, c = w.shape
    a = w.detach().float().abs().reshape(-1, r // 4, 4, c // 4, 4).transpose(2, 3)  # (b, R, C, 4, 4)
    pats = transposable_patterns(w.device)
    best = (a.reshape(-1, 16) @ pats.t()).argmax(dim=1)  # score all 90 patterns per block
    m = pats[best].reshape(a.shape).transpose(2, 3).reshape(w.shape)
    return m.bool()


def transposable_mask_24(w: torch.Tensor) -> torch.Tensor:
    """Bool mask that is 2:4 along both of the last two dims, optimal per 4x4 block.

    Each 4x4 block of |w| takes, among the 90 patterns with two ones per row and column, the
    one keeping the largest sum (exhaustive, so never fewer than 8 kept per block).
    """
    _check(w, "transposable_mask_24", both_dims=True)
    return _transposable_mask_24(w)


def _prune_transpose_24(w: torch.Tensor) -> torch.Tensor:
    return w * _mask_24(w.transpose(-2, -1)).transpose(-2, -1)


def prune_transpose_24(w: torch.Tensor) -> torch.Tensor:
    """``w`` with its transpose pruned 2:4 too: the 2 largest |w| of every 4 consecutive entries of
    a column kept, the rest zeroed (the ``pruned-t`` dX route's weight: of a 2:4 ``W_eff`` it keeps a
    matrix 2:4 along both dimensions, so ``dX = dY W`` can run on sparse tensor cores)."""
    _check(w, "prune_transpose_24", both_dims=True)
    return _prune_transpose_24(w)


# ---------------------------------------------------------------------------------------------
# MVUE (unbiased 2:4 estimate of the output gradient)
# ---------------------------------------------------------------------------------------------

def _mvue_weights(g: torch.Tensor) -> torch.Tensor:
    """a = |x| + eps per (n, 4) group, eps relative to the group's largest entry (plus a floor for
    all-zero groups), so that every ratio in the estimator stays finite in float32."""
    ax = g.float().abs()
    return ax + (1e-6 * ax.amax(1, keepdim=True) + 1e-30)


def _inclusion(a: torch.Tensor) -> torch.Tensor:
    """p_k = a_k/S * (1 + sum_{i != k} a_i / (S - a_i)); S - a_i summed directly, no cancellation."""
    rest = a.roll(1, 1) + a.roll(2, 1) + a.roll(3, 1)
    ratio = a / rest
    return a / a.sum(1, keepdim=True) * (1 + ratio.sum(1, keepdim=True) - ratio)


def mvue_inclusion_probability(x: torch.Tensor) -> torch.Tensor:
    """The probability that mvue_24 keeps each entry of ``x`` (same shape), for variance bounds."""
    return _inclusion(_mvue_weights(x.reshape(-1, 4))).reshape(x.shape)


def _draw(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per (n, 4) row, the index k with probability w_k / sum(w): how many of the running sums
    w_0, w_0 + w_1, w_0 + w_1 + w_2 lie at or below u * sum(w) (a zero weight is never drawn).
    The sums are spelled out so that the fused kernel adds in the same order."""
    c1, c2 = w[:, 0], w[:, 0] + w[:, 1]
    c3 = c2 + w[:, 2]
    t = u * (c3 + w[:, 3])
    return (c1 <= t).long() + (c2 <= t).long() + (c3 <= t).long()


def _mvue_24(x: torch.Tensor, generator: torch.Generator | None = None, u: torch.Tensor | None = None) -> torch.Tensor:
    g = x.reshape(-1, 4)
    a = _mvue_weights(g)
    # Two draws without replacement, the first with probability a_i/S, the second a_j/(S-a_i),
    # from two uniforms per group (given ones: tests of the fused kernel draw the same).
    u = torch.rand(a.shape[0], 2, generator=generator, device=a.device) if u is None else u.reshape(-1, 2)
    rows = torch.arange(a.shape[0], device=a.device)
    first = _draw(a, u[:, 0])
    rest = a.clone()
    rest[rows, first] = 0.0
    second = _draw(rest, u[:, 1])
    keep = torch.zeros_like(a, dtype=torch.bool)
    keep[rows, first] = True
    keep[rows, second] = True
    out = torch.where(keep, g.float() / _inclusion(a), torch.zeros_like(a))
    return out.to(x.dtype).reshape(x.shape)


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    cur = torch.cuda.current_device()
    return (cur if a.index is None else a.index) == (cur if b.index is None else b.index)


def mvue_24(x: torch.Tensor, generator: torch.Generator | None = None, *,
            u: torch.Tensor | None = None) -> torch.Tensor:
    """An unbiased random 2:4 estimate of ``x`` (E[mvue_24(x)] = x), at most 2 non-zeros per group.

    Used on the output gradient dY^T (groups along tokens) so that the weight-gradient GEMM is
    2:4 sparse too. ``generator`` makes the draw reproducible; ``u`` (two uniforms in [0, 1) per
    group of 4) gives the draw instead, to check a kernel that draws its own against this one.
    """
    _check(x, "mvue_24")
    if generator is not None and not _same_device(generator.device, x.device):
        raise ValueError(f"mvue_24: generator is on {generator.device} but the input is on {x.device}")
    if u is not None and u.numel() != x.numel() // 2:
        raise ValueError(f"mvue_24: u needs 2 uniforms per group of 4, {x.numel() // 2}, got {u.numel()}")
    return _mvue_24(x, generator, u)


def mvue_24_padded(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """MVUE along the last dim of any length: pads with zeros to a multiple of 4, then crops."""
    n = x.shape[-1]
    pad = (-n) % 4
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return _mvue_24(x, generator)[..., :n]
