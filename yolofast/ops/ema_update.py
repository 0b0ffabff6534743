"""Public ``ema_update``: in-place EMA of flat weight buffers, dispatched to the selected backend."""

from __future__ import annotations

import torch

from yolofast.ops._backend import backend_name, implementation


def ema_update(ema: torch.Tensor, model: torch.Tensor, decay) -> None:
    """In place ``ema = d*ema + (1 - d)*model`` over flat (N,) buffers; decay a float or a 0-d tensor.

    Semantics (torch.lerp with weight 1 - d) in ``reference.ema_update_ref``.
    """
    return implementation("ema_update", backend_name("ema_update", ema.device.type))(ema, model, decay)
