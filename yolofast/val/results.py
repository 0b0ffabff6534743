"""``DetMetrics``: what ``validate`` / ``YOLO.val`` return, a dict with Ultralytics' metric attributes.

It is the dict of ``Validator`` (``metrics/mAP50-95(B)`` ... keys, unchanged) and adds ``.box.map``,
``.box.map50``, ``.box.map75``, ``.box.maps``, ``.box.mp``, ``.box.mr`` (and ``.box.p/.r/.ap50/.ap``
per class), ``.results_dict``, ``.fitness`` and ``.speed`` (ms per image), the names Ultralytics' code reads.
"""

from __future__ import annotations

import numpy as np

from yolofast.val.metrics import APResult

__all__ = ["BoxMetrics", "DetMetrics"]


class BoxMetrics:
    """Box metrics of one validation: means over the classes that have GT, per-class arrays."""

    def __init__(self, result: APResult, nc: int):
        self._r, self.nc = result, nc
        self.p, self.r, self.ap50, self.ap = result.p, result.r, result.ap50, result.ap
        self.all_ap, self.ap_class_index = result.all_ap, result.classes

    @property
    def map(self) -> float:
        return self._r.map

    @property
    def map50(self) -> float:
        return self._r.map50

    @property
    def map75(self) -> float:
        return float(self.all_ap[:, 5].mean()) if self.all_ap.size else 0.0  # IoU 0.75 = 6th threshold

    @property
    def mp(self) -> float:
        return self._r.mp

    @property
    def mr(self) -> float:
        return self._r.mr

    @property
    def maps(self) -> np.ndarray:
        """(nc,) mAP50-95 per class id; classes without GT get the mean, as in Ultralytics."""
        out = np.full(self.nc, self.map)
        out[self.ap_class_index.astype(int)] = self.ap
        return out

    def mean_results(self) -> list[float]:
        return [self.mp, self.mr, self.map50, self.map]


class DetMetrics(dict):
    def __init__(self, values: dict, result: APResult, nc: int, speed: dict | None = None):
        super().__init__(values)
        self.box = BoxMetrics(result, nc)
        self.speed = dict(speed or {})

    @property
    def results_dict(self) -> dict:
        """The five Ultralytics keys: precision, recall, mAP50, mAP50-95 (all ``(B)``) and fitness."""
        keys = ("metrics/precision(B)", "metrics/recall(B)", "metrics/mAP50(B)", "metrics/mAP50-95(B)",
                "fitness")
        return {k: float(self[k]) for k in keys if k in self}

    @property
    def fitness(self) -> float:
        return float(self.get("fitness", self.box.map))

    @property
    def maps(self) -> np.ndarray:
        return self.box.maps

    def __repr__(self) -> str:
        return f"DetMetrics({dict.__repr__(self)}, speed={self.speed})"
