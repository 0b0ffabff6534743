"""HSV augmentation of one 640x640 image: the one-pass C++ kernel vs OpenCV's three passes (1 thread).

    PYTHONPATH=. python benchmarks/bench_hsv.py [--size 640] [--rounds 20]

Alternating rounds of 10 calls each, the best round per path (ms per image) and the ratio; the image is a
coco128 picture resized to the size (random pixels when the data is not there), the gains the default
recipe's draw.
"""

import argparse
import time
from pathlib import Path

import cv2
import numpy as np
import torch

from yolofast.data import augment as A


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=640)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    src = Path(__file__).resolve().parents[1] / "../shared/data/coco128/images/train2017/000000000009.jpg"
    img = cv2.imread(str(src)) if src.is_file() else None
    if img is None:
        img = np.random.default_rng(0).integers(0, 256, (args.size, args.size, 3), dtype=np.uint8)
    img = cv2.resize(img, (args.size, args.size))
    lut = A.hsv_luts(A.hsv_gains(np.random.default_rng(0), 0.015, 0.7, 0.4))
    paths = {"opencv": A.hsv_apply_opencv}
    if A.hsv_backend() == "cpp":
        paths["kernel"] = A.hsv_apply_compiled
        assert np.array_equal(A.hsv_apply_compiled(img, lut, True), A.hsv_apply_opencv(img, lut, True))
    best = {k: float("inf") for k in paths}
    for r in range(args.rounds):
        for name in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
            t = time.process_time()
            for _ in range(10):
                paths[name](img, lut, True)
            best[name] = min(best[name], (time.process_time() - t) / 10 * 1e3)
    print(f"HSV augmentation, {args.size}x{args.size}, 1 thread, best of {args.rounds} rounds, ms per image:")
    for name, ms in best.items():
        print(f"  {name:<7} {ms:.3f}")
    if "kernel" in best:
        print(f"  kernel is {best['opencv'] / best['kernel']:.2f}x faster, the same bytes")
    else:
        print("  (no compiled kernel here: `yolofast info` says why)")


if __name__ == "__main__":
    main()
