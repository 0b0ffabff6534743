"""YOLOv8 detection model: blocks, DFL head and the n/s/m/l/x builder."""

from yolofast.nn.blocks import SPPF, Bottleneck, C2f, Concat, Conv, Upsample
from yolofast.nn.head import DFL, Detect
from yolofast.nn.model import YOLOV8, DetectionModel, build_model

__all__ = ["DFL", "SPPF", "YOLOV8", "Bottleneck", "C2f", "Concat", "Conv", "Detect", "DetectionModel",
           "Upsample", "build_model"]
