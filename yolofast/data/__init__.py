"""YOLO-format data: data yaml checking, dataset + augmentation, loader/collate, synthetic "shapes" set.

Batch contract (collate_fn): img uint8 (B,3,H,W) RGB (training batches in channels-last memory: the
layout change is the trainer's preprocess_batch's, on the device); batch_idx (N,) float32; cls (N,1) float32;
bboxes (N,4) float32 normalized xywh; im_file list[str]; ori_shape list[(h,w)]; gt_cls (B,Mp,1),
gt_bboxes (B,Mp,4) normalized xywh, gt_mask (B,Mp,1) float32 with Mp = 16*ceil(max(n_per_image,1)/16);
plus resized_shape list[(h,w)] and ratio_pad list (val: ((r, r), (padw, padh)) w.r.t. ori_shape).
"""

from yolofast.data.augment import letterbox
from yolofast.data.collate import collate_fn, pad_targets
from yolofast.data.config import DataError, check_data
from yolofast.data.dataset import YOLODataset
from yolofast.data.labels import img2label_paths
from yolofast.data.loader import build_dataloader, build_dataset
from yolofast.data.shapes import SHAPE_NAMES, make_shapes

__all__ = [
    "DataError",
    "SHAPE_NAMES",
    "YOLODataset",
    "build_dataloader",
    "build_dataset",
    "check_data",
    "collate_fn",
    "img2label_paths",
    "letterbox",
    "make_shapes",
    "pad_targets",
]
