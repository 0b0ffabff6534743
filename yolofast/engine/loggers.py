"""What a run shows and leaves behind, kept out of the loop: the progress bar, ``results.csv`` (and its
repair on resume), ``results.png``, the ``profile=True`` split and TensorBoard (``tensorboard.py``).

Each is driven by the trainer's callback events. They sit in ``trainer.loggers``, which ``run_callbacks``
fires before the user's callbacks, so a user's ``on_fit_epoch_end`` already finds this epoch's row in
results.csv (and ``set_callback`` cannot remove them by accident). Only rank 0 writes anything.

What they read from the trainer: ``loss_names`` (header and ``train/<name>`` columns), ``tloss`` (epoch mean
of the loss items), ``loss_items`` (this batch's), ``batch``/``batch_i``, ``grad_norm`` (``gradnorm.py``),
``prof`` (``profiler.py``), ``metrics``, ``lr``, ``train_time``, ``epoch``/``epochs``/``nb``.
"""

from __future__ import annotations

import csv
import math
import time

import torch
from tqdm import tqdm

from yolofast.engine.autobatch import MEMORY_COLUMNS, cpu_rss_gb, memory_usage
from yolofast.engine.callbacks import Callbacks
from yolofast.engine.distributed import is_main_process
from yolofast.engine.gradnorm import GRAD_COLUMNS
from yolofast.engine.profiler import format_split

__all__ = ["LOSS_NAMES", "METRIC_COLUMNS", "RESULTS_COLUMNS", "RunLog", "default_loggers", "metric_columns",
           "results_columns"]

LOSS_NAMES = ("box_loss", "cls_loss", "dfl_loss")  # the criterion's ``names`` replace these (YOLO26: l1_loss)
_MAP_COLUMNS = ("metrics/precision(B)", "metrics/recall(B)", "metrics/mAP50(B)", "metrics/mAP50-95(B)")
_REFRESH_S = 0.5  # progress-line refresh: each one reads the gradient norm sums from the device once


def metric_columns(loss_names=LOSS_NAMES) -> tuple[str, ...]:
    """The validation columns: precision, recall, mAP50, mAP50-95, then ``val/<name>`` of the first three loss
    items (``val/dfl_loss`` for YOLOv8/YOLO11, ``val/l1_loss`` for YOLO26, as Ultralytics names them)."""
    return (*_MAP_COLUMNS, *(f"val/{n}" for n in loss_names[:3]))


METRIC_COLUMNS = metric_columns()


def results_columns(loss_names=LOSS_NAMES) -> tuple[str, ...]:
    """Ultralytics' columns first (tools that read its runs keep working), then any loss beyond its three
    (``train/dis_loss`` with a teacher), memory and gradient norm."""
    return ("epoch", "time", *(f"train/{n}" for n in loss_names[:3]), *metric_columns(loss_names),
            "lr/pg0", "lr/pg1", "lr/pg2", *(f"train/{n}" for n in loss_names[3:]),
            *MEMORY_COLUMNS, *GRAD_COLUMNS)


RESULTS_COLUMNS = results_columns()


def _memory_gb(device: torch.device) -> float:
    """For the progress bar: CUDA memory reserved now, or this process's resident set size."""
    return torch.cuda.memory_reserved(device) / 1e9 if device.type == "cuda" else cpu_rss_gb()


def _fmt(v):
    return f"{v:.6g}" if isinstance(v, float) else v


class RunLog:
    """Progress bar, results.csv, results.png and the per-epoch summary lines of one trainer."""

    def __init__(self, trainer):
        self.t = trainer
        self.pbar = None
        self._shown = 0.0

    def register(self, cb: Callbacks) -> None:
        for event in ("on_pretrain_routine_end", "on_train_epoch_start", "on_train_batch_end",
                      "on_train_epoch_end", "on_fit_epoch_end", "on_train_end", "teardown"):
            cb.add(event, getattr(self, event))

    @property
    def columns(self) -> tuple[str, ...]:
        return results_columns(self.t.loss_names)

    @property
    def _verbose(self) -> bool:
        return bool(self.t.args.verbose) and is_main_process()

    # -- results.csv
    def write_row(self, row: dict) -> None:
        csv_file = self.t.csv
        new = not csv_file.exists()
        with open(csv_file, "a", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerow({k: _fmt(v) for k, v in row.items()})

    def on_pretrain_routine_end(self, t) -> None:
        """A resumed run drops the rows of epochs its checkpoint does not hold (a crash after the csv write)
        and rewrites the rest under this version's columns."""
        if t.start_epoch == 0 or not is_main_process() or not t.csv.exists():
            return
        with open(t.csv, newline="", encoding="utf-8") as f:
            rows = [r for r in csv.DictReader(f) if int(float(r["epoch"])) <= t.start_epoch]
        t.csv.unlink()
        for r in rows:
            self.write_row(r)

    def on_fit_epoch_end(self, t) -> None:
        if not is_main_process():
            return
        n = len(t.loss_names)
        tl = t.tloss.tolist() if t.tloss is not None else [math.nan] * n
        row = {"epoch": t.epoch + 1, "time": round(t.train_time, 3)}
        row.update({f"train/{k}": v for k, v in zip(t.loss_names, tl)})
        row.update({k: t.metrics.get(k, math.nan) for k in metric_columns(t.loss_names)})
        row.update({f"lr/pg{j}": t.lr.get(f"lr/pg{j}", math.nan) for j in range(3)})
        row.update(memory_usage(t.device))
        row.update(t.grad_norm.read())
        self.write_row(row)
        t.state.results_row = row  # for the loggers after this one (TensorBoard)
        if not self._verbose:
            return
        if t.metrics and (t.args.val or t.epoch + 1 == t.epochs):
            t.log(f"{'':>22}mAP50 {t.metrics.get('metrics/mAP50(B)', 0):.4f}  mAP50-95 "
                  f"{t.metrics.get('metrics/mAP50-95(B)', 0):.4f}")
        t.log(f"{'':>22}grad norm mean {row['grad/norm_mean']:.3g}  max {row['grad/norm_max']:.3g}  clipped "
              f"{100 * row['grad/clip_frac']:.0f}% of steps  non-finite {row['grad/nonfinite']}")
        if t.prof.enabled:
            t.prof.mark("other")  # callbacks, results.csv, checkpoints since validation
            t.log(f"{'':>22}profile: {format_split(t.prof.split())}")

    def on_train_end(self, t) -> None:
        if t.args.plots and is_main_process() and t.csv.exists():
            from yolofast.engine.plots import plot_results

            plot_results(t.csv)

    # -- progress bar
    def on_train_epoch_start(self, t) -> None:
        t.grad_norm.reset()
        if not self._verbose:
            return
        mem = "GPU_mem" if t.device.type == "cuda" else "CPU_mem"
        names = ("Epoch", mem, *t.loss_names, "Instances", "Size", "lr", "grad_norm")
        tqdm.write(("\n" + "%11s" * len(names)) % names)
        self.pbar = tqdm(total=t.nb, bar_format="{l_bar}{bar:10}{r_bar}")
        self._shown = 0.0

    def on_train_batch_end(self, t) -> None:
        if self.pbar is None:
            return
        i = t.batch_i
        self.pbar.total = t.nb  # an out-of-memory halving renumbers the epoch's batches
        now = time.monotonic()
        if now - self._shown >= _REFRESH_S or i + 1 >= t.nb:
            self._shown = now
            self.pbar.set_description(self._line(t), refresh=False)
        self.pbar.update(i + 1 - self.pbar.n)

    def _line(self, t) -> str:
        lr = t.optimizer.param_groups[1]["lr"]
        gn = t.grad_norm.read()["grad/norm_mean"]
        # "-" until the epoch's first optimizer step: with gradient accumulation (nbs 64 / batch 16 = 4
        # batches a step) an epoch's first batches have no norm yet, and "nan" there read as a broken run.
        gn = f"{gn:11.3g}" if math.isfinite(gn) else f"{'-':>11}"
        n = len(t.loss_names)
        return ("%11s" * 2 + "%11.4g" * n + "%11i" * 2 + "%11.3g" + "%s") % (
            f"{t.epoch + 1}/{t.epochs}", f"{_memory_gb(t.device):.3g}G", *t.tloss.tolist(),
            t.batch["cls"].shape[0], t.batch["img"].shape[-1], float(lr), gn)

    def on_train_epoch_end(self, t) -> None:
        if self.pbar is not None:
            self.pbar.close()
            self.pbar = None

    teardown = on_train_epoch_end  # an epoch ended by an exception leaves no bar open


def default_loggers(trainer) -> Callbacks:
    """The built-in loggers of a trainer, in the order they run."""
    from yolofast.engine.plots import PlotLogger
    from yolofast.engine.tensorboard import TensorBoardLogger

    cb = Callbacks()
    RunLog(trainer).register(cb)
    PlotLogger(trainer).register(cb)  # plots=True: labels.jpg, train_batch*.jpg, the final validation's
    TensorBoardLogger(trainer).register(cb)
    return cb
