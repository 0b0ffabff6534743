"""The training loop (DESIGN §4): ``Trainer(model="yolov8n", data="coco128.yaml", epochs=100).train()``.

Every recipe key is one of ``yolofast.cfg.DEFAULTS`` (Ultralytics' names and defaults); ``train()`` returns
the final metrics dict (``metrics/mAP50-95(B)``, ``fitness``, ...) and writes ``project/name/`` with
``weights/last.pt``, ``weights/best.pt``, ``results.csv``, ``results.png`` and ``args.yaml``.

Reading order: ``train`` -> ``_setup_train`` (build everything) -> ``_do_train`` (THE loop, top to bottom)
-> ``train_batch`` (one step: forward, loss, backward, optimizer) -> ``validate`` / ``save_model`` (what
happens at the end of an epoch). What a run shows and writes (progress bar, results.csv/png, gradient
norms, ``profile=True``'s time split, TensorBoard) lives in ``loggers.py``, driven by the callback events;
what a checkpoint holds, writing it and how resume restores it in ``resume.py``; the data loaders (and
their rebuild at another batch size) in ``loader.py``; device, seeds and precision in
``device.py``; recovery (non-finite loss, out of memory) in ``recovery.py``, the CUDA-graph step in
``cudagraph.py``, AutoBatch in ``autobatch.py``.

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
import random
import time
import warnings
from pathlib import Path

import torch
import yaml
from torch import nn
from tqdm import tqdm

from yolofast.cfg import DEFAULTS, CfgError, get_cfg, quantize_half
from yolofast.engine import distill, elastic, loader, model_keys, optim, resume
from yolofast.engine.autobatch import autobatch, autobatch_gt, resolve_batch
from yolofast.engine.callbacks import Callbacks, ValBatchEvents
from yolofast.engine.compile import compile_mode, train_step_modules
from yolofast.engine.cudagraph import GraphedTrainStep, graph_blockers, optimizer_kwargs
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
    unwrap_model,
)
from yolofast.engine.freeze import freeze_bn
from yolofast.engine.gradnorm import GradNormStats
from yolofast.engine.loggers import LOSS_NAMES, METRIC_COLUMNS, RESULTS_COLUMNS, default_loggers
from yolofast.engine.multiscale import random_size, resize_batch
from yolofast.engine.profiler import make_profiler
from yolofast.engine.recovery import NonFiniteGuard, OutOfMemoryHalving, is_out_of_memory
from yolofast.engine.validate_args import validate_args

# select_device, init_seeds, cpu_has_native_bf16: yolofast/engine/device.py (re-exported here)
__all__ = ["Trainer", "RESULTS_COLUMNS", "cpu_has_native_bf16", "select_device", "increment_path",
           "init_seeds"]
_VAL_CONF = 0.001  # what conf=None means for validation (Ultralytics' val default)


def increment_path(path: str | Path, exist_ok: bool = False) -> Path:
    """runs/train/train -> train2, train3, ... unless ``exist_ok`` or the folder does not exist yet."""
    path = Path(path)
    if exist_ok or not path.exists():
        return path
    n = 2
    while (p := path.with_name(f"{path.name}{n}")).exists():
        n += 1
    return p


class Trainer:
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
        overrides = {**(overrides or {}), **kwargs}
        self._model_obj = overrides.get("model") if isinstance(overrides.get("model"), nn.Module) else None
        if self._model_obj is not None:
            overrides["model"] = type(self._model_obj).__name__
        if isinstance(overrides.get("data"), Path):
            overrides["data"] = str(overrides["data"])
        self.args = get_cfg(**overrides)
        self.callbacks = _callbacks or Callbacks()

        self.resume_ckpt = None
        elastic_dir = None if self.args.resume else resume.elastic_restart(self.args)  # sets args.resume
        if self.args.resume:  # the run's own recipe, its last.pt and the checkpoint (resume.py)
            self.args, self.resume_ckpt, self._resume_state = resume.load_resume_args(self.args, overrides)
        self.device = select_device(self.args.device)
        self.rank, self.world_size = get_rank(), get_world_size()

        validate_args(self.args, self._model_obj)  # imgsz, model: before any data or model is made
        from yolofast.data import check_data

        self.data = check_data(self.args.data)  # fails fast (DataError) on a wrong yaml
        if self.args.single_cls:  # labels are still checked against the data's own classes
            self.data = {**self.data, "label_nc": self.data["nc"], "nc": 1, "names": {0: "item"}}
        if self.args.rect and self.world_size > 1:
            raise CfgError("rect=True trains in one process only (its batches follow one sorted order); "
                           "drop rect or run without torchrun")
        if self.args.split not in self.data:
            raise CfgError(f"split={self.args.split!r} but the data has no such split "
                           f"(it has {', '.join(k for k in ('train', 'val', 'test') if k in self.data)})")
        try:
            resolve_batch(self.args.batch)
        except ValueError as e:
            raise CfgError(str(e)) from None
        if self.resume_ckpt is not None:
            self.save_dir = Path(self.resume_ckpt).parent.parent
        elif elastic_dir is not None:  # restarted before epoch 1 was saved: start over in the same folder
            self.save_dir = elastic_dir
        else:
            self.save_dir = increment_path(Path(self.args.project) / (self.args.name or "train"),
                                           self.args.exist_ok)
        self.args.name = self.save_dir.name
        self.wdir = self.save_dir / "weights"
        self.last, self.best = self.wdir / "last.pt", self.wdir / "best.pt"
        self.csv = self.save_dir / "results.csv"

        self.epochs = self.args.epochs
        self.start_epoch = 0
        self.epoch = 0
        self.best_fitness = None
        self.best_epoch = -1
        self.fitness = None
        self.metrics: dict = {}
        self.tloss = None
        self.loss_names = list(LOSS_NAMES)  # the loss items: progress header, results.csv, TensorBoard
        self.stop = False
        self.train_time = 0.0  # seconds, carried across resumes for results.csv's `time`
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
            # Ranks end together: rank 1 tearing its gloo group down while rank 0 was still saving aborted
            # it once in CI ("terminate called without an active exception", SIGABRT after the last epoch).
            barrier()
        except RuntimeError as e:  # another rank died mid-collective: its error is the one that matters
            if self.world_size > 1 and is_peer_failure(e):
                raise PeerFailedError(f"rank {self.rank} stopped in epoch {self.epoch + 1}: another rank "
                                      f"ended during a collective; its own error is printed above") from e
            raise
        finally:
            self.run_callbacks("teardown")
            destroy_distributed()
        return self.metrics

    def doctor(self, **kw):
        """Trace one batch, overfit it, check each loss branch's gradients (yolofast/doctor/)."""
        from yolofast.doctor import run

        return run(self, **kw)

    # ------------------------------------------------------------------ hooks for subclasses
    def get_model(self, cfg=None, weights=None) -> nn.Module:
        """The model to train: an nn.Module as given, a yolofast checkpoint's weights, or a fresh build."""
        from yolofast.nn import build_model

        nc, names = self.data["nc"], self.data["names"]
        if isinstance(cfg, nn.Module):
            model = cfg
            if getattr(model, "nc", nc) != nc:
                raise CfgError(f"the given model predicts {model.nc} classes but data '{self.args.data}' has "
                               f"nc={nc}; build it with build_model(cfg, nc={nc})")
        elif isinstance(cfg, (str, Path)) and str(cfg).endswith(".pt"):
            from yolofast.io.transfer import model_from_weights

            model = model_from_weights(cfg, nc, names, log=self.log, load=self.args.pretrained is not False,
                                       remap=self.args.cls_remap)
        else:
            model = build_model(cfg, nc=nc, verbose=self.args.verbose and is_main_process())
            if isinstance(self.args.pretrained, str):  # pretrained=path: that file's weights into `model`
                from yolofast.io.transfer import load_weights

                load_weights(model, self.args.pretrained, names, remap=self.args.cls_remap, log=self.log)
        if weights is not None:
            model.load_state_dict(weights.state_dict() if isinstance(weights, nn.Module) else weights)
        model.names = names
        for n, p in model.named_parameters():  # the DFL's fixed 0..15 bin weights stay frozen (DDP needs
            p.requires_grad_(".dfl." not in n)  # every trainable parameter to get a gradient)
        self.frozen = model_keys.apply_freeze(model, self.args, self.log)
        return model

    def get_dataloader(self, img_path, batch_size: int = 16, mode: str = "train"):
        """A data loader over ``img_path``: augmented and shuffled for "train", plain for "val"."""
        return loader.build_loader(self, img_path, batch_size, mode)  # engine/loader.py

    def get_loss(self, model: nn.Module):
        """``loss(feats, batch) -> (total, items)``: DetectionLoss with the recipe's box/cls/dfl gains."""
        from yolofast.loss import DetectionLoss

        m = unwrap_model(model)
        strides = tuple(float(s) for s in m.stride)
        weights = model_keys.class_weights_for(self, m.nc)  # cls_pw
        loss = DetectionLoss(m.nc, reg_max=getattr(m, "reg_max", 16), strides=strides, box=self.args.box,
                             cls=self.args.cls, dfl=self.args.dfl, class_weights=weights)
        return loss.to(self.device) if isinstance(loss, nn.Module) else loss

    def get_validator(self):
        """``validator(model) -> metrics dict`` over the ``split`` data, with the validation loss."""
        from yolofast.val import Validator

        a = self.args
        return Validator(self.val_loader, self.data["names"], conf=_VAL_CONF if a.conf is None else a.conf,
                         iou=self.args.iou,
                         max_det=self.args.max_det, loss=self.criterion, device=self.device,
                         half=quantize_half(a.quantize, self.amp_dtype is not None),
                         progress=self.args.verbose and is_main_process(),
                         map_convention=self.args.map_convention,
                         save_json=self.save_dir / "predictions.json" if self.args.save_json else None,
                         coco_json=self.data.get("coco_json"))

    # ------------------------------------------------------------------ setup
    def log(self, msg: str) -> None:
        if self.args.verbose and is_main_process():
            tqdm.write(msg)

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _setup_train(self) -> None:
        a = self.args
        self.device = init_distributed(self.device)  # cuda:LOCAL_RANK under torchrun
        init_seeds(a.seed + 1 + max(self.rank, 0), a.deterministic)
        if is_main_process():
            self.wdir.mkdir(parents=True, exist_ok=True)
            elastic.mark_run(self.save_dir)  # where a torchrun restart finds this run (elastic.py)
            with open(self.save_dir / "args.yaml", "w", encoding="utf-8") as f:
                yaml.safe_dump({k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, f,
                               sort_keys=False)

        if self.resume_ckpt is not None:  # the run's own architecture; _restore loads its exact state
            src = self._resume_state["model"]
        else:
            src = self._model_obj if self._model_obj is not None else a.model
        self.model = self.get_model(src).to(self.device)
        self.stride = max(int(unwrap_model(self.model).stride.max()), 32)  # multi_scale rounds sizes to it
        self.amp_dtype, self.scaler = setup_amp(self.args.amp, self.device)  # bf16/fp16/fp32 (device.py)
        # NHWC lets oneDNN/cuDNN pick their fast conv kernels: on the 2-core dev CPU the yolov8n step ran
        # 1.19x faster in fp32 (21.7 vs 18.2 images/s) and 1.08x in bf16 (36.9 vs 34.0).
        self.channels_last = self.device.type in ("cuda", "cpu") and a.channels_last is not False
        if self.channels_last:
            self.model.to(memory_format=torch.channels_last)
        self.model.train()
        if a.sync_bn:
            if self.world_size > 1 and self.device.type == "cuda":
                self.model = nn.SyncBatchNorm.convert_sync_batchnorm(self.model)
            else:
                warnings.warn("sync_bn=True needs DDP on CUDA (torchrun with nccl); BatchNorm statistics "
                              "stay per process", stacklevel=2)
        auto, fraction = resolve_batch(a.batch)
        self.batch_size = max(DEFAULTS["batch"] if auto else a.batch // self.world_size, 1)
        self.train_loader = self.get_dataloader(self.data["train"], self.batch_size, mode="train")
        self.criterion = self.get_loss(self.model)  # after the loader: cls_pw counts its labels
        # With distill_model: the student + projectors + frozen teacher, and the loss with dis_loss added
        # (engine/distill.py); otherwise the model and criterion themselves.
        self.step_model, step_loss, extra = distill.train_step(
            self.model, self.criterion, a, self.data["names"], self.device, self.channels_last)
        # After the names a subclass appended before train() (its loss items); once, should setup run again.
        self.loss_names += [n for n in extra if n not in self.loss_names]
        # DDP wrap, loss x world size, torch.compile (model + whole loss): yolofast/engine/compile.py
        self.train_model, self.train_loss = train_step_modules(self.step_model, step_loss, self.device,
                                                               a.compile, self.world_size)
        if auto and self.world_size > 1:
            # Profiling on rank 0 alone would run SyncBN / DDP collectives the other ranks never join.
            self.log(f"AutoBatch: single-process only; under DDP keeping batch {DEFAULTS['batch']} per rank "
                     f"(pass batch=N for another size)")
        elif auto:  # the largest batch whose step fits `fraction` of the GPU, at the data's largest GT count
            max_gt = autobatch_gt(self.train_loader.dataset, a.mosaic)
            b = autobatch(self.step_model, step_loss, a.imgsz, self.device, fraction, max_gt=max_gt,
                          amp_dtype=self.amp_dtype, default=DEFAULTS["batch"], log=self.log)
            self.rebuild_train_loader(b, epoch=0)
        a.batch = self.batch_size * self.world_size  # the resolved total, as checkpoints and resume see it
        self.val_loader = self.get_dataloader(self.data[a.split], self.batch_size * 2, mode="val")
        self.validator = self.get_validator()

        from yolofast.engine.ema import ModelEMA

        self.ema = ModelEMA(self.model)
        self.nonfinite = NonFiniteGuard(self)
        self.oom = OutOfMemoryHalving(self)

        nb = len(self.train_loader)
        self.accumulate = optim.accumulate_steps(a.nbs, a.batch)
        graph_why = graph_blockers(self.device, compile_mode(a.compile)[0], self.world_size > 1,
                                   self.accumulate, self.scaler.is_enabled()) if a.cuda_graph else None
        if graph_why is not None and (a.multi_scale or a.rect):  # a graph replays one input shape
            graph_why.append(f"{'multi_scale' if a.multi_scale else 'rect'} changes the input shape per "
                             f"batch")
        resumed_auto = self._resume_state.get("optimizer_auto") if self.resume_ckpt is not None else None
        self.optimizer, self.optimizer_auto, self.momentum, self.warmup_bias_lr = optim.recipe_optimizer(
            self.step_model, a, len(self.train_loader.dataset), self.accumulate, self.data["nc"],
            resumed_auto, extra=optimizer_kwargs if graph_why == [] else None, log=self.log)
        if self.optimizer_auto and is_main_process():  # args.yaml says what auto chose, as train_args do
            with open(self.save_dir / "args.yaml", "w", encoding="utf-8") as f:
                yaml.safe_dump({k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, f,
                               sort_keys=False)
        self.lf = optim.lr_lambda(self.epochs, a.lrf, a.cos_lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda=self.lf)
        self.nb = nb
        self.nw = optim.warmup_iters(a.warmup_epochs, self.epochs, nb)
        self.graph = None  # CUDA-graph step (cuda_graph=True): captured after the warmup (cudagraph.py)
        if graph_why:
            warnings.warn(f"cuda_graph=True but {'; '.join(graph_why)}: using the eager step", stacklevel=2)
        elif graph_why == []:
            bucket = autobatch_gt(self.train_loader.dataset, a.mosaic)  # GT rows of the captured batch
            self.graph = GraphedTrainStep(self.step_model, self.train_loss, self.optimizer, self.ema,
                                          self.amp_dtype, gt_bucket=bucket, batch_size=self.batch_size,
                                          max_norm=self.max_norm)

        if self.resume_ckpt is not None:
            resume.restore(self, self._resume_state)  # model, EMA, optimizer, ..., RNG: resume.py
            del self._resume_state
        resume.check_ranks_agree(self)

    # ------------------------------------------------------------------ THE loop
    def _do_train(self) -> None:
        """DESIGN §4, in order. Per epoch: train mode, sampler epoch, close_mosaic; per batch: warmup,
        autocast forward, fp32 loss, scaled backward, and every ``accumulate`` batches
        unscale -> clip 10.0 -> step -> scaler update -> zero_grad -> EMA; then the scheduler, validation
        of the EMA, results.csv, checkpoints, early stopping and the time limit."""
        a, model, opt = self.args, self.model, self.optimizer
        self.last_opt_step = self.start_epoch * self.nb - 1
        t_start = time.time() - self.train_time
        self.run_callbacks("on_train_start")
        self.log(f"Image sizes {a.imgsz} train, {a.imgsz} val; {a.workers} dataloader workers; logging "
                 f"results to {self.save_dir}\nStarting training for {self.epochs} epochs...")
        opt.zero_grad(set_to_none=True)
        epoch = self.start_epoch
        for epoch in range(self.start_epoch, self.epochs):
            self.epoch = epoch
            model.train()
            freeze_bn(model, getattr(self, "frozen", None))  # frozen layers keep their BatchNorm statistics
            sampler = getattr(self.train_loader, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            if len(self.train_loader) != self.nb:  # the first whole epoch after an out-of-memory halving
                self.nb = len(self.train_loader)
                self.nw = optim.warmup_iters(a.warmup_epochs, self.epochs, self.nb)
            if a.close_mosaic and epoch == self.epochs - a.close_mosaic:
                self.log("Closing dataloader mosaic")
                loader.close_mosaic(self.train_loader)
            self.run_callbacks("on_train_epoch_start")
            self.nonfinite.snapshot()  # the last good state a run of non-finite losses falls back to
            self.tloss = None
            self.prof.reset()
            for i, batch in loader.epoch_batches(self):  # goes on across an OOM halving
                self.batch_i = i
                self.run_callbacks("on_train_batch_start")
                ni = i + self.nb * epoch  # iterations since the run began
                if ni <= self.nw and self.nw > 0:
                    targets = [g["initial_lr"] * self.lf(epoch) for g in opt.param_groups]
                    lrs, mom, self.accumulate = optim.warmup_values(
                        ni, self.nw, lr_targets=targets, bias_lr0=self.warmup_bias_lr,
                        momentum0=a.warmup_momentum, momentum=self.momentum, nbs=a.nbs, batch=a.batch,
                        tags=[g.get("param_group") for g in opt.param_groups])
                    for g, lr in zip(opt.param_groups, lrs):
                        optim.set_group_value(g, "lr", lr)
                        if "momentum" in g:  # SGD/RMSProp only; Adam's beta1 stays `momentum`
                            g["momentum"] = mom

                self.batch = batch = self.preprocess_batch(batch)
                self.prof.mark("data")
                try:
                    items = self.train_batch(batch, epoch, i, ni)
                except RuntimeError as e:  # out of memory: half the batch; this batch's images come next
                    if not is_out_of_memory(e):
                        raise
                    i = self.oom.halve(e, epoch, i, self.epoch_images)
                    self.last_opt_step = i + self.nb * epoch - 1
                    continue
                if items is None:  # non-finite loss: the step was skipped (recovery.py)
                    continue

                self.loss_items = items = items.detach().float().cpu()
                self.tloss = items if self.tloss is None else (self.tloss * i + items) / (i + 1)
                self.run_callbacks("on_train_batch_end")
                self.prof.mark("other")
                if a.time and broadcast_flag(time.time() - t_start > a.time * 3600):  # ranks stop together
                    self.stop = True
                    self.log(f"Time limit of {a.time} h reached in epoch {epoch + 1}; stopping")
                    break

            self.lr = {f"lr/pg{j}": float(g["lr"]) for j, g in enumerate(opt.param_groups)}
            self.run_callbacks("on_train_epoch_end")
            self.scheduler.step()
            self.run_callbacks("on_params_update")

            if a.val or epoch + 1 == self.epochs or self.stop:  # self.stop here: the time limit
                self.prof.mark("other")
                self.metrics, self.fitness = rank0_broadcast(self.validate)  # rank 0 validates
                self.prof.mark("val")
                if self.best_fitness is None or self.fitness > self.best_fitness:
                    self.best_fitness, self.best_epoch = self.fitness, epoch
                if a.patience and epoch - self.best_epoch >= a.patience:
                    self.stop = True
                    self.log(f"Stopping early: no improvement in the last {a.patience} epochs; best was "
                             f"epoch {self.best_epoch + 1} (fitness {self.best_fitness:.4f})")
            final = epoch + 1 == self.epochs or self.stop
            self.train_time = time.time() - t_start
            if a.save or final:
                self.save_model()
                self.run_callbacks("on_model_save")
            self.run_callbacks("on_fit_epoch_end")  # results.csv is written here (loggers.py)
            if self.stop:
                break
        self.epoch = epoch
        resume.validate_best(self)  # the returned metrics are best.pt's
        self.run_callbacks("on_train_end")  # results.png (loggers.py)
        hours = (time.time() - t_start) / 3600
        self.log(f"\n{epoch - self.start_epoch + 1} epochs completed in {hours:.3f} hours "
                 f"({hours * 60:.1f} min).\nResults saved to {self.save_dir.resolve()}"
                 f"\n  weights: {self.best.resolve()}\n  metrics: {self.csv.resolve()}")

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
        loss, items = self.train_loss([f.float() for f in feats], batch)  # loss in fp32
        if not self.nonfinite.check(loss, batch, epoch, i):  # skipped; restores or raises (recovery.py)
            self.optimizer.zero_grad(set_to_none=True)
            self.last_opt_step = ni
            return None
        self.prof.mark("loss")
        self.scaler.scale(loss).backward()
        self.prof.mark("backward")
        # The last batch of an epoch always steps: no gradient crosses an epoch boundary, so a checkpoint
        # holds everything and a resumed run is exact.
        if ni - self.last_opt_step >= self.accumulate or i == self.nb - 1:
            self.optimizer_step()
            self.last_opt_step = ni
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
        self.last_opt_step = ni
        self.grad_norm.add(grad_norm)
        self.run_callbacks("optimizer_step")
        self.run_callbacks("on_before_zero_grad")
        return items

    def preprocess_batch(self, batch: dict) -> dict:
        """Tensors to the device (non_blocking), images to float in [0, 1]."""
        dev = self.device
        out = {k: (v.to(dev, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
        out["img"] = out["img"].float() / 255
        if self.args.multi_scale:  # a random size per batch around imgsz (multiscale.py)
            out["img"] = resize_batch(out["img"], random_size(self.args.imgsz, self.args.multi_scale,
                                                              self.stride, random), self.stride)
        if self.channels_last:
            out["img"] = out["img"].contiguous(memory_format=torch.channels_last)
        return out

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
            fitness = -sum(metrics.get(k, 0.0) for k in METRIC_COLUMNS[4:])
        self.metrics = metrics
        self.run_callbacks("on_val_end")
        return metrics, float(fitness)

    def rebuild_train_loader(self, batch_size: int, epoch: int, skip: int = 0) -> None:
        """A train loader over the same dataset at ``batch_size`` (per rank), starting ``skip`` images into
        ``epoch``'s order; batches per epoch, accumulation and warmup follow the new size."""
        loader.rebuild_train_loader(self, batch_size, epoch, skip)  # engine/loader.py

    def save_model(self) -> None:
        """last.pt every time; best.pt when this epoch has the best fitness; epoch{N}.pt every save_period."""
        resume.save_checkpoints(self)  # what a checkpoint holds, every rank's RNG streams: resume.py
