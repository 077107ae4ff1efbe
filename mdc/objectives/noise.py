"""How the masked objectives draw noise levels t: apart from their config classes
(mdc/objectives/sections.py, torch-free), which call it when a loss is computed."""

from __future__ import annotations

import torch


def sample_t(
    n: int,
    omega_l: float,
    omega_u: float,
    antithetic: bool = True,
    generator: torch.Generator | None = None,
    device=None,
) -> torch.Tensor:
    """t ~ U[ω_l, ω_u]. Antithetic: one draw per stratum [i/n, (i+1)/n) of the interval, a
    low-discrepancy batch that lowers the variance of the loss estimate (MDLM)."""
    u = torch.rand(n, generator=generator, device=device)
    if antithetic:
        u = (torch.arange(n, device=device) + u) / n
    return omega_l + (omega_u - omega_l) * u
