"""Validation loop: model -> NMS -> matching -> P, R, mAP50, mAP50-95 (+ the validation loss)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from yolofast.boxes import xywh2xyxy
from yolofast.io.build import load_checkpoint
from yolofast.io.paths import increment_path
from yolofast.val.coco_json import CocoJson
from yolofast.val.metrics import IOU_THRESHOLDS, APResult, ap_per_class, check_convention, match_predictions
from yolofast.val.nms import non_max_suppression, topk_filter
from yolofast.val.results import DetMetrics

LOSS_KEYS = ("val/box_loss", "val/cls_loss", "val/dfl_loss")


def as_device(device) -> torch.device:
    """'cpu', 'cuda', 'cuda:1', torch.device, or Ultralytics-style '0' / '0,1' (first GPU used)."""
    if isinstance(device, torch.device):
        return device
    if device is None or device == "":
        return torch.device("cpu")
    s = str(device).strip().lower()
    if s.replace(",", "").isdigit():
        s = f"cuda:{s.split(',')[0]}"
    return torch.device(s)


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


class Validator:
    """Runs a detection model over a data loader and computes COCO-style metrics.

    dataloader yields batches of the ``yolofast.data`` format (``img`` uint8 (B,3,H,W), ``batch_idx``,
    ``cls``, ``bboxes`` normalized xywh of the letterboxed image, ...); names: dict class id -> name.
    loss: optional ``DetectionLoss``-like callable ``loss(feats, batch) -> (total, items (3,))``; its items
    are averaged over batches. half: run the model under autocast (fp16 on CUDA, bf16 on CPU) without
    changing its weights. The model must already be on ``device``. map_convention: "coco" (pycocotools'
    matching and AP, the default) or "ultralytics" (Ultralytics 8.4's, to reproduce its numbers; its NMS
    also keeps every class above ``conf`` per box; give it a loader over a rect data set, ``rect=True``
    with ``pad=0.5``, to validate in Ultralytics' aspect-ratio batches; a square loader gets the half-stride
    grey border of those batches instead), see ``yolofast.val.metrics``.
    save_json: a path: write the predictions there as COCO results JSON (``coco_json.py``); with
    ``coco_json`` (COCO annotations of these images) pycocotools evaluates it, and its mAP50-95 / mAP50
    replace the metrics (as Ultralytics does), with all 12 COCO stats under ``coco/stats``.
    ``validator(model)`` returns the dict of common.md; the last result is also kept in ``self.result``.
    plot_dir: a folder: write the pictures there (confusion matrices, PR/F1/P/R curves, val_batch images;
    ``yolofast/val/plots.py``); their paths are kept in ``self.plot_files``. None (default): no pictures.
    """

    def __init__(
        self,
        dataloader,
        names,
        conf: float = 0.001,
        iou: float = 0.7,
        max_det: int = 300,
        loss=None,
        device="cpu",
        half: bool = False,
        verbose: bool = False,
        progress: bool = True,
        map_convention: str = "coco",
        save_json=None,
        coco_json: str | None = None,
        plot_dir=None,
        nms: bool | None = None,
    ):
        self.dataloader = dataloader
        self.plot_dir, self.plot_files = plot_dir, {}
        self.nms = nms  # False: an end2end (YOLO26) model's one-to-one top-k instead of NMS
        self.save_json, self.coco_json = save_json, coco_json
        self.names = dict(enumerate(names)) if isinstance(names, (list, tuple)) else dict(names)
        self.conf = 0.001 if conf is None else conf  # None: Ultralytics' val default
        self.iou, self.max_det = iou, max_det
        self.loss = loss
        self.device = as_device(device)
        self.half = half
        self.verbose = verbose
        self.progress = progress
        self.map_convention = check_convention(map_convention)
        self.result: APResult | None = None
        self.seen = 0
        self.speed: dict[str, float] = {}  # ms per image of the last run, per stage

    def _autocast(self):
        if not self.half:
            return contextlib.nullcontext()
        dtype = torch.float16 if self.device.type == "cuda" else torch.bfloat16
        return torch.autocast(self.device.type, dtype=dtype)

    def _check_model_device(self, model):
        p = next(model.parameters(), None)
        if p is not None and not _same_device(p.device, self.device):
            raise ValueError(
                f"Validator(device='{self.device}') but the model's parameters are on {p.device}: "
                f"move the model with model.to('{self.device}') or pass device='{p.device}'"
            )

    def __call__(self, model) -> dict:
        self._check_model_device(model)
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode():
                return self._run(model)
        finally:
            model.train(was_training)

    def _run(self, model) -> dict:
        stats = {"tp": [], "conf": [], "pred_cls": [], "target_cls": []}
        loss_sum = torch.zeros(3, device=self.device)
        n_batches, self.seen = 0, 0
        self.speed = {"preprocess": 0.0, "inference": 0.0, "loss": 0.0, "postprocess": 0.0}  # s, then ms/img
        clock = time.perf_counter
        self.images_per_class: dict[int, int] = {}
        jdict = CocoJson(self.names, self.coco_json) if self.save_json else None
        plots = self._plots_start()
        bar = tqdm(
            self.dataloader,
            desc=f"{'':>22}{'Images':>11}{'Instances':>11}{'P':>11}{'R':>11}{'mAP50':>11}{'mAP50-95':>11}",
            disable=not self.progress,
            bar_format="{l_bar}{bar:10}{r_bar}",
        )
        for batch in bar:
            n_batches += 1
            t0 = clock()
            img = batch["img"].to(self.device, non_blocking=True).float() / 255
            border = self._border(model)
            if border:
                img = torch.nn.functional.pad(img, (border,) * 4, value=114 / 255)
            t1 = clock()
            e2e = bool(getattr(model, "end2end", False))  # YOLO26: one-to-one branches beside one-to-many
            nms_free = self.nms is False and e2e
            with self._autocast():
                both = e2e and (nms_free or self.loss is not None)
                feats, o2o = model.forward_heads(img) if both else (model.forward_feats(img), None)
            feats = [f.float() for f in feats]  # loss and box decoding in fp32 (pixel coords up to 640+)
            t2 = clock()
            if self.loss is not None:  # an end2end criterion takes both branches' maps
                preds = {"one2many": feats, "one2one": [f.float() for f in o2o]} if e2e else feats
                items = self.loss(preds, self._targets_to_device(batch))[1]
                loss_sum += items.detach().float().to(self.device)
            t3 = clock()
            if nms_free:
                dets = topk_filter(model.decode_one2one(o2o, self.max_det), self.conf, self.max_det)
            else:
                dets = non_max_suppression(model.decode(feats), self.conf, self.iou, self.max_det,
                                           multi_label=self.map_convention == "ultralytics")
            h, w = img.shape[2] - 2 * border, img.shape[3] - 2 * border
            for d, rp, ori in zip(dets, batch.get("ratio_pad") or [None] * len(dets), batch["ori_shape"]):
                if self.map_convention == "ultralytics":  # clipped to the image, as Ultralytics clips
                    x0, y0, x1, y1 = _content(rp, ori, w, h)
                    d[:, [0, 2]] = (d[:, [0, 2]] - border).clamp(x0, x1)
                    d[:, [1, 3]] = (d[:, [1, 3]] - border).clamp(y0, y1)
            if jdict is not None:
                for d, f, ori, rp in zip(dets, batch["im_file"], batch["ori_shape"], batch["ratio_pad"]):
                    jdict.add(d, f, ori, rp)  # (ultralytics: the border is already taken off above)
            self._update_stats(stats, dets, batch, h, w)
            if plots is not None:
                plots.add_batch(n_batches - 1, batch, dets, h, w)
            for k, dt in zip(self.speed, (t1 - t0, t2 - t1, t3 - t2, clock() - t3)):
                self.speed[k] += dt
        bar.close()
        self.speed = {k: 1000 * v / max(self.seen, 1) for k, v in self.speed.items()}

        if stats["tp"]:
            cat = {k: np.concatenate(v, 0) for k, v in stats.items()}
        else:
            cat = {"tp": np.zeros((0, len(IOU_THRESHOLDS)), bool), "conf": [], "pred_cls": []}
            cat["target_cls"] = []
        self.result = ap_per_class(cat["tp"], cat["conf"], cat["pred_cls"], cat["target_cls"],
                                   convention=self.map_convention)
        if plots is not None:
            self.plot_files = plots.finish(self.result)
        out = self.result.results_dict()
        if jdict is not None:
            out.update(self._coco_eval(jdict))
        if self.loss is not None:
            items = (loss_sum / max(n_batches, 1)).cpu().tolist()
            names = getattr(self.loss, "names", None)  # the criterion's (YOLO26: box, cls, l1_loss)
            out.update(dict(zip((f"val/{n}" for n in names) if names else LOSS_KEYS, items)))
        if self.verbose:
            self.print_results()
        return out

    def _plots_start(self):
        """The picture collector of this run (``val/plots.py``), or None without ``plot_dir``."""
        self.plot_files = {}
        if self.plot_dir is None:
            return None
        from yolofast.val.plots import ValPlots

        return ValPlots(self.plot_dir, self.names, conf=self.conf, convention=self.map_convention)

    def _coco_eval(self, jdict) -> dict:
        path = jdict.save(self.save_json)
        coco = jdict.evaluate(path)
        if coco:  # pycocotools' own numbers replace ours, as Ultralytics does with COCO annotations
            coco["metrics/mAP50-95(B)"], coco["metrics/mAP50(B)"] = coco["coco/mAP50-95"], coco["coco/mAP50"]
            coco["fitness"] = coco["coco/mAP50-95"]
        return coco

    def _border(self, model) -> int:
        """Ultralytics validates in rect batches padded by half a stride (its pad=0.5): a 224 x 224 image at
        imgsz 224 runs at 256 x 256, which changes its detections (on rect3 mAP50-95 0.171 -> 0.184 with
        the same matching). A rect data set (``YOLODataset(rect=True, pad=0.5)``) already has those batch
        shapes; for a square loader the grey border of half the largest stride gives the same input for
        square images."""
        if self.map_convention != "ultralytics" or getattr(getattr(self.dataloader, "dataset", None), "rect",
                                                           False):
            return 0
        stride = getattr(model, "stride", None)
        return int(stride.max().item() if torch.is_tensor(stride) else (max(stride) if stride else 32)) // 2

    def _targets_to_device(self, batch) -> dict:
        # The loss reads the targets on the feats' device; "img" is not needed again, so it is not copied.
        return {k: v.to(self.device) if torch.is_tensor(v) and k != "img" else v for k, v in batch.items()}

    def _update_stats(self, stats, dets, batch, h, w):
        scale = torch.tensor([w, h, w, h], dtype=torch.float32)
        batch_idx = batch["batch_idx"].view(-1).cpu()
        gt_cls_all = batch["cls"].view(-1).cpu()
        gt_box_all = xywh2xyxy(batch["bboxes"].view(-1, 4).cpu().float() * scale)
        for si, det in enumerate(dets):
            self.seen += 1
            keep = batch_idx == si
            gt_cls, gt_box = gt_cls_all[keep], gt_box_all[keep]
            det = det.detach().float().cpu()
            tp = match_predictions(det[:, :4], det[:, 4], det[:, 5], gt_box, gt_cls,
                                   convention=self.map_convention)
            stats["tp"].append(tp)
            stats["conf"].append(det[:, 4].numpy())
            stats["pred_cls"].append(det[:, 5].numpy())
            stats["target_cls"].append(gt_cls.numpy())
            for c in gt_cls.unique().long().tolist():
                self.images_per_class[c] = self.images_per_class.get(c, 0) + 1

    def print_results(self):
        """One line for all classes, then one per class with GT: images holding it, instances, P, R, mAP50,
        mAP50-95 (Ultralytics' table layout)."""
        r = self.result
        if r is None:
            return
        fmt = "%22s" + "%11i" * 2 + "%11.3g" * 4
        print(fmt % ("all", self.seen, int(r.nt.sum()), r.mp, r.mr, r.map50, r.map))
        if r.nt.sum() == 0:
            print("WARNING: no labels found in the validation set, metrics cannot be computed")
        for i, c in enumerate(r.classes):
            name = self.names.get(int(c), str(int(c)))
            n_img = self.images_per_class.get(int(c), 0)
            print(fmt % (name, n_img, r.nt[i], r.p[i], r.r[i], r.ap50[i], r.ap[i]))


def _content(ratio_pad, ori_shape, w: int, h: int):
    """(x0, y0, x1, y1): the original image's area inside the letterboxed one (the whole image without
    ratio_pad)."""
    if ratio_pad is None:
        return 0, 0, w, h
    (r, _), (pw, ph) = ratio_pad
    return pw, ph, min(pw + ori_shape[1] * r, w), min(ph + ori_shape[0] * r, h)


def load_model(weights_or_model) -> nn.Module:
    """nn.Module, a checkpoint dict with an "ema" or "model" module, or a path to such a checkpoint."""
    obj = weights_or_model
    if isinstance(obj, (str, Path)):
        path = Path(obj)
        if not path.is_file():
            raise FileNotFoundError(f"validate: weights file '{path}' not found")
        obj = load_checkpoint(path)  # yolofast's or Ultralytics' files, read without running pickle code
        loaded = True
    else:
        loaded = False
    if isinstance(obj, dict):
        picked = next((obj[k] for k in ("ema", "model") if obj.get(k) is not None), None)
        if picked is None:
            raise ValueError(
                f"validate: checkpoint has no 'ema' or 'model' entry holding a model (keys: {sorted(obj)})"
            )
        obj = picked
    if not isinstance(obj, nn.Module) and isinstance(getattr(obj, "ema", None), nn.Module):
        obj = obj.ema  # a pickled ModelEMA
    if not isinstance(obj, nn.Module):
        raise TypeError(
            f"validate: expected an nn.Module, a checkpoint dict or a path, got {type(obj).__name__} "
            "(a bare state_dict cannot be validated: build the model with yolofast.nn.build_model, "
            "load the state_dict into it and pass the model)"
        )
    return obj.float() if loaded else obj  # EMA weights may be stored in fp16


def validate(
    weights_or_model,
    data,
    imgsz: int = 640,
    batch: int = 16,
    conf: float = 0.001,
    iou: float = 0.7,
    max_det: int = 300,
    device="cpu",
    workers: int = 0,
    half: bool = False,
    verbose: bool = True,
    map_convention: str = "coco",
    rect: bool = False,
    save_json: bool | str = False,
    single_cls: bool = False,
    quantize=None,
    plots: bool = False,
    nms: bool | None = None,
) -> DetMetrics:
    """Validate a model or checkpoint on the ``val`` split of a data yaml (``yolofast val``).

    Returns a ``DetMetrics``: the Validator's dict plus ``.box.map`` and the other Ultralytics attributes.
    map_convention: "coco" (pycocotools' matching and AP) or "ultralytics" (reproduces Ultralytics 8.4; its
    aspect-ratio batches with half a stride of padding, as ``rect=True`` gives with either convention).
    save_json: True (``runs/detect/val*/predictions.json``) or a path: COCO results JSON, evaluated by
    pycocotools when the data yaml has ``coco_json``. single_cls: every label is class 0 (a one-class model).
    quantize: 16 / "fp16" runs under autocast (as ``half=True``), 32 / "fp32" in fp32.
    plots: write the pictures (``yolofast/val/plots.py``) beside ``save_json``'s file, else into
    ``runs/detect/val*`` (``yolofast val`` does by default).
    nms: None (default) NMS on the one-to-many head; False: a YOLO26 model's one-to-one top-k, no NMS.
    max_det: left at 300, it is raised to the largest number of labels in one image when that is larger.
    """
    from yolofast.cfg import quantize_half

    half = quantize_half(quantize, half)
    from yolofast.data import build_dataloader, build_dataset, check_data

    model = load_model(weights_or_model)
    dev = as_device(device)
    model.to(dev)
    info = check_data(data)
    label_nc = info["nc"]
    if single_cls:
        info = {**info, "nc": 1, "names": {0: "item"}}
    _check_classes(model, info, data)
    stride = int(max(getattr(model, "stride", torch.tensor([32.0])).max().item(), 32))
    rect = rect or map_convention == "ultralytics"
    dataset = build_dataset(info["val"], imgsz=imgsz, augment=False, stride=stride, prefix="val: ",
                            nc=label_nc, single_cls=single_cls, rect=rect, batch_size=batch, pad=0.5)
    max_det = raise_max_det(max_det, dataset.labels)
    if save_json is True:
        save_json = increment_path(Path("runs/detect/val")) / "predictions.json"
    loader = build_dataloader(dataset, batch, workers, shuffle=False)
    validator = Validator(
        loader,
        info["names"],
        conf=conf,
        iou=iou,
        max_det=max_det,
        device=dev,
        half=half,
        verbose=verbose,
        progress=verbose,
        map_convention=map_convention,
        save_json=save_json or None,
        coco_json=info.get("coco_json"),
        plot_dir=_plot_dir(save_json) if plots else None,
        nms=nms,
    )
    values = validator(model)
    if validator.plot_files and verbose:
        print(f"Plots saved to {validator.plot_dir}")
    return DetMetrics(values, validator.result, int(info["nc"]), validator.speed)


def _check_classes(model, info: dict, data) -> None:
    model_nc = getattr(model, "nc", None)
    if model_nc is not None and int(model_nc) != int(info["nc"]):
        raise ValueError(
            f"validate: the model predicts {model_nc} classes but data '{data}' has nc={info['nc']}; "
            "validate with the data set the model was trained on"
        )


def _plot_dir(save_json) -> Path:
    """validate(plots=True): beside the predictions JSON, or a new runs/detect/val* folder."""
    if save_json:
        return Path(save_json).parent
    return increment_path(Path("runs/detect/val"))


def raise_max_det(max_det: int, *label_lists) -> int:
    """``max_det`` at its default 300 is raised to the largest label count of one image (a warning says
    so), as Ultralytics 8.4 does, so that crowded images can reach full recall; other values are kept."""
    most = max((len(lb["cls"]) for labels in label_lists for lb in labels), default=0)
    if max_det == 300 and most > max_det:
        import logging

        logging.getLogger("yolofast").warning(f"max_det=300 but an image has {most} labels; using "
                                              f"max_det={most}")
        return most
    return max_det
