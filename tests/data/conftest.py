import logging
from pathlib import Path

import cv2
import numpy as np
import pytest


@pytest.fixture
def ylog(caplog):
    """caplog attached to the "yolofast" logger itself (works even if someone turns propagation off)."""
    logger = logging.getLogger("yolofast")
    old = logger.level, logger.propagate
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # else the root logger's caplog handler records everything twice
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.setLevel(old[0])
    logger.propagate = old[1]


def write_image(path: Path, h=48, w=64, seed=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    img = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    assert cv2.imwrite(str(path), img)
    return path


def make_split(root: Path, items: dict, split="train"):
    """items: stem -> label text (None = no label file). Writes root/images/split/*.jpg + labels."""
    for i, (stem, text) in enumerate(items.items()):
        write_image(root / "images" / split / f"{stem}.jpg", seed=i)
        if text is not None:
            lb = root / "labels" / split / f"{stem}.txt"
            lb.parent.mkdir(parents=True, exist_ok=True)
            lb.write_text(text)
    return root / "images" / split


@pytest.fixture
def split_factory():
    """The make_split helper as a fixture (test modules should not import conftest)."""
    return make_split
