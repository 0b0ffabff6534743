"""Per-epoch statistics of the total gradient norm before clipping (what ``clip_grad_norm_`` returns).

    stats = GradNormStats(max_norm=10.0)
    stats.add(torch.nn.utils.clip_grad_norm_(params, 10.0))   # every optimizer step, eager or graphed
    stats.read()  # {"grad/norm_mean", "grad/norm_max", "grad/clip_frac", "grad/nonfinite"}: the epoch so far

``add`` only queues a few element-wise ops on the norm's device: no ``.item()``, so a GPU step never waits
for the host. ``read`` copies the five sums to the host once (per progress-bar refresh and per epoch).
A non-finite norm (inf/NaN gradients) is counted apart and left out of the mean and max, which would
otherwise read inf/NaN for the whole epoch and hide how large the finite steps were.
"""

from __future__ import annotations

import math

import torch

__all__ = ["GRAD_COLUMNS", "GradNormStats"]

# results.csv columns, after Ultralytics' ones: mean and max pre-clip norm of the epoch's finite steps, the
# share of steps that clipping shrank (norm > max_norm), and how many steps had a non-finite norm.
GRAD_COLUMNS = ("grad/norm_mean", "grad/norm_max", "grad/clip_frac", "grad/nonfinite")


class GradNormStats:
    def __init__(self, max_norm: float = 10.0):
        self.max_norm = float(max_norm)
        self.reset()

    def reset(self) -> None:
        self._sums = None  # (finite-norm sum, finite steps, clipped steps, non-finite steps, max), device

    @torch.no_grad()
    def add(self, norm: torch.Tensor) -> None:
        n = norm.detach().float().reshape(1)
        finite = torch.isfinite(n)
        v = torch.where(finite, n, torch.zeros_like(n))
        row = torch.cat([v, finite.float(), (finite & (n > self.max_norm)).float(), (~finite).float(), v])
        if self._sums is None:
            self._sums = row
        else:
            self._sums[:4] += row[:4]
            torch.maximum(self._sums[4:], row[4:], out=self._sums[4:])

    def read(self) -> dict:
        """The epoch so far (one host copy); NaN mean/max before the first finite step."""
        if self._sums is None:
            s, n_finite, clipped, nonfinite, mx = 0.0, 0, 0, 0, math.nan
        else:
            s, n_finite, clipped, nonfinite, mx = self._sums.tolist()
        steps = n_finite + nonfinite
        return {
            GRAD_COLUMNS[0]: s / n_finite if n_finite else math.nan,
            GRAD_COLUMNS[1]: mx if n_finite else math.nan,
            GRAD_COLUMNS[2]: clipped / steps if steps else math.nan,
            GRAD_COLUMNS[3]: int(nonfinite),
        }
