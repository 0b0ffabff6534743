"""Class-aware non-maximum suppression of decoded YOLO predictions, and the NMS-free path's filter."""

from __future__ import annotations

import torch
import torchvision

from yolofast.boxes import xywh2xyxy


def non_max_suppression(
    pred,
    conf: float = 0.001,
    iou: float = 0.7,
    max_det: int = 300,
    max_nms: int = 30000,
    max_wh: int = 7680,
    multi_label: bool = False,
    classes=None,
    agnostic: bool = False,
):
    """NMS per image and per class.

    pred: (B, 4 + nc, A) decoded head output -- (cx, cy, w, h) in pixels, then nc class scores in [0, 1]
    (a tuple/list whose first element is that tensor is accepted too).
    A candidate is an (anchor, class) pair with score > ``conf``: only the best class of each anchor, or
    every class above ``conf`` when ``multi_label``; ``classes`` (ids) keeps only those classes (before NMS);
    ``agnostic`` suppresses across classes. At most ``max_nms`` candidates (highest scores) enter
    NMS, at most ``max_det`` survivors are kept.
    Returns a list of B tensors (n, 6) ``[x1, y1, x2, y2, conf, cls]`` sorted by decreasing conf, in pred's
    dtype and device.
    """
    if isinstance(pred, (list, tuple)):
        pred = pred[0]
    if not torch.is_tensor(pred) or pred.dim() != 3 or pred.shape[1] < 5:
        shape = tuple(pred.shape) if torch.is_tensor(pred) else type(pred).__name__
        raise ValueError(f"non_max_suppression: pred must be a (B, 4+nc, A) tensor with nc >= 1, got {shape}")
    if not 0.0 <= conf <= 1.0 or not 0.0 <= iou <= 1.0:
        raise ValueError(f"non_max_suppression: conf={conf} and iou={iou} must both lie in [0, 1]")

    x_all = pred.transpose(1, 2)  # (B, A, 4+nc), a view
    candidates = pred[:, 4:].amax(1) > conf  # (B, A): anchors with at least one class above conf
    out = []
    for b in range(pred.shape[0]):
        x = x_all[b][candidates[b]]
        if x.shape[0] == 0:
            out.append(pred.new_zeros((0, 6)))
            continue
        boxes, scores = xywh2xyxy(x[:, :4]), x[:, 4:]
        if multi_label:
            i, j = (scores > conf).nonzero(as_tuple=True)
            det = torch.cat((boxes[i], scores[i, j, None], j[:, None].to(x.dtype)), 1)
        else:
            best, j = scores.max(1, keepdim=True)  # every row passes: its max is above conf by construction
            det = torch.cat((boxes, best, j.to(x.dtype)), 1)
        if classes is not None:
            det = det[(det[:, 5:6] == det.new_tensor(list(classes)).view(1, -1)).any(1)]
        if det.shape[0] > max_nms:
            det = det[det[:, 4].topk(max_nms).indices]
        # Offset trick: shifting each class by cls * max_wh (7680 px > any image side) puts classes in
        # disjoint regions, so one class-agnostic NMS call is class-aware. Done in fp32 because
        # 79 * 7680 = 606,720 overflows fp16 (max 65,504).
        shifted = det[:, :4].float() + det[:, 5:6].float() * (0 if agnostic else max_wh)
        keep = torchvision.ops.nms(shifted, det[:, 4].float(), iou)[:max_det]  # sorted by decreasing score
        out.append(det[keep])
    return out


def topk_filter(dets, conf: float = 0.25, max_det: int = 300, classes=None):
    """The NMS-free (``nms=False``) path after the head's top-k: (B, k, 6) sorted rows -> a list of B
    (n, 6) tensors holding the rows with score > ``conf`` (strict), only ``classes`` when given, then the
    first ``max_det`` (the same list ``non_max_suppression`` returns)."""
    out = []
    for d in dets:
        keep = d[:, 4] > conf
        if classes is not None:
            keep &= (d[:, 5:6] == d.new_tensor(list(classes)).view(1, -1)).any(1)
        out.append(d[keep][:max_det])
    return out
