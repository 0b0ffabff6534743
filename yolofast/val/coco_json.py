"""``save_json``: validation predictions as a COCO results JSON, and pycocotools' evaluation of it.

Each detection becomes ``{"image_id", "category_id", "bbox": [x, y, w, h], "score"}`` in original-image
pixels (the letterbox undone, clipped to the image). With COCO annotations (the data yaml's ``coco_json``),
image ids come from the annotations' ``file_name`` and category ids from the category whose name is the
class name; without them, the image id is the file stem (an int when it is one) and the category id is the
class index + 1 (COCO ids start at 1), as Ultralytics writes them for data that is not COCO.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

__all__ = ["CocoJson"]

LOGGER = logging.getLogger("yolofast")


class CocoJson:
    """Collects detections batch by batch (``add``), then ``save`` + ``evaluate``."""

    def __init__(self, names: dict, coco_json: str | None = None):
        self.names, self.coco_json = names, coco_json
        self.records: list[dict] = []
        self.seen_ids: set = set()
        self.image_ids, self.cat_ids = None, None
        if coco_json:
            with open(coco_json, encoding="utf-8") as f:
                anno = json.load(f)
            self.image_ids = {Path(im["file_name"]).name: im["id"] for im in anno.get("images", [])}
            by_name = {c["name"]: c["id"] for c in anno.get("categories", [])}
            missing = [n for n in names.values() if n not in by_name]
            if missing:
                raise ValueError(f"save_json: coco_json '{coco_json}' has no category named {missing[0]!r}; "
                                 f"its categories must carry the data's class names")
            self.cat_ids = {k: by_name[n] for k, n in names.items()}

    def _image_id(self, im_file: str):
        name = Path(im_file).name
        if self.image_ids is not None:
            if name not in self.image_ids:
                raise ValueError(f"save_json: image '{name}' is not in coco_json '{self.coco_json}'")
            return self.image_ids[name]
        stem = Path(im_file).stem
        return int(stem) if stem.isnumeric() else stem

    def add(self, det: torch.Tensor, im_file: str, ori_shape, ratio_pad) -> None:
        """det (n, 6) x1 y1 x2 y2 conf cls in letterboxed pixels; ratio_pad ((r, r), (padw, padh))."""
        (r, _), (pw, ph) = ratio_pad
        h0, w0 = ori_shape
        b = det[:, :4].double().cpu().clone()
        b[:, [0, 2]] = ((b[:, [0, 2]] - pw) / r).clamp(0, w0)
        b[:, [1, 3]] = ((b[:, [1, 3]] - ph) / r).clamp(0, h0)
        image_id = self._image_id(im_file)
        self.seen_ids.add(image_id)
        for (x1, y1, x2, y2), score, c in zip(b.tolist(), det[:, 4].tolist(), det[:, 5].long().tolist()):
            cat = self.cat_ids[c] if self.cat_ids is not None else c + 1
            self.records.append({"image_id": image_id, "category_id": cat,
                                 "bbox": [round(x1, 3), round(y1, 3), round(x2 - x1, 3), round(y2 - y1, 3)],
                                 "score": round(score, 5)})

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.records, f)
        LOGGER.info(f"Saving {path} ({len(self.records)} predictions)")
        return path

    def evaluate(self, pred_json: str | Path) -> dict:
        """pycocotools' COCOeval (bbox) of ``pred_json`` against ``coco_json``: its 12 stats, the first two
        being mAP50-95 and mAP50. Empty when there are no annotations or no predictions."""
        if not self.coco_json or not self.records:  # (loadRes refuses an empty list)
            return {}
        try:
            from pycocotools.coco import COCO
            from pycocotools.cocoeval import COCOeval
        except ImportError as e:
            raise ImportError("save_json with coco_json needs pycocotools: pip install pycocotools") from e
        gt = COCO(self.coco_json)
        dt = gt.loadRes(str(pred_json))
        ev = COCOeval(gt, dt, "bbox")
        ev.params.imgIds = sorted(self.seen_ids)  # the validated images only (the json may hold more)
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
        return {"coco/mAP50-95": float(ev.stats[0]), "coco/mAP50": float(ev.stats[1]),
                "coco/stats": [float(x) for x in ev.stats]}
