"""Validation: class-aware NMS, COCO-style metrics (agree with pycocotools) and the Validator loop."""

from yolofast.val.metrics import APResult, ap_per_class, box_iou_np, coco_ap, match_predictions
from yolofast.val.nms import non_max_suppression
from yolofast.val.results import BoxMetrics, DetMetrics
from yolofast.val.validator import Validator, load_model, validate

__all__ = [
    "APResult",
    "BoxMetrics",
    "DetMetrics",
    "Validator",
    "ap_per_class",
    "box_iou_np",
    "coco_ap",
    "load_model",
    "match_predictions",
    "non_max_suppression",
    "validate",
]
