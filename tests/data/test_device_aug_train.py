"""augment_device in a training run: the trainer renders the loader's plans in preprocess_batch."""

import copy

from yolofast.engine.trainer import Trainer
from yolofast.nn import YOLOV8


def test_train_with_augment_device_cpu(tmp_path):
    tiny = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
    tiny.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)
    t = Trainer(model=tiny, data="shapes", imgsz=64, batch=4, workers=0, verbose=False, plots=False, epochs=1,
                val=False, augment_device="cpu", project=tmp_path, fraction=16)
    t.train()
    assert t.train_loader.dataset.augment_device == "cpu"
    assert t.batch["img"].shape == (4, 3, 64, 64) and t.batch["img"].dtype.is_floating_point
    assert float(t.batch["img"].min()) >= 0 and float(t.batch["img"].max()) <= 1
