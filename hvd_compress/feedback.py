"""Error-feedback memory: one residual per tensor.

Error feedback (Seide et al. 2014; Stich et al. 2018; Karimireddy et al. 2019) sends
``g + e`` instead of ``g`` and keeps what compression lost, ``e <- (g + e) - sent``, so
every gradient component is eventually applied: over ``T`` steps
``sum_t sent_t + e_T = sum_t g_t`` exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from hvd_compress.schemes.base import Dense, subtract


class ErrorFeedback:
    """Residuals keyed by tensor name.

    Each tensor has two float32 buffers that trade places every step, so a step allocates
    nothing: :meth:`compensate` writes ``g + e`` into the spare one, and :meth:`commit_sent`
    turns that buffer into the new residual in place (``(g + e) - sent``), handing the old
    residual's buffer back as the spare. Until :meth:`commit_sent` the residual is
    untouched, so a step that fails leaves it as it was.
    """

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}
        self._spares: dict[str, torch.Tensor] = {}

    def compensate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """``g + e`` in float32, in a buffer of this object's (never ``grad`` itself)."""
        residual = self._residuals.get(name)
        if residual is not None and residual.shape != grad.shape:
            raise ValueError(f"error feedback: residual of {name!r} has shape "
                             f"{tuple(residual.shape)} but its gradient has {tuple(grad.shape)}")
        out = self._spares.pop(name, None)
        if out is None or out.shape != grad.shape or out.device != grad.device:
            out = torch.empty(grad.shape, dtype=torch.float32, device=grad.device)
        if residual is None:
            return out.copy_(grad)
        return torch.add(grad, residual.to(grad.device), out=out)

    def commit_sent(self, name: str, compensated: torch.Tensor, sent: Dense | None) -> None:
        """Keep ``compensated - sent`` as the residual, computed in place in
        ``compensated`` (the buffer :meth:`compensate` returned); ``sent=None``: nothing was
        lost, the tensor has no residual."""
        old = self._residuals.pop(name, None)
        if sent is None:
            self._spares[name] = compensated
        else:
            self._residuals[name] = subtract(compensated, sent)
        if old is not None and old.shape == compensated.shape:
            self._spares.setdefault(name, old)

    def get(self, name: str) -> torch.Tensor | None:
        return self._residuals.get(name)

    def state_dict(self) -> dict[str, Any]:
        return {name: r.detach().clone() for name, r in self._residuals.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._residuals = {name: torch.as_tensor(r).clone() for name, r in state.items()}
        self._spares.clear()
