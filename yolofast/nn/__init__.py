"""YOLOv8, YOLO11 and YOLO26 detection models: blocks, heads and the one builder for all three families."""

from yolofast.nn.attention import C2PSA, Attention, PSABlock
from yolofast.nn.blocks import SPPF, Bottleneck, C2f, C3k, C3k2, Concat, Upsample
from yolofast.nn.conv import Conv, DWConv
from yolofast.nn.head import DFL, Detect
from yolofast.nn.model import YOLOV8, DetectionModel, build_model

__all__ = ["C2PSA", "DFL", "SPPF", "YOLOV8", "Attention", "Bottleneck", "C2f", "C3k", "C3k2", "Concat",
           "Conv", "DWConv", "Detect", "DetectionModel", "PSABlock", "Upsample", "build_model"]
