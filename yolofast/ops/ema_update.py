"""Public ``ema_update``: in-place EMA of flat weight buffers, dispatched to the selected backend."""

from __future__ import annotations

import torch

from yolofast.ops import reference
from yolofast.ops._backend import select_backend


@torch.compiler.assume_constant_result
def _backend_name(device_type: str) -> str:
    # Under torch.compile this runs once at trace time and the choice is baked into the graph (the
    # availability check takes a lock that dynamo cannot trace); in eager mode it runs on every call.
    return select_backend("ema_update", device_type)


def ema_update(ema: torch.Tensor, model: torch.Tensor, decay) -> None:
    """In place ``ema = d*ema + (1 - d)*model`` over flat (N,) buffers; decay a float or a 0-d tensor.

    Semantics (torch.lerp with weight 1 - d) in ``reference.ema_update_ref``.
    """
    name = _backend_name(ema.device.type)
    if name == "ref":
        return reference.ema_update_ref(ema, model, decay)
    if name in ("cpp", "cuda"):
        from yolofast.ops import _library

        return _library.ema_update(ema, model, decay)
    from yolofast.kernels.ema_update import ema_update as triton_ema_update

    return triton_ema_update(ema, model, decay)
