"""The weight of the KL-to-reference penalty, fixed or adaptive."""

from __future__ import annotations

import math
from typing import Any


class KLController:
    """The weight of the KL-to-reference penalty: fixed, or steered towards a target KL
    with the proportional controller of Ziegler et al. (2019), sec. 2.2:
    ``coef *= 1 + clip(KL / target - 1, -0.2, 0.2) * samples / horizon``."""

    def __init__(self, coef: float, target: float | None = None, horizon: int = 10_000):
        self.coef, self.target, self.horizon = coef, target, horizon

    @classmethod
    def from_config(cls, config: Any) -> KLController:
        """From a config's ``kl_coef``, ``adaptive_kl_target`` and ``adaptive_kl_horizon``."""
        return cls(config.kl_coef, config.adaptive_kl_target, config.adaptive_kl_horizon)

    def update(self, measured_kl: float, samples: float) -> None:
        """Steer by ``measured_kl`` over ``samples`` turns (with several processes, what
        they agreed on: :meth:`Algorithm.sync_adapt_kl`). A fixed weight, or a measure
        that is not finite, leaves it as it is."""
        if self.target is None or not math.isfinite(measured_kl):
            return
        error = min(max(measured_kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * samples / self.horizon

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = float(state["coef"])
