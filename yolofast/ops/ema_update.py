"""Public ``ema_update``: in-place EMA of weights, dispatched to the selected backend.

Two forms: flat (N,) buffers (every backend), or lists of tensors (``ModelEMA`` on the CPU passes the
model's own parameters and buffers: the C++ kernel reads them in place in one sweep).
"""

from __future__ import annotations

from yolofast.ops._backend import backend_name, implementation


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
    name = backend_name("ema_update", ema[0].device.type)
    if name == "cpp":
        from yolofast.ops import _library

        return _library.ema_update_multi(ema, model, decay)
    # Other backends take one pair at a time: the reference any layout, the CUDA/Triton kernels flat buffers
    # (ModelEMA keeps flat buffers on those devices and never passes lists there).
    fn = implementation("ema_update", name)
    for e, m in zip(ema, model):
        if not e.is_floating_point():
            e.copy_(m)
        elif name == "ref":
            fn(e, m, decay)
        else:
            if not e.is_contiguous():
                raise ValueError(f"ema_update: the {name} backend takes contiguous tensors; got strides "
                                 f"{e.stride()} (pass flat buffers, as ModelEMA does on {e.device.type})")
            fn(e.view(-1), m.reshape(-1), decay)
    return None


__all__ = ["ema_update"]
