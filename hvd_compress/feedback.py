"""Error-feedback memory: one residual per tensor.

Error feedback (Seide et al. 2014; Stich et al. 2018; Karimireddy et al. 2019) sends
``g + e`` instead of ``g`` and keeps what compression lost, ``e <- (g + e) - sent``, so
every gradient component is eventually applied: over ``T`` steps
``sum_t sent_t + e_T = sum_t g_t`` exactly.
"""

from __future__ import annotations

from typing import Any

import torch


class ErrorFeedback:
    """Residuals keyed by tensor name."""

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}

    def compensate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """``g + e`` as a new float32 tensor (``g`` itself when there is no residual yet)."""
        x = grad.to(torch.float32)
        residual = self._residuals.get(name)
        if residual is None:
            return x.clone() if x is grad else x
        if residual.shape != grad.shape:
            raise ValueError(f"error feedback: residual of {name!r} has shape "
                             f"{tuple(residual.shape)} but its gradient has {tuple(grad.shape)}")
        return x + residual.to(x.device)

    @staticmethod
    def residual(compensated: torch.Tensor, sent: torch.Tensor | None) -> torch.Tensor | None:
        """What compression lost; ``None`` when it sent everything."""
        return None if sent is None else compensated - sent

    def commit(self, name: str, residual: torch.Tensor | None) -> None:
        if residual is None:
            self._residuals.pop(name, None)
        else:
            self._residuals[name] = residual

    def get(self, name: str) -> torch.Tensor | None:
        return self._residuals.get(name)

    def state_dict(self) -> dict[str, Any]:
        return {name: r.detach().clone() for name, r in self._residuals.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._residuals = {name: torch.as_tensor(r).clone() for name, r in state.items()}
