"""The training loop (DESIGN §4): ``Trainer(model="yolov8n", data="coco128.yaml", epochs=100).train()``.

Every recipe key is one of ``yolofast.cfg.DEFAULTS`` (Ultralytics' names and defaults); ``train()`` returns
the final metrics dict (``metrics/mAP50-95(B)``, ``fitness``, ...) and writes ``project/name/`` with
``weights/last.pt``, ``weights/best.pt``, ``results.csv``, ``results.png`` and ``args.yaml``.

Reading order: ``train`` -> ``_setup_train`` (each part built by a function of ``setup.py`` that returns
it) -> ``_do_train`` (THE loop: ``_start_epoch``, ``_train_epoch``, ``_end_epoch``) -> ``train_batch``
(one step: forward, loss, backward, optimizer) -> ``validate`` / ``save_model``. The run's state is
``self.state`` (``RunState``: epoch, best fitness, losses, counters), what setup built ``self.parts``
(``TrainParts``) and the schedule ``self.schedule`` (``schedule.py``: batches per epoch, warmup,
accumulation, lr factor); ``trainer.epoch``, ``trainer.model``, ... read them (state.py). Elsewhere:
what a run shows and writes (``loggers.py``), checkpoints and resume (``resume.py``), data loaders
(``loader.py``), device and precision (``device.py``), recovery (``recovery.py``), the CUDA-graph step
(``cudagraph.py``), AutoBatch (``autobatch.py``).

Extending
---------
Callbacks: ``trainer.add_callback("on_fit_epoch_end", fn)``; ``fn(trainer)`` sees ``trainer.epoch``,
``trainer.tloss``, ``trainer.metrics``, ``trainer.model``, ... (events: ``yolofast.engine.callbacks``).

Subclassing: override any of these hooks and pass the class to ``YOLO(...).train(trainer=MyTrainer)``
or instantiate it directly:

* ``get_model(cfg, weights=None)``  -> nn.Module (train mode returns the raw maps; needs ``nc``, ``stride``,
  ``reg_max``, ``forward_feats`` and ``decode`` for validation);
* ``get_dataloader(img_path, batch_size, mode="train"|"val")`` -> an iterable of batches (yolofast format);
* ``get_loss(model)`` -> ``loss(feats, batch) -> (total, items[box, cls, dfl])``, e.g. another cls loss
  (more items: append their names to ``trainer.loss_names``, which names the progress and CSV columns);
* ``get_validator()`` -> ``validator(model) -> dict`` with ``fitness`` (e.g. a different metric).

    class FocalTrainer(Trainer):
        def get_loss(self, model):
            return MyFocalLoss(model.nc)

    YOLO("yolov8n").train(data="shapes", epochs=10, trainer=FocalTrainer)
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from yolofast.cfg import get_cfg
from yolofast.engine import doctor_setup, loader, optim, resume, setup
from yolofast.engine.callbacks import Callbacks, ValBatchEvents
from yolofast.engine.compile import train_step_modules
from yolofast.engine.device import cpu_has_native_bf16, init_seeds, select_device, setup_amp
from yolofast.engine.distributed import (
    PeerFailedError,
    barrier,
    broadcast_flag,
    destroy_distributed,
    get_rank,
    get_world_size,
    init_distributed,
    is_main_process,
    is_peer_failure,
    rank0_broadcast,
)
from yolofast.engine.freeze import freeze_bn
from yolofast.engine.gradnorm import GradNormStats
from yolofast.engine.loggers import LOSS_NAMES, RESULTS_COLUMNS, default_loggers, metric_columns
from yolofast.engine.profiler import make_profiler
from yolofast.engine.recovery import NonFiniteGuard, OutOfMemoryHalving, is_out_of_memory
from yolofast.engine.schedule import Schedule
from yolofast.engine.state import RunState, RunViews, TrainParts
from yolofast.engine.validate_args import recipe_overrides, training_data, validate_args
from yolofast.io.paths import increment_path
from yolofast.loss import fp32_preds

# select_device, init_seeds, cpu_has_native_bf16: yolofast/engine/device.py (re-exported here)
__all__ = ["Trainer", "RESULTS_COLUMNS", "cpu_has_native_bf16", "select_device", "increment_path",
           "init_seeds"]


class Trainer(RunViews):
    """Trains a YOLOv8-style detector. ``Trainer(overrides=None, **recipe)``; see the module docstring.

    ``model``: "yolov8n" (any scale), a model yaml/dict, a yolofast checkpoint path (its weights are the
    start) or an ``nn.Module``; ``data``: a data yaml, a dict or "shapes". Unknown keys and bad data fail
    here, before anything is built. ``resume=True`` (latest last.pt under ``project``) or
    ``resume="path/last.pt"`` continues that run with its own recipe.
    """

    # Ultralytics' clip of the total gradient norm. The loss is x batch, so on the quick-start run every
    # step's norm is 80-1000 and every step is clipped (as in Ultralytics); a subclass may set another.
    max_norm: float = 10.0

    def __init__(self, overrides: dict | None = None, _callbacks: Callbacks | None = None, **kwargs):
        overrides, self._model_obj = recipe_overrides({**(overrides or {}), **kwargs})  # validate_args.py
        self.args = get_cfg(**overrides)
        self.callbacks = _callbacks or Callbacks()

        self.resume_ckpt = None
        elastic_dir = None if self.args.resume else resume.elastic_restart(self.args)  # sets args.resume
        if self.args.resume:  # the run's own recipe, its last.pt and the checkpoint (resume.py)
            self.args, self.resume_ckpt, self._resume_state = resume.load_resume_args(self.args, overrides)
        self.device = select_device(self.args.device)
        self.rank, self.world_size = get_rank(), get_world_size()

        validate_args(self.args, self._model_obj)  # imgsz, model: before any data or model is made
        self.data = training_data(self.args, self.world_size)  # + split, rect, batch (validate_args.py)
        if self.resume_ckpt is not None:
            self.save_dir = Path(self.resume_ckpt).parent.parent
        elif elastic_dir is not None:  # restarted before epoch 1 was saved: start over in the same folder
            self.save_dir = elastic_dir
        else:
            self.save_dir = increment_path(Path(self.args.project) / (self.args.name or "train"),
                                           self.args.exist_ok)
        self.args.name = self.save_dir.name

        self.state = RunState()  # epoch, best fitness, losses, counters (state.py)
        self.parts = TrainParts()  # model, loaders, loss, optimizer, EMA, ...: built by _setup_train
        self.schedule: Schedule | None = None  # nb, warmup, accumulate, lr factor: made by _setup_train
        self.loss_names = list(LOSS_NAMES)  # the loss items: progress header, results.csv, TensorBoard
        self.grad_norm = GradNormStats(self.max_norm)  # pre-clip norm of every optimizer step (gradnorm.py)
        self.prof = make_profiler(self.args.profile, self.device)  # profile=True: the epoch's time split
        self.loggers = default_loggers(self)  # progress bar, results.csv/png, TensorBoard (loggers.py)

    # ------------------------------------------------------------------ public API
    def add_callback(self, event: str, fn) -> None:
        """Append ``fn(trainer)`` to ``event`` (an unknown event name is a ValueError)."""
        self.callbacks.add(event, fn)

    def set_callback(self, event: str, fn) -> None:
        self.callbacks.set(event, [fn])

    def run_callbacks(self, event: str) -> None:
        self.loggers.run(event, self)  # first: a user's callback finds this epoch's row in results.csv
        self.callbacks.run(event, self)

    def train(self) -> dict:
        """Run the whole training; returns the final metrics (of best.pt when it was written)."""
        self.run_callbacks("on_pretrain_routine_start")
        self._setup_train()
        self.run_callbacks("on_pretrain_routine_end")
        try:
            self._do_train()
            # Ranks end together, and a rank that finished first waits with the GIL released until the
            # others are done: a gloo worker thread may still have to free the last collective's tensors,
            # which aborts the process once Python is shutting down (distributed.barrier).
            barrier()
        except RuntimeError as e:  # another rank died mid-collective: its error is the one that matters
            if self.world_size > 1 and is_peer_failure(e):
                raise PeerFailedError(f"rank {self.rank} stopped in epoch {self.epoch + 1}: another rank "
                                      f"ended during a collective; its own error is printed above") from e
            raise
        finally:
            self.run_callbacks("teardown")
            setup.epoch_threads(self, restore=True)  # the caller's thread count again
            destroy_distributed()
        return self.metrics

    def doctor(self, **kw):
        """Trace one batch, overfit it, check each loss branch's gradients: ``yolofast.doctor.run`` on parts
        built by this trainer's own hooks (engine/doctor_setup.py); returns the Report."""
        return doctor_setup.diagnose(self, **kw)

    # ------------------------------------------------------------------ hooks for subclasses
    def get_model(self, cfg=None, weights=None) -> nn.Module:
        """The model to train: an nn.Module as given, a yolofast checkpoint's weights, or a fresh build;
        then ``weights``, the DFL's frozen bins and ``freeze`` (setup.recipe_model)."""
        model, self.frozen = setup.recipe_model(self, cfg, weights)
        return model

    def get_dataloader(self, img_path, batch_size: int = 16, mode: str = "train"):
        """A data loader over ``img_path``: augmented and shuffled for "train", plain for "val"."""
        return loader.build_loader(self, img_path, batch_size, mode)  # engine/loader.py

    def get_loss(self, model: nn.Module):
        """``loss(feats, batch) -> (total, items)`` with the recipe's box/cls/dfl gains: DetectionLoss, or for
        an end2end model (YOLO26) E2EDetectionLoss, whose branch weights follow the schedule's epoch."""
        return setup.recipe_loss(self, model)  # engine/setup.py

    def get_validator(self):
        """``validator(model) -> metrics dict`` over the ``split`` data, with the validation loss."""
        return setup.recipe_validator(self)  # engine/setup.py

    # ------------------------------------------------------------------ setup
    def log(self, msg: str) -> None:
        if self.args.verbose and is_main_process():
            tqdm.write(msg)

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _setup_train(self) -> None:
        """Build the run, each part by a function of engine/setup.py that returns it, kept in
        ``self.parts``. The order is the hooks': get_dataloader reads the model's stride, get_loss the
        train labels (cls_pw), get_validator the loss."""
        a = self.args
        self.device = init_distributed(self.device)  # cuda:LOCAL_RANK under torchrun
        init_seeds(a.seed + 1 + max(self.rank, 0), a.deterministic)
        setup.write_run_dir(self)
        p = self.parts = TrainParts()
        p.model = setup.build_model(self, self._model_source(), nhwc=setup.channels_last(a, self.device))
        p.stride = setup.model_stride(p.model)
        p.amp_dtype, p.scaler = setup_amp(a.amp, self.device)  # bf16/fp16/fp32 (device.py)
        p.channels_last = setup.channels_last(a, self.device)
        p.batch_size = setup.rank_batch(a, self.world_size)
        p.train_loader = self.get_dataloader(self.data["train"], p.batch_size, mode="train")
        p.criterion, p.step_model, step_loss, extra = setup.build_loss(self, p.model)
        self.loss_names[:3] = getattr(p.criterion, "names", self.loss_names[:3])  # YOLO26: ..., l1_loss
        # After the names a subclass appended before train() (its loss items); once, should setup run again.
        self.loss_names += [n for n in extra if n not in self.loss_names]
        # DDP wrap, loss x world size, torch.compile (model + whole loss): yolofast/engine/compile.py
        p.train_model, p.train_loss = train_step_modules(p.step_model, step_loss, self.device, a.compile,
                                                         self.world_size)
        b = setup.auto_batch(self, p.step_model, step_loss, p.train_loader)
        if b is not None:
            self.rebuild_train_loader(b, epoch=0)
        a.batch = p.batch_size * self.world_size  # the resolved total, as checkpoints and resume see it
        p.val_loader = self.get_dataloader(self.data[a.split], p.batch_size * 2, mode="val")
        p.validator = self.get_validator()
        self._setup_step()

    def _setup_step(self) -> None:
        """EMA, schedule, optimizer, lr scheduler, the CUDA-graph step and recovery; then a resumed run's
        state (resume.py)."""
        from yolofast.engine.ema import ModelEMA

        a, p = self.args, self.parts
        p.ema = ModelEMA(p.model)
        p.nonfinite, p.oom = NonFiniteGuard(self), OutOfMemoryHalving(self)
        self.schedule = Schedule(a, nb=len(p.train_loader))
        why = setup.step_blockers(self, self.schedule.accumulate, p.scaler)
        resumed_auto = self._resume_state.get("optimizer_auto") if self.resume_ckpt is not None else None
        p.optimizer, p.optimizer_auto, momentum, bias_lr = setup.build_optimizer(
            self, p.step_model, len(p.train_loader.dataset), self.schedule.accumulate, graphed=why == [],
            resumed_auto=resumed_auto)
        self.schedule.start_warmup(momentum, bias_lr)
        p.scheduler = self.schedule.lr_scheduler(p.optimizer)
        p.graph = setup.build_graph(self, why, p)  # captured after the warmup (cudagraph.py)
        if self.resume_ckpt is not None:
            self.state = resume.restore(self, self._resume_state)  # model, EMA, optimizer, ..., RNG
            del self._resume_state
        self.schedule.loss_epoch(p.criterion, self.state.start_epoch)  # the loss weights' epoch
        resume.check_ranks_agree(self)

    def _model_source(self):
        """What get_model builds from: a resumed run's own model, the given nn.Module, or ``args.model``."""
        if self.resume_ckpt is not None:  # the run's own architecture; resume.restore loads its state
            return self._resume_state["model"]
        return self._model_obj if self._model_obj is not None else self.args.model

    # ------------------------------------------------------------------ THE loop
    def _do_train(self) -> None:
        """DESIGN §4, in order. Per epoch: ``_start_epoch`` (train mode, sampler epoch, close_mosaic), the
        batches (``_train_epoch``: warmup, then ``train_batch``), the scheduler, ``_end_epoch``
        (validation of the EMA, best fitness, early stopping, checkpoints, results.csv)."""
        a, s = self.args, self.state
        s.last_opt_step = s.start_epoch * self.schedule.nb - 1
        t_start = time.time() - s.train_time
        self.run_callbacks("on_train_start")
        self.log(f"Image sizes {a.imgsz} train, {a.imgsz} val; {a.workers} dataloader workers; logging "
                 f"results to {self.save_dir}\nStarting training for {self.epochs} epochs...")
        self.optimizer.zero_grad(set_to_none=True)
        epoch = s.start_epoch
        for epoch in range(s.start_epoch, self.epochs):
            s.epoch = epoch
            self._start_epoch(epoch)
            self._train_epoch(epoch, t_start)
            # Right after the epoch's last batch, before the epoch-end callbacks and validation: the loss
            # weights of the next epoch (YOLO26's end-to-end criterion; no-op for the v8 loss).
            self.schedule.loss_epoch(self.criterion, epoch + 1)
            s.lr = {f"lr/pg{j}": float(g["lr"]) for j, g in enumerate(self.optimizer.param_groups)}
            self.run_callbacks("on_train_epoch_end")
            self.scheduler.step()
            self.run_callbacks("on_params_update")
            self._end_epoch(epoch, t_start)
            if s.stop:
                break
        s.epoch = epoch
        best = resume.validate_best(self)  # the returned metrics are best.pt's
        if best is not None:
            s.metrics, s.fitness = best
        self.run_callbacks("on_train_end")  # results.png (loggers.py)
        hours = (time.time() - t_start) / 3600
        self.log(f"\n{epoch - s.start_epoch + 1} epochs completed in {hours:.3f} hours "
                 f"({hours * 60:.1f} min).\nResults saved to {self.save_dir.resolve()}"
                 f"\n  weights: {self.best.resolve()}\n  metrics: {self.csv.resolve()}")

    def _start_epoch(self, epoch: int) -> None:
        self.model.train()
        freeze_bn(self.model, self.parts.frozen)  # frozen layers keep their BatchNorm statistics
        sampler = getattr(self.train_loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        if len(self.train_loader) != self.schedule.nb:  # the first whole epoch after an out-of-memory halving
            self.schedule.nb = len(self.train_loader)
        if self.args.close_mosaic and epoch == self.epochs - self.args.close_mosaic:
            self.log("Closing dataloader mosaic")
            loader.close_mosaic(self.train_loader)
        setup.epoch_threads(self)  # a shared CPU: the free cores, each epoch
        self.run_callbacks("on_train_epoch_start")
        self.parts.nonfinite.snapshot()  # the last good state a run of non-finite losses falls back to
        self.state.tloss = None
        self.prof.reset()

    def _train_epoch(self, epoch: int, t_start: float) -> None:
        """The epoch's batches: warmup values, preprocess, the step, the running mean of the loss items
        and the time limit. An out of memory halves the batch and goes on from the failed batch's images."""
        a, s, sched = self.args, self.state, self.schedule
        for i, batch, images_done in loader.epoch_batches(self):  # goes on across an OOM halving
            s.batch_i = i
            self.run_callbacks("on_train_batch_start")
            ni = i + sched.nb * epoch  # iterations since the run began
            sched.warmup(ni, epoch, self.optimizer)  # lr, momentum, accumulate while ni <= nw
            s.batch = batch = self.preprocess_batch(batch)
            self.prof.mark("data")
            try:
                items = self.train_batch(batch, epoch, i, ni)
            except RuntimeError as e:  # out of memory: half the batch; this batch's images come next
                if not is_out_of_memory(e):
                    raise
                i = self.parts.oom.halve(e, epoch, i, images_done)  # recovery.py
                s.last_opt_step = i + sched.nb * epoch - 1  # the next step counts from the halving
                continue
            if items is None:  # non-finite loss: the step was skipped (recovery.py)
                continue
            s.loss_items = items = items.detach().float().cpu()
            s.tloss = items if s.tloss is None else (s.tloss * i + items) / (i + 1)
            self.run_callbacks("on_train_batch_end")
            self.prof.mark("other")
            if a.time and broadcast_flag(time.time() - t_start > a.time * 3600):  # ranks stop together
                s.stop = True
                self.log(f"Time limit of {a.time} h reached in epoch {epoch + 1}; stopping")
                break

    def _end_epoch(self, epoch: int, t_start: float) -> None:
        """Validation (every epoch with val=True, and the last), best fitness, early stopping by patience,
        checkpoints and the on_fit_epoch_end callbacks (results.csv: loggers.py)."""
        a, s = self.args, self.state
        if a.val or epoch + 1 == self.epochs or s.stop:  # s.stop here: the time limit
            self.prof.mark("other")
            s.metrics, s.fitness = rank0_broadcast(self.validate)  # rank 0 validates
            self.prof.mark("val")
            if s.best_fitness is None or s.fitness > s.best_fitness:
                s.best_fitness, s.best_epoch = s.fitness, epoch
            if a.patience and epoch - s.best_epoch >= a.patience:
                s.stop = True
                self.log(f"Stopping early: no improvement in the last {a.patience} epochs; best was "
                         f"epoch {s.best_epoch + 1} (fitness {s.best_fitness:.4f})")
        final = epoch + 1 == self.epochs or s.stop
        s.train_time = time.time() - t_start
        if a.save or final:
            self.save_model()
            self.run_callbacks("on_model_save")
        self.run_callbacks("on_fit_epoch_end")  # results.csv is written here (loggers.py)

    def train_batch(self, batch: dict, epoch: int, i: int, ni: int) -> torch.Tensor | None:
        """One batch: autocast forward, fp32 loss, scaled backward and, every ``accumulate`` batches, the
        optimizer step. Returns the loss items [box, cls, dfl], or None when a non-finite loss skipped it."""
        if self.graph is not None and ni > self.nw:  # momentum is fixed inside a graph: after the warmup
            out = self.graph(batch)  # the same step replayed from a CUDA graph; None: run it eagerly
            if out is not None:
                return self._graph_step_done(out, batch, epoch, i, ni)
        with self.autocast():
            feats = self.train_model(batch["img"])
        self.prof.mark("forward")
        loss, items = self.train_loss(fp32_preds(feats), batch)  # loss in fp32
        if not self.nonfinite.check(loss, batch, epoch, i):  # skipped; restores or raises (recovery.py)
            self.optimizer.zero_grad(set_to_none=True)
            self.state.last_opt_step = ni
            return None
        self.prof.mark("loss")
        self.scaler.scale(loss).backward()
        self.prof.mark("backward")
        # The last batch of an epoch always steps: no gradient crosses an epoch boundary, so a checkpoint
        # holds everything and a resumed run is exact.
        if ni - self.state.last_opt_step >= self.accumulate or i == self.nb - 1:
            self.optimizer_step()
            self.state.last_opt_step = ni
            self.prof.mark("optimizer")
        return items

    def _graph_step_done(self, out, batch: dict, epoch: int, i: int, ni: int) -> torch.Tensor | None:
        loss, items, grad_norm = out
        self.prof.mark("graph_step")
        if not self.nonfinite.check(loss, batch, epoch, i):
            # The replayed step is already applied (a graph cannot skip it): back to the last good state,
            # and the eager step, which can, from here on.
            self.graph.disable("non-finite loss")
            if self.nonfinite.streak:  # (check() restored by itself when this ended a streak)
                self.nonfinite.restore(count=False)  # not the loss's fault: the graph could not skip
            return None
        self.state.last_opt_step = ni
        self.grad_norm.add(grad_norm)
        self.run_callbacks("optimizer_step")
        self.run_callbacks("on_before_zero_grad")
        return items

    def preprocess_batch(self, batch: dict) -> dict:
        """Tensors to the device (non_blocking), images to float in [0, 1] (loader.to_device)."""
        return loader.to_device(batch, self.device, self.channels_last, self.args, self.stride)

    def optimizer_step(self) -> None:
        """unscale -> clip_grad_norm_(max_norm: 10 unless a subclass sets it) -> step -> scaler update ->
        zero_grad -> EMA update."""
        self.scaler.unscale_(self.optimizer)
        self.grad_norm.add(torch.nn.utils.clip_grad_norm_(self.step_model.parameters(), self.max_norm))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.run_callbacks("optimizer_step")
        self.run_callbacks("on_before_zero_grad")
        self.optimizer.zero_grad(set_to_none=True)
        if is_main_process():  # only rank 0 validates and saves the EMA
            self.ema.update(self.model)

    # ------------------------------------------------------------------ end of epoch
    def validate(self) -> tuple[dict, float]:
        """Validate the EMA model; returns (metrics, fitness = mAP50-95)."""
        v = self.validator
        if hasattr(v, "dataloader") and not isinstance(v.dataloader, ValBatchEvents):
            v.dataloader = ValBatchEvents(v.dataloader, self.run_callbacks)
        self.run_callbacks("on_val_start")
        metrics = dict(v(self.ema.ema))
        fitness = metrics.get("fitness", metrics.get("metrics/mAP50-95(B)"))
        if fitness is None:  # a custom validator without mAP: lower validation loss is better
            fitness = -sum(metrics.get(k, 0.0) for k in metric_columns(self.loss_names)[4:])
        self.state.metrics = metrics
        self.run_callbacks("on_val_end")
        return metrics, float(fitness)

    def rebuild_train_loader(self, batch_size: int, epoch: int, skip: int = 0) -> None:
        """A train loader over the same dataset at ``batch_size`` (per rank), starting ``skip`` images into
        ``epoch``'s order; batches per epoch, accumulation, warmup and weight decay follow the new size."""
        p, a = self.parts, self.args
        p.train_loader = loader.rebuild_train_loader(self, batch_size, epoch, skip)  # engine/loader.py
        p.batch_size, a.batch = batch_size, batch_size * self.world_size
        if p.graph is not None:
            p.graph.disable(f"the batch size changed to {batch_size}")
        if self.schedule is None:  # AutoBatch, before the schedule is made from this loader
            return
        self.schedule.rebatch(skip // batch_size + len(p.train_loader))
        if p.optimizer is not None:  # weight decay is sized for batch x accumulate (group 1: the weights)
            p.optimizer.param_groups[1]["weight_decay"] = optim.scaled_weight_decay(
                a.weight_decay, a.batch, self.schedule.accumulate, a.nbs)

    def use_parts(self, parts: TrainParts) -> TrainParts:
        """Make ``parts`` the trainer's (the hooks read the model, loaders and AMP from them); returns the
        previous ones. The doctor builds its own this way and hands the trainer's back."""
        previous, self.parts = self.parts, parts
        return previous

    def save_model(self) -> None:
        """last.pt every time; best.pt when this epoch has the best fitness; epoch{N}.pt every save_period."""
        resume.save_checkpoints(self)  # what a checkpoint holds, every rank's RNG streams: resume.py
