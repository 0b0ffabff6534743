"""Public ``ema_update``: in-place EMA of weights, dispatched to the selected backend.

Two forms: flat (N,) buffers (every backend), or lists of tensors (``ModelEMA`` on the CPU passes the
model's own parameters and buffers: the C++ kernel reads them in place in one sweep).
"""

from __future__ import annotations

from yolofast.ops._backend import backend_name, compiled_form, implementation


def ema_update(ema, model, decay) -> None:
    """In place ``ema = d*ema + (1 - d)*model``; decay a float or a 0-d tensor.

    ema, model: two flat (N,) tensors, or two equally long lists of tensors of matching shapes (integer
    tensors in the lists are copied). Semantics (torch.lerp with weight 1 - d) in
    ``reference.ema_update_ref``, applied to each pair.
    """
    if not isinstance(ema, (list, tuple)):
        return implementation("ema_update", backend_name("ema_update", ema.device.type))(ema, model, decay)
    if len(ema) != len(model):
        raise ValueError(f"ema_update: {len(ema)} ema tensors but {len(model)} model tensors")
    if not ema:
        return None
    impl = implementation("ema_update.multi", backend_name("ema_update", ema[0].device.type))
    return impl(ema, model, decay)


def ema_plan(ema: list, model: list, decay: float, tau: float):
    """``ModelEMA``'s whole step over fixed lists of CPU tensors as one call, where ``ema_update`` runs on a
    backend that has that form (C++): ``plan.step(updates)`` adds 1 to the int64 counter, forms
    d = decay*(1 - exp(-updates/tau)) and updates every pair as ``ema_update`` does. None on any other
    backend: the caller then calls ``ema_update`` each step."""
    make = compiled_form("ema_update.plan", backend_name("ema_update", "cpu"))
    return None if make is None else make(list(ema), list(model), float(decay), float(tau))


__all__ = ["ema_plan", "ema_update"]
