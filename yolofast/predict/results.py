"""``Results`` (one per image) and ``Boxes``: what Ultralytics' predict returns, same attribute names."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import torch

__all__ = ["Boxes", "Results"]


def _color(c: int) -> tuple[int, int, int]:
    """A distinct, stable BGR colour per class: hues spaced by the golden ratio (0.618) around the wheel."""
    hsv = np.uint8([[[int(c * 0.618034 * 180) % 180, 200, 230]]])
    return tuple(int(v) for v in cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR)[0, 0])


class Boxes:
    """Detections of one image: ``data`` (n, 6) = x1, y1, x2, y2, conf, cls in original-image pixels."""

    def __init__(self, data: torch.Tensor, orig_shape: tuple[int, int]):
        self.data, self.orig_shape = data, tuple(orig_shape)

    def __len__(self) -> int:
        return len(self.data)

    @property
    def xyxy(self) -> torch.Tensor:
        return self.data[:, :4]

    @property
    def conf(self) -> torch.Tensor:
        return self.data[:, 4]

    @property
    def cls(self) -> torch.Tensor:
        return self.data[:, 5]

    @property
    def id(self):
        return None  # tracking ids: yolofast does not track

    @property
    def xywh(self) -> torch.Tensor:
        b = self.xyxy
        return torch.stack(((b[:, 0] + b[:, 2]) / 2, (b[:, 1] + b[:, 3]) / 2, b[:, 2] - b[:, 0],
                            b[:, 3] - b[:, 1]), 1)

    def _norm(self) -> torch.Tensor:
        h, w = self.orig_shape
        return self.data.new_tensor([w, h, w, h])

    @property
    def xyxyn(self) -> torch.Tensor:
        return self.xyxy / self._norm()

    @property
    def xywhn(self) -> torch.Tensor:
        return self.xywh / self._norm()

    def cpu(self) -> Boxes:
        return Boxes(self.data.cpu(), self.orig_shape)

    def numpy(self) -> Boxes:
        return Boxes(self.data.cpu().numpy(), self.orig_shape)  # numpy arrays slice the same way

    def __repr__(self) -> str:
        return f"Boxes(n={len(self)}, orig_shape={self.orig_shape})"


class Results:
    """One image's prediction: ``orig_img`` (BGR HWC uint8), ``path``, ``names``, ``boxes``, ``speed``."""

    def __init__(self, orig_img: np.ndarray, path: str, names: dict, boxes: torch.Tensor, speed=None):
        self.orig_img, self.path, self.names = orig_img, str(path), dict(names)
        self.orig_shape = tuple(orig_img.shape[:2])
        self.boxes = Boxes(boxes, self.orig_shape)
        self.speed = dict(speed or {})

    def __len__(self) -> int:
        return len(self.boxes)

    def verbose(self) -> str:
        """'2 cats, 1 dog, ' style counts (Ultralytics' log line), or '(no detections), '."""
        if not len(self):
            return "(no detections), "
        cls, counts = self.boxes.cls.long().unique(return_counts=True)
        return "".join(f"{n} {self.names.get(int(c), int(c))}{'s' * (n > 1)}, "
                       for c, n in zip(cls.tolist(), counts.tolist()))

    def plot(self, conf: bool = True, labels: bool = True, line_width: int | None = None) -> np.ndarray:
        """A copy of the image with the boxes drawn (BGR HWC uint8); line width ~0.3 % of the image sides."""
        img = self.orig_img.copy()
        lw = line_width or max(round(sum(img.shape[:2]) / 2 * 0.003), 2)
        for x1, y1, x2, y2, c, k in self.boxes.data.tolist():
            color = _color(int(k))
            p1, p2 = (int(x1), int(y1)), (int(x2), int(y2))
            cv2.rectangle(img, p1, p2, color, lw, cv2.LINE_AA)
            if not labels:
                continue
            text = f"{self.names.get(int(k), int(k))}" + (f" {c:.2f}" if conf else "")
            scale, thick = lw / 3, max(lw - 1, 1)
            (tw, th), _ = cv2.getTextSize(text, 0, scale, thick)
            above = p1[1] - th - 3 >= 0
            q = (p1[0] + tw, p1[1] - th - 3 if above else p1[1] + th + 3)
            cv2.rectangle(img, p1, q, color, -1, cv2.LINE_AA)
            cv2.putText(img, text, (p1[0], p1[1] - 2 if above else p1[1] + th + 2), 0, scale,
                        (255, 255, 255), thick, cv2.LINE_AA)
        return img

    def save(self, filename: str | Path | None = None, **plot_args) -> str:
        """Write ``plot()`` to ``filename`` (default: results_<image name>); returns the path."""
        filename = str(filename or f"results_{Path(self.path).name}")
        Path(filename).parent.mkdir(parents=True, exist_ok=True)
        if not cv2.imwrite(filename, self.plot(**plot_args)):
            raise OSError(f"Results.save: could not write '{filename}' (is the extension an image format?)")
        return filename

    def save_txt(self, txt_file: str | Path, save_conf: bool = False) -> str:
        """YOLO label lines ``cls cx cy w h [conf]`` (normalized) appended to ``txt_file``."""
        lines = []
        for (cx, cy, w, h), c, k in zip(self.boxes.xywhn.tolist(), self.boxes.conf.tolist(),
                                        self.boxes.cls.tolist()):
            lines.append(f"{int(k)} {cx:.6g} {cy:.6g} {w:.6g} {h:.6g}" + (f" {c:.6g}" if save_conf else ""))
        Path(txt_file).parent.mkdir(parents=True, exist_ok=True)
        if lines:
            with open(txt_file, "a", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
        return str(txt_file)

    def summary(self, normalize: bool = False, decimals: int = 5) -> list[dict]:
        """One dict per detection: name, class, confidence, box {x1, y1, x2, y2} (pixels or normalized)."""
        boxes = self.boxes.xyxyn if normalize else self.boxes.xyxy
        out = []
        for b, c, k in zip(boxes.tolist(), self.boxes.conf.tolist(), self.boxes.cls.tolist()):
            out.append({"name": self.names.get(int(k), str(int(k))), "class": int(k),
                        "confidence": round(c, decimals),
                        "box": dict(zip(("x1", "y1", "x2", "y2"), (round(v, decimals) for v in b)))})
        return out

    def __repr__(self) -> str:
        return f"Results(path={self.path!r}, orig_shape={self.orig_shape}, boxes={len(self)})"
