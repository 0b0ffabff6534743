"""Detection metrics: prediction/GT matching, COCO 101-point AP, P/R at the best mean F1 (numpy).

Conventions follow pycocotools' COCOeval (bbox, area range 'all', no crowd boxes, maxDets >= the
detections per image) so mAP50 and mAP50-95 agree with it on the same predictions:
- IoU thresholds 0.50:0.05:0.95, a match needs IoU >= threshold and the same class;
- matching is greedy by *detection confidence*: detections of an image are taken in decreasing conf and
  each takes the unmatched GT of its class with the highest IoU, every GT matched at most once per
  threshold (Ultralytics instead matches greedily by IoU; the two differ when a lower-confidence
  detection overlaps a GT better than a higher-confidence one);
- AP per class and threshold = mean of the precision envelope sampled at the 101 recall points 0:0.01:1;
  classes without any GT are left out of the means.
P and R are reported the Ultralytics way: per-class curves over confidence (IoU 0.5), taken at the
confidence where the (smoothed) mean F1 over classes is largest.

``convention="ultralytics"`` reproduces Ultralytics 8.4's own numbers instead (its val prints them):
- matching by *IoU*: per threshold, every (detection, GT) pair of the same class with IoU >= t is a
  candidate; candidates are ranked by decreasing IoU and each detection keeps its best pair; then each GT
  keeps, of the pairs left, the one of the first detection in input order (decreasing confidence). A
  detection whose best GT went to another one is a false positive even when a second GT would fit it;
- AP = trapezoid integral over the 101 recall points of the precision envelope, with the curve extended
  to (recall 0, precision 1) and (recall 1, precision 0), instead of COCO's mean of the 101 samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

CONVENTIONS = ("coco", "ultralytics")
IOU_THRESHOLDS = np.linspace(0.5, 0.95, 10)  # same values as COCOeval's params.iouThrs
REC_THRESHOLDS = np.linspace(0.0, 1.0, 101)  # same values as COCOeval's params.recThrs
_trapezoid = getattr(np, "trapezoid", None) or np.trapz  # numpy < 2.0 has only the older name


def _numpy(x, dtype=np.float64):
    if hasattr(x, "detach"):  # torch tensor, without importing torch here
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype)


def box_iou_np(a, b) -> np.ndarray:
    """IoU matrix (n, m) of xyxy boxes (n, 4) and (m, 4) in float64, without an epsilon (as COCOeval)."""
    a, b = _numpy(a).reshape(-1, 4), _numpy(b).reshape(-1, 4)
    iw = np.minimum(a[:, None, 2], b[None, :, 2]) - np.maximum(a[:, None, 0], b[None, :, 0])
    ih = np.minimum(a[:, None, 3], b[None, :, 3]) - np.maximum(a[:, None, 1], b[None, :, 1])
    inter = iw.clip(0) * ih.clip(0)
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    union = area_a[:, None] + area_b[None, :] - inter
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(union > 0, inter / union, 0.0)


def check_convention(convention: str) -> str:
    if convention not in CONVENTIONS:
        raise ValueError(f"map_convention={convention!r}: use 'coco' (pycocotools' matching and AP, the "
                         "default) or 'ultralytics' (to reproduce an Ultralytics 8.4 val number)")
    return convention


def match_predictions(pred_boxes, pred_conf, pred_cls, gt_boxes, gt_cls, iouv=IOU_THRESHOLDS,
                      convention: str = "coco") -> np.ndarray:
    """True-positive flags (n, T) of one image's n detections at each IoU threshold in ``iouv``.

    pred_boxes (n, 4) and gt_boxes (m, 4) xyxy in the same units; pred_conf (n,); pred_cls (n,), gt_cls (m,)
    class ids. Accepts numpy arrays or torch tensors. Row order = the input order. convention: "coco"
    (greedy by confidence, as pycocotools) or "ultralytics" (greedy by IoU, see the module docstring).
    """
    return match_indices(pred_boxes, pred_conf, pred_cls, gt_boxes, gt_cls, iouv, convention) >= 0


def match_indices(pred_boxes, pred_conf, pred_cls, gt_boxes, gt_cls, iouv=IOU_THRESHOLDS,
                  convention: str = "coco") -> np.ndarray:
    """``match_predictions``' matching, as the index (n, T) of the GT each detection took, -1 for none."""
    if check_convention(convention) == "ultralytics":
        return _match_by_iou(pred_boxes, pred_cls, gt_boxes, gt_cls, iouv)
    iouv = _numpy(iouv).ravel()
    pred_cls, gt_cls = _numpy(pred_cls, np.int64).ravel(), _numpy(gt_cls, np.int64).ravel()
    n, m, t = len(pred_cls), len(gt_cls), len(iouv)
    gt_of = np.full((n, t), -1, dtype=np.int64)
    if n == 0 or m == 0:
        return gt_of
    iou = box_iou_np(pred_boxes, gt_boxes)
    iou[pred_cls[:, None] != gt_cls[None, :]] = -1.0  # other classes never match
    order = np.argsort(-_numpy(pred_conf).ravel(), kind="stable")  # stable like COCOeval's mergesort
    # Only detections reaching the loosest threshold with some GT can match; at conf 0.001 that is
    # usually a small fraction of the up to 300 detections, so the Python loop stays short.
    order = order[iou[order].max(1) >= iouv.min()]
    matched = np.zeros((t, m), dtype=bool)
    rows = np.arange(t)
    for d in order:
        ok = (iou[d][None, :] >= iouv[:, None]) & ~matched  # (T, m) GTs this detection may take
        g = np.where(ok, iou[d][None, :], -1.0).argmax(1)  # best unmatched GT per threshold
        hit = ok[rows, g]
        gt_of[d, hit] = g[hit]
        matched[rows[hit], g[hit]] = True
    return gt_of


def _match_by_iou(pred_boxes, pred_cls, gt_boxes, gt_cls, iouv) -> np.ndarray:
    iouv = _numpy(iouv).ravel()
    pred_cls, gt_cls = _numpy(pred_cls, np.int64).ravel(), _numpy(gt_cls, np.int64).ravel()
    gt_of = np.full((len(pred_cls), len(iouv)), -1, dtype=np.int64)
    if len(pred_cls) == 0 or len(gt_cls) == 0:
        return gt_of
    iou = box_iou_np(pred_boxes, gt_boxes)
    iou[pred_cls[:, None] != gt_cls[None, :]] = 0.0
    for j, t in enumerate(iouv):
        d, g = np.nonzero(iou >= t)
        if not len(d):
            continue
        order = np.argsort(-iou[d, g], kind="stable")
        d, g = d[order], g[order]
        first = np.unique(d, return_index=True)[1]  # np.unique's index is each value's first occurrence
        d, g = d[first], g[first]  # now in detection order (= decreasing conf), not IoU order
        first = np.unique(g, return_index=True)[1]
        gt_of[d[first], j] = g[first]
    return gt_of


def _smooth(y: np.ndarray, fraction: float = 0.1) -> np.ndarray:
    """Box filter over ``fraction`` of the points (101 of 1000), edges padded with the end values."""
    k = round(len(y) * fraction * 2) // 2 + 1
    yp = np.concatenate((np.full(k // 2, y[0]), y, np.full(k // 2, y[-1])))
    return np.convolve(yp, np.ones(k) / k, mode="valid")


def coco_ap(recall: np.ndarray, precision: np.ndarray) -> np.ndarray:
    """101-point interpolated AP from cumulative recall/precision (n, T) of conf-sorted detections -> (T,)."""
    recall, precision = np.atleast_2d(recall.T).T, np.atleast_2d(precision.T).T
    envelope = np.maximum.accumulate(precision[::-1], axis=0)[::-1]  # precision made non-increasing
    ap = np.zeros(recall.shape[1])
    for j in range(recall.shape[1]):
        idx = np.searchsorted(recall[:, j], REC_THRESHOLDS, side="left")
        valid = idx < len(recall)  # recall points never reached count as precision 0
        ap[j] = envelope[idx[valid], j].sum() / len(REC_THRESHOLDS)
    return ap


def ultralytics_ap(recall: np.ndarray, precision: np.ndarray) -> np.ndarray:
    """Ultralytics' AP from cumulative recall/precision (n, T): the envelope of the curve extended to
    (0, 1) and (1, 0), sampled at the 101 recall points and integrated with the trapezoid rule -> (T,)."""
    recall, precision = np.atleast_2d(recall.T).T, np.atleast_2d(precision.T).T
    ap = np.zeros(recall.shape[1])
    for j in range(recall.shape[1]):
        mrec = np.concatenate(([0.0], recall[:, j], [1.0]))
        mpre = np.concatenate(([1.0], precision[:, j], [0.0]))
        mpre = np.maximum.accumulate(mpre[::-1])[::-1]
        ap[j] = _trapezoid(np.interp(REC_THRESHOLDS, mrec, mpre), REC_THRESHOLDS)
    return ap


def pr_samples(recall: np.ndarray, precision: np.ndarray, convention: str = "coco") -> np.ndarray:
    """(101,) the precision the AP of ``convention`` integrates, sampled at ``REC_THRESHOLDS``, from one
    column of cumulative recall/precision (n,) of conf-sorted detections: what the PR curve plots.
    "coco": the envelope at the first detection reaching each recall point, 0 past the last one (its AP is
    the mean of the samples); "ultralytics": the extended envelope interpolated there (its AP is their
    trapezoid integral). ``pr_area`` turns the samples back into that AP."""
    recall, precision = np.asarray(recall, np.float64).ravel(), np.asarray(precision, np.float64).ravel()
    if check_convention(convention) == "ultralytics":
        mrec = np.concatenate(([0.0], recall, [1.0]))
        mpre = np.maximum.accumulate(np.concatenate(([1.0], precision, [0.0]))[::-1])[::-1]
        return np.interp(REC_THRESHOLDS, mrec, mpre)
    envelope = np.maximum.accumulate(precision[::-1])[::-1]
    idx = np.searchsorted(recall, REC_THRESHOLDS, side="left")
    valid = idx < len(recall)
    out = np.zeros(len(REC_THRESHOLDS))
    out[valid] = envelope[idx[valid]]
    return out


def pr_area(samples: np.ndarray, convention: str = "coco") -> np.ndarray:
    """AP from ``pr_samples`` (..., 101), integrated as ``convention`` integrates it."""
    samples = np.asarray(samples, np.float64)
    if check_convention(convention) == "ultralytics":
        return _trapezoid(samples, REC_THRESHOLDS, axis=-1)
    return samples.sum(-1) / len(REC_THRESHOLDS)


@dataclass
class APResult:
    """Per-class arrays (one entry per class present in the GT, in ``classes`` order) and their means."""

    classes: np.ndarray  # (k,) int class ids that have GT
    nt: np.ndarray  # (k,) number of GT per class
    p: np.ndarray  # (k,) precision at the best-mean-F1 confidence
    r: np.ndarray  # (k,) recall at the same confidence
    f1: np.ndarray  # (k,)
    all_ap: np.ndarray  # (k, T) AP at each IoU threshold
    conf_thr: float = 0.0  # the confidence where P, R, F1 are read
    iouv: np.ndarray = field(default_factory=lambda: IOU_THRESHOLDS.copy())
    # The curves behind the pictures (yolofast/val/plots.py), all at IoU 0.5; None when not computed.
    px: np.ndarray | None = None  # (1000,) confidence grid
    p_curve: np.ndarray | None = None  # (k, 1000) precision per class over px
    r_curve: np.ndarray | None = None  # (k, 1000) recall
    f1_curve: np.ndarray | None = None  # (k, 1000)
    pr_curve: np.ndarray | None = None  # (k, 101) precision at REC_THRESHOLDS (``pr_samples``)
    convention: str = "coco"

    def f1_mean(self) -> np.ndarray:
        """(1000,) the smoothed mean F1 over classes whose peak gives ``conf_thr``."""
        if self.f1_curve is None or not len(self.f1_curve):
            return np.zeros(0)
        return _smooth(self.f1_curve.mean(0))

    @property
    def ap50(self) -> np.ndarray:
        return self.all_ap[:, 0] if self.all_ap.size else np.zeros(0)

    @property
    def ap(self) -> np.ndarray:
        """AP50-95 per class."""
        return self.all_ap.mean(1) if self.all_ap.size else np.zeros(0)

    @staticmethod
    def _mean(x) -> float:
        return float(x.mean()) if len(x) else 0.0

    @property
    def mp(self) -> float:
        return self._mean(self.p)

    @property
    def mr(self) -> float:
        return self._mean(self.r)

    @property
    def map50(self) -> float:
        return self._mean(self.ap50)

    @property
    def map(self) -> float:
        return self._mean(self.ap)

    @property
    def fitness(self) -> float:
        return self.map

    def results_dict(self) -> dict:
        return {
            "metrics/precision(B)": self.mp,
            "metrics/recall(B)": self.mr,
            "metrics/mAP50(B)": self.map50,
            "metrics/mAP50-95(B)": self.map,
            "fitness": self.fitness,
        }


def ap_per_class(tp, conf, pred_cls, target_cls, eps: float = 1e-16, convention: str = "coco") -> APResult:
    """AP, P, R per class over a whole data set (AP integrated as ``convention`` says: "coco" or
    "ultralytics", see the module docstring).

    tp (n, T) bool: match flags of every detection (``match_predictions``), a 1-D array means T = 1;
    conf (n,), pred_cls (n,): the detections' confidence and class; target_cls (N,): class of every GT.
    Detections are ranked over all images by decreasing conf (stable, so ties keep the input order).
    """
    tp = np.asarray(tp, dtype=bool)
    tp = tp[:, None] if tp.ndim == 1 else tp
    conf, pred_cls = _numpy(conf).ravel(), _numpy(pred_cls, np.int64).ravel()
    target_cls = _numpy(target_cls, np.int64).ravel()
    if not len(tp) == len(conf) == len(pred_cls):
        raise ValueError(
            f"ap_per_class: tp, conf, pred_cls lengths differ: {len(tp)}, {len(conf)}, {len(pred_cls)}"
        )
    integrate = ultralytics_ap if check_convention(convention) == "ultralytics" else coco_ap
    order = np.argsort(-conf, kind="stable")
    tp, conf, pred_cls = tp[order], conf[order], pred_cls[order]

    classes, nt = np.unique(target_cls, return_counts=True)
    k, t = len(classes), tp.shape[1]
    px = np.linspace(0, 1, 1000)  # confidence grid of the P/R/F1 curves
    all_ap, p_curve, r_curve = np.zeros((k, t)), np.zeros((k, len(px))), np.zeros((k, len(px)))
    pr_curve = np.zeros((k, len(REC_THRESHOLDS)))
    for ci, c in enumerate(classes):
        sel = pred_cls == c
        if not sel.any():
            continue  # GT but no detections: AP, P and R stay 0
        tpc = tp[sel].cumsum(0)
        fpc = (~tp[sel]).cumsum(0)
        recall = tpc / nt[ci]
        precision = tpc / (tpc + fpc)
        all_ap[ci] = integrate(recall, precision)
        # Curves over the conf grid at IoU 0.5; conf is decreasing so -conf is the increasing xp np.interp
        # needs. Above the highest conf nothing is detected: recall 0, precision 1.
        r_curve[ci] = np.interp(-px, -conf[sel], recall[:, 0], left=0)
        p_curve[ci] = np.interp(-px, -conf[sel], precision[:, 0], left=1)
        pr_curve[ci] = pr_samples(recall[:, 0], precision[:, 0], convention)

    f1_curve = 2 * p_curve * r_curve / (p_curve + r_curve + eps)
    i = int(_smooth(f1_curve.mean(0)).argmax()) if k else 0
    return APResult(
        classes=classes,
        nt=nt,
        p=p_curve[:, i],
        r=r_curve[:, i],
        f1=f1_curve[:, i],
        all_ap=all_ap,
        conf_thr=float(px[i]),
        px=px,
        p_curve=p_curve,
        r_curve=r_curve,
        f1_curve=f1_curve,
        pr_curve=pr_curve,
        convention=convention,
    )
