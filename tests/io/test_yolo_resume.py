"""YOLO("run/weights/last.pt").train(resume=True) continues that run; a finished run says how to go on."""

import copy

import pytest
import torch

from yolofast import YOLO, Trainer
from yolofast.cfg import CfgError
from yolofast.data import make_shapes
from yolofast.io import FORMAT
from yolofast.nn import YOLOV8

TINY = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
TINY.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)


def test_yolo_resume_continues_that_run(tmp_path):
    data = str(make_shapes(root=tmp_path / "s", n_train=4, n_val=2, imgsz=64))
    recipe = dict(model=TINY, data=data, epochs=2, imgsz=64, batch=2, workers=0, plots=False, verbose=False,
                  project=tmp_path / "runs")

    def crash(trainer):
        if trainer.epoch == 0:
            raise KeyboardInterrupt("stopped after epoch 1 was saved")

    t = Trainer(name="a", **recipe)
    t.add_callback("on_fit_epoch_end", crash)
    with pytest.raises(KeyboardInterrupt):
        t.train()
    last = t.last
    # what the trainer writes is data only: torch's own safe loader reads it (RNG, optimizer, metrics...)
    raw = torch.load(last, weights_only=True)
    assert raw["format"] == FORMAT and raw["epoch"] == 0 and isinstance(raw["model"], dict)
    assert {"rng", "optimizer", "scaler", "scheduler", "train_args", "model_cfg"} <= set(raw)
    Trainer(name="newer", **{**recipe, "epochs": 1}).train()  # the newest last.pt is not the one we resume

    y = YOLO(last)
    y.train(resume=True)
    assert y.trainer.save_dir == last.parent.parent and y.trainer.start_epoch == 1
    assert YOLO(last).ckpt["epoch"] == 1  # both epochs done, in the same run folder

    with pytest.raises(CfgError, match=r"finished all 2 epochs.*larger epochs=.*model="):
        YOLO(last).train(resume=True)
    y = YOLO(last)
    y.train(resume=True, epochs=3)  # extending a finished run
    assert y.trainer.start_epoch == 2 and YOLO(last).ckpt["epoch"] == 2
