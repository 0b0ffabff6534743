"""Hot ops of yolofast with one public function each; the backend is chosen per call (see _backend.py).

Note: the functions shadow their modules as attributes of this package (``yolofast.ops.tal_assign`` is the
function); import a module explicitly with ``from yolofast.ops import reference`` or via ``sys.modules``.
"""

from yolofast.ops import reference
from yolofast.ops._backend import BackendUnavailable, backend, select_backend
from yolofast.ops.bbox_loss import bbox_loss, bbox_loss_maps
from yolofast.ops.ema_update import ema_update
from yolofast.ops.head_decode import head_decode
from yolofast.ops.ns_orthogonalize import ns_orthogonalize
from yolofast.ops.tal_assign import tal_assign, tal_assign_maps

__all__ = [
    "BackendUnavailable",
    "backend",
    "bbox_loss",
    "bbox_loss_maps",
    "ema_update",
    "head_decode",
    "ns_orthogonalize",
    "reference",
    "select_backend",
    "tal_assign",
    "tal_assign_maps",
]
