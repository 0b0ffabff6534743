"""Inference: ``Predictor`` (sources -> letterbox -> model -> NMS -> ``Results``), as ``YOLO.predict`` uses.

    from yolofast import YOLO
    results = YOLO("best.pt").predict("images/", conf=0.25, save=True)   # runs/detect/predict/
    results[0].boxes.xyxy, results[0].boxes.conf, results[0].boxes.cls
"""

from yolofast.predict.letterbox import letterbox_shape, scale_boxes
from yolofast.predict.predictor import Predictor
from yolofast.predict.results import Boxes, Results
from yolofast.predict.sources import iter_frames, resolve_paths

__all__ = ["Boxes", "Predictor", "Results", "iter_frames", "letterbox_shape", "resolve_paths", "scale_boxes"]
