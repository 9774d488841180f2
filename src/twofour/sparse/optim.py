"""STEPAdamW: the Adam-aware two-phase optimizer of STEP (Lu et al., arXiv 2302.01172).

Phase 1 is plain AdamW (the model trains dense) while the optimizer watches how fast the
second moment ``v`` still moves: ``sum |v_t - v_{t-1}| / sum v_t`` over all parameters, averaged
over a window of ``1/(1-beta2)`` steps. Once that falls below ``switch_eps`` (after ``t_min``
of the steps), or at ``t_max`` at the latest, ``v`` is frozen and used as a fixed
preconditioner from then on, and ``twofour.attach`` turns the STEP layers' 2:4 masks on.

The change is measured relative to ``v`` itself, so the switch does not depend on the scale of
the loss or the gradients (GPT's gradients make ``v`` so small that an absolute threshold on
``mean |v_t - v_{t-1}|`` is met at ``t_min`` in every run). Once ``v`` tracks a stationary
gradient distribution the relative change sits near ``1 - beta2``, so the default
``switch_eps`` is ``1 - beta2``: switch when ``v`` moves no faster than noise alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch

__all__ = ["STEPAdamW"]


class STEPAdamW(torch.optim.Optimizer):
    """AdamW with STEP's automatic switch to a frozen second moment.

    Args:
        params: parameters or parameter groups.
        total_steps: the run's length in optimizer steps (sets ``t_min`` and ``t_max``).
        lr, betas, eps, weight_decay: as in ``torch.optim.AdamW``.
        t_min, t_max: earliest and latest switch, as fractions of ``total_steps`` (STEP: 10%, 50%).
        switch_eps: switch once the windowed relative change of ``v`` falls below this
            (default ``1 - beta2``).
    """

    def __init__(self, params: Iterable, total_steps: int, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 t_min: float = 0.1, t_max: float = 0.5, switch_eps: float | None = None):
        if not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"STEPAdamW: total_steps must be a positive int, got {total_steps!r}")
        if not 0 <= t_min <= t_max <= 1:
            raise ValueError(f"STEPAdamW: need 0 <= t_min <= t_max <= 1, got t_min={t_min}, t_max={t_max}")
        if not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1:
            raise ValueError(f"STEPAdamW: betas must be in [0, 1), got {betas}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.total_steps = total_steps
        self.t_min, self.t_max = round(t_min * total_steps), round(t_max * total_steps)
        self.switch_eps = 1 - betas[1] if switch_eps is None else switch_eps
        self.window = max(1, round(1 / (1 - betas[1])))
        self._dv: deque[float] = deque(maxlen=self.window)
        self.steps = 0
        self.switched_at: int | None = None  # optimizer step at which v was frozen

    @property
    def switched(self) -> bool:
        """True once v is frozen (STEP's phase 2: masks on)."""
        return self.switched_at is not None

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["step_phase"] = {"steps": self.steps, "switched_at": self.switched_at, "dv": list(self._dv)}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        phase = state_dict.pop("step_phase", None)
        super().load_state_dict(state_dict)
        if phase is not None:
            self.steps, self.switched_at = phase["steps"], phase["switched_at"]
            self._dv = deque(phase["dv"], maxlen=self.window)

    def variance_change(self) -> float | None:
        """The windowed relative change of v that drives the switch (None before step 1)."""
        return sum(self._dv) / len(self._dv) if self._dv else None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        frozen = self.switched
        dv_sum = v_sum = None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float()
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    st["v_steps"] = 0  # steps v was updated for (its bias correction)
                st["step"] += 1
                m, v = st["exp_avg"], st["exp_avg_sq"]
                m.lerp_(g, 1 - beta1)
                if not frozen:
                    d = (g * g - v).abs_().sum() * (1 - beta2)  # sum |v_t - v_{t-1}|
                    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                    dv_sum = d if dv_sum is None else dv_sum + d
                    v_sum = v.sum() if v_sum is None else v_sum + v.sum()
                    st["v_steps"] = st["step"]
                m_hat = m / (1 - beta1 ** st["step"])
                v_hat = v / (1 - beta2 ** max(st["v_steps"], 1))
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_((m_hat / (v_hat.sqrt() + group["eps"])).to(p.dtype), alpha=-group["lr"])
        self.steps += 1
        if not frozen and dv_sum is not None:
            self._dv.append(float(dv_sum / v_sum.clamp_min(torch.finfo(torch.float32).tiny)))
            mean_dv = self.variance_change()
            if (self.steps >= self.t_min and mean_dv is not None and mean_dv < self.switch_eps) \
                    or self.steps >= self.t_max:
                self.switched_at = self.steps
        return loss

    def __repr__(self) -> str:
        phase = f"frozen v since step {self.switched_at}" if self.switched else "phase 1 (dense AdamW)"
        return f"STEPAdamW(total_steps={self.total_steps}, t_min={self.t_min}, t_max={self.t_max}, {phase})"

