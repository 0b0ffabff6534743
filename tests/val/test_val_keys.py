"""Validation keys: save_json (COCO results JSON + pycocotools' evaluation) and rect batches."""

import json

import cv2
import numpy as np
import pytest
import torch
from torch import nn

from yolofast.val import validate

# (h, w) of the val images: wide and tall, so rect batches are not square
SIZES = [(48, 96), (96, 48), (64, 96), (96, 64), (48, 96), (96, 48)]
COLOURS = {0: (0, 0, 255), 1: (0, 255, 0)}  # BGR: class 0 red, class 1 green


class BlockFinder(nn.Module):
    """A stand-in detector: finds the pure red / green blocks of an image and reports the exact box and a copy
    shifted by 0.3 of its width (IoU 0.54); tall blocks get the shifted copy as the more confident one, so AP
    lies strictly between 0 and 1 and depends on every coordinate."""

    nc = 2
    SHIFTS = [0.0, 0.3]  # of the box width

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.zeros(1))
        self.register_buffer("stride", torch.tensor([8.0, 16.0, 32.0]))

    def forward_feats(self, img):
        return [img]

    def decode(self, feats):
        img = feats[0]
        out = torch.zeros(img.shape[0], 4 + self.nc, 2 * len(self.SHIFTS))
        for b in range(img.shape[0]):
            for c, ch in ((0, 0), (1, 1)):  # RGB: red block in channel 0, green in 1
                others = [k for k in range(3) if k != ch]
                mask = (img[b, ch] > 0.99) & (img[b, others].amax(0) < 0.01)
                if not mask.any():
                    continue
                ys, xs = torch.nonzero(mask, as_tuple=True)
                x1, y1, x2, y2 = xs.min(), ys.min(), xs.max() + 1, ys.max() + 1
                w, h = x2 - x1, y2 - y1
                for j, f in enumerate(self.SHIFTS):
                    a = c * len(self.SHIFTS) + j
                    out[b, :4, a] = torch.stack([(x1 + x2) / 2 + f * w, (y1 + y2) / 2, w, h]).float()
                    out[b, 4 + c, a] = (0.9 if f == 0 else 0.5) if w >= h else (0.5 if f == 0 else 0.9)
        return out


def make_coco_set(root, with_coco_json=True):
    """Images of SIZES with one block each (class i % 2), YOLO labels, and a COCO instances json."""
    (root / "images").mkdir(parents=True)
    (root / "labels").mkdir(parents=True)
    images, annos = [], []
    for i, (h, w) in enumerate(SIZES):
        c = i % 2
        img = np.full((h, w, 3), 114, np.uint8)
        x1, y1, x2, y2 = w // 4, h // 3, w // 4 + w // 3, h // 3 + h // 2
        img[y1:y2, x1:x2] = COLOURS[c]
        cv2.imwrite(str(root / "images" / f"{100 + i}.png"), img)
        (root / "labels" / f"{100 + i}.txt").write_text(
            f"{c} {(x1 + x2) / 2 / w} {(y1 + y2) / 2 / h} {(x2 - x1) / w} {(y2 - y1) / h}\n")
        images.append({"id": 100 + i, "file_name": f"{100 + i}.png", "height": h, "width": w})
        annos.append({"id": i + 1, "image_id": 100 + i, "category_id": 7 + 3 * c,  # ids that are not indices
                      "bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1), "iscrowd": 0})
    (root / "instances.json").write_text(json.dumps({
        "images": images, "annotations": annos,
        "categories": [{"id": 7, "name": "red"}, {"id": 10, "name": "green"}]}))
    extra = "coco_json: instances.json\n" if with_coco_json else ""
    (root / "data.yaml").write_text(f"path: {root}\ntrain: images\nval: images\nnames: [red, green]\n{extra}")
    return str(root / "data.yaml")


def test_save_json_writes_coco_results_in_original_pixels(tmp_path):
    data = make_coco_set(tmp_path / "d", with_coco_json=False)
    out = tmp_path / "pred.json"
    validate(BlockFinder(), data, imgsz=96, batch=2, verbose=False, save_json=str(out))
    recs = json.loads(out.read_text())
    assert set(recs[0]) == {"image_id", "category_id", "bbox", "score"}
    assert len(recs) == 2 * len(SIZES)  # both copies survive NMS (IoU 0.54 < 0.7)
    for i, (h, w) in enumerate(SIZES):
        x1, y1, bw, bh = w // 4, h // 3, w // 3, h // 2
        r = next(r for r in recs if r["image_id"] == 100 + i  # numeric file stems become int ids
                 and abs(r["bbox"][0] - x1) < 1)
        assert r["category_id"] == i % 2 + 1  # without annotations: class index + 1
        assert r["bbox"] == pytest.approx([x1, y1, bw, bh], abs=0.6)  # letterbox undone: original pixels


@pytest.mark.parametrize("rect", [False, True])
def test_pycocotools_evaluation_equals_our_coco_convention(tmp_path, rect):
    pytest.importorskip("pycocotools")
    data = make_coco_set(tmp_path / "d")
    ours = validate(BlockFinder(), data, imgsz=96, batch=2, verbose=False, rect=rect)
    theirs = validate(BlockFinder(), data, imgsz=96, batch=2, verbose=False, rect=rect,
                      save_json=str(tmp_path / "p.json"))
    assert 0.1 < ours["metrics/mAP50-95(B)"] < 0.95  # shifted copies make it neither 0 nor 1
    assert theirs["coco/mAP50-95"] == pytest.approx(ours["metrics/mAP50-95(B)"], abs=2e-3)
    assert theirs["coco/mAP50"] == pytest.approx(ours["metrics/mAP50(B)"], abs=2e-3)
    assert theirs["metrics/mAP50-95(B)"] == theirs["coco/mAP50-95"] == theirs["fitness"]  # as Ultralytics
    cats = {r["category_id"] for r in json.loads((tmp_path / "p.json").read_text())}
    assert cats == {7, 10}  # category ids by class name from the annotations


def test_rect_val_batches_follow_the_aspect_ratios(tmp_path, monkeypatch):
    """rect=True: wide images in wide batches, tall in tall ones (half a stride of padding, as Ultralytics
    validates); the boxes come back to the same places, so the metrics equal the square letterbox's."""
    data = make_coco_set(tmp_path / "d", with_coco_json=False)
    seen = []
    real = BlockFinder.forward_feats
    monkeypatch.setattr(BlockFinder, "forward_feats", lambda self, img: seen.append(tuple(img.shape[2:]))
                        or real(self, img))
    sq = validate(BlockFinder(), data, imgsz=96, batch=2, verbose=False)
    assert set(seen) == {(96, 96)}
    seen.clear()
    rect = validate(BlockFinder(), data, imgsz=96, batch=2, verbose=False, rect=True)
    # stride 32, pad 0.5: h/w 0.5 (2 images): ceil(48/32 + 0.5) * 32 = 64 x ceil(96/32 + 0.5) * 32 = 128;
    # 0.667 and 1.5 together: square 128; 2.0 (2 images): 128 x 64
    assert seen == [(64, 128), (128, 128), (128, 64)]
    assert rect["metrics/mAP50-95(B)"] == pytest.approx(sq["metrics/mAP50-95(B)"], abs=1e-6)
    ultra = validate(BlockFinder(), data, imgsz=96, batch=2, verbose=False, map_convention="ultralytics")
    assert seen[-3:] == [(64, 128), (128, 128), (128, 64)]  # the ultralytics convention validates in rect too
    assert ultra["metrics/mAP50(B)"] > 0
