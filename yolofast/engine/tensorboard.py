"""TensorBoard: every run writes an event file into its own folder, so ``tensorboard --logdir runs`` shows
all runs side by side, as Ultralytics users expect.

Per batch (x axis: iterations since the run began): ``batch/<loss>`` of that batch, ``batch/lr_pg0..2``,
``batch/time_s`` (wall time from the previous batch's end, data wait included). Per epoch (x axis: epoch):
every numeric column of results.csv (``train/<loss>`` epoch means, metrics, validation losses, ``lr/pg0..2``,
``grad/norm_mean``, ``grad/norm_max``,
``grad/clip_frac``, ``grad/nonfinite``, memory) and ``time/epoch_s``. Once: ``train_batch0``, the run's first
training batch as a mosaic with its boxes (what the augmentation really fed the model). After the final
validation (``plots=True``): its pictures as images ``val/PR_curve``, ``val/F1_curve``, ``val/P_curve``,
``val/R_curve``, ``val/confusion_matrix`` and ``val/confusion_matrix_normalized`` (x axis: epoch).

Turning it off: ``YOLOFAST_TENSORBOARD=0``. An environment variable and not a recipe key because it is a
preference of the machine or the user (Ultralytics keeps it in ``yolo settings tensorboard=False``), not
part of the recipe: it stays out of args.yaml and checkpoints, and the recipe keys stay Ultralytics' own.
Without the ``tensorboard`` package (``pip install 'yolofast[tensorboard]'``) a run says so in one line
and goes on without an event file.
"""

from __future__ import annotations

import math
import os
import time

from yolofast.engine.callbacks import Callbacks
from yolofast.engine.distributed import is_main_process

__all__ = ["ENV", "TensorBoardLogger", "tensorboard_enabled"]

ENV = "YOLOFAST_TENSORBOARD"
_PICTURES = {"BoxPR_curve.png": "val/PR_curve", "BoxF1_curve.png": "val/F1_curve",
             "BoxP_curve.png": "val/P_curve", "BoxR_curve.png": "val/R_curve",
             "confusion_matrix.png": "val/confusion_matrix",
             "confusion_matrix_normalized.png": "val/confusion_matrix_normalized"}


def tensorboard_enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class TensorBoardLogger:
    def __init__(self, trainer):
        self.t = trainer
        self.writer = None
        self._batch0_done = False
        self._t_batch = self._t_epoch = None

    def register(self, cb: Callbacks) -> None:
        for event in ("on_pretrain_routine_end", "on_train_epoch_start", "on_train_batch_end",
                      "on_val_end", "on_fit_epoch_end", "teardown"):
            cb.add(event, getattr(self, event))

    def on_pretrain_routine_end(self, t) -> None:
        if not is_main_process() or not tensorboard_enabled():
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            t.log(f"TensorBoard: not installed, no event file written (pip install 'yolofast[tensorboard]'; "
                  f"{ENV}=0 hides this line)")
            return
        self.writer = SummaryWriter(log_dir=str(t.save_dir))
        t.log(f"TensorBoard: tensorboard --logdir {t.save_dir.parent}, then http://localhost:6006/ "
              f"({ENV}=0 turns it off)")

    def on_train_epoch_start(self, t) -> None:
        self._t_batch = self._t_epoch = time.perf_counter()

    def on_train_batch_end(self, t) -> None:
        w = self.writer
        if w is None:
            return
        step = t.batch_i + t.nb * t.epoch
        now = time.perf_counter()
        w.add_scalar("batch/time_s", now - self._t_batch, step)
        self._t_batch = now
        for name, v in zip(t.loss_names, t.loss_items.tolist()):
            w.add_scalar(f"batch/{name}", v, step)
        for j, g in enumerate(t.optimizer.param_groups):
            w.add_scalar(f"batch/lr_pg{j}", float(g["lr"]), step)
        if not self._batch0_done:
            from yolofast.engine.plots import batch_mosaic

            self._batch0_done = True
            w.add_image("train_batch0", batch_mosaic(t.batch), step, dataformats="HWC")

    def on_val_end(self, t) -> None:
        files = getattr(getattr(t, "validator", None), "plot_files", None)
        if self.writer is None or not files:
            return
        from yolofast.val.plots import safe_plot

        safe_plot("TensorBoard images", self._add_pictures, files, t.epoch + 1)

    def _add_pictures(self, files: dict, step: int) -> None:
        import numpy as np
        from PIL import Image  # matplotlib's own dependency

        for name, tag in _PICTURES.items():
            if name in files:
                img = np.asarray(Image.open(files[name]).convert("RGB"))
                self.writer.add_image(tag, img, step, dataformats="HWC")

    def on_fit_epoch_end(self, t) -> None:
        w = self.writer
        if w is None:
            return
        epoch = t.epoch + 1
        for k, v in t.state.results_row.items():
            if k not in ("epoch", "time") and isinstance(v, (int, float)) and math.isfinite(v):
                w.add_scalar(k, v, epoch)
        if self._t_epoch is not None:
            w.add_scalar("time/epoch_s", time.perf_counter() - self._t_epoch, epoch)
        w.flush()

    def teardown(self, t) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
