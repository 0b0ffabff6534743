"""The training loop (DESIGN §4): ``Trainer(model="yolov8n", data="coco128.yaml", epochs=100).train()``.

Every recipe key is one of ``yolofast.cfg.DEFAULTS`` (Ultralytics' names and defaults); ``train()`` returns
the final metrics dict (``metrics/mAP50-95(B)``, ``fitness``, ...) and writes ``project/name/`` with
``weights/last.pt``, ``weights/best.pt``, ``results.csv``, ``results.png`` and ``args.yaml``.

Reading order: ``train`` -> ``_setup_train`` (build everything) -> ``_do_train`` (THE loop, top to bottom)
-> ``train_batch`` (one step: forward, loss, backward, optimizer) -> ``validate`` / ``save_model`` /
``save_metrics`` (what happens at the end of an epoch). Recovery (non-finite loss, out of memory) lives in
``recovery.py``, the CUDA-graph step in ``cudagraph.py``, AutoBatch in ``autobatch.py``.

Extending
---------
Callbacks: ``trainer.add_callback("on_fit_epoch_end", fn)``; ``fn(trainer)`` sees ``trainer.epoch``,
``trainer.tloss``, ``trainer.metrics``, ``trainer.model``, ... (events: ``yolofast.engine.callbacks``).

Subclassing: override any of these hooks and pass the class to ``YOLO(...).train(trainer=MyTrainer)``
or instantiate it directly:

* ``get_model(cfg, weights=None)``  -> nn.Module (train mode returns the raw maps; needs ``nc``, ``stride``,
  ``reg_max``, ``forward_feats`` and ``decode`` for validation);
* ``get_dataloader(img_path, batch_size, mode="train"|"val")`` -> an iterable of batches (yolofast format);
* ``get_loss(model)`` -> ``loss(feats, batch) -> (total, items[box, cls, dfl])``, e.g. another cls loss;
* ``get_validator()`` -> ``validator(model) -> dict`` with ``fitness`` (e.g. a different metric).

    class FocalTrainer(Trainer):
        def get_loss(self, model):
            return MyFocalLoss(model.nc)

    YOLO("yolov8n").train(data="shapes", epochs=10, trainer=FocalTrainer)
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import random
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import yaml
from torch import nn
from tqdm import tqdm

from yolofast.cfg import DEFAULTS, CfgError, get_cfg
from yolofast.engine import checkpoint as ckpt_io
from yolofast.engine import cudagraph, distill, elastic, optim
from yolofast.engine.autobatch import (
    MEMORY_COLUMNS,
    autobatch,
    autobatch_gt,
    cpu_rss_gb,
    memory_usage,
    resolve_batch,
)
from yolofast.engine.callbacks import Callbacks
from yolofast.engine.compile import compile_mode, train_step_modules
from yolofast.engine.cudagraph import GraphedTrainStep, graph_blockers, optimizer_kwargs
from yolofast.engine.distributed import (
    PeerFailedError,
    all_gather_objects,
    barrier,
    broadcast_flag,
    destroy_distributed,
    gather_to_rank0,
    get_rank,
    get_world_size,
    init_distributed,
    is_main_process,
    is_peer_failure,
    rank0_broadcast,
    restart_count,
    unwrap_model,
)
from yolofast.engine.recovery import NonFiniteGuard, OutOfMemoryHalving, is_out_of_memory
from yolofast.engine.validate_args import validate_args

__all__ = ["Trainer", "RESULTS_COLUMNS", "select_device", "increment_path", "init_seeds"]

# results.csv columns: Ultralytics' names, so the tools that read its runs keep working.
RESULTS_COLUMNS = (
    "epoch", "time", "train/box_loss", "train/cls_loss", "train/dfl_loss", "metrics/precision(B)",
    "metrics/recall(B)", "metrics/mAP50(B)", "metrics/mAP50-95(B)", "val/box_loss", "val/cls_loss",
    "val/dfl_loss", "lr/pg0", "lr/pg1", "lr/pg2",
) + MEMORY_COLUMNS  # appended after Ultralytics' columns: CPU RSS and CUDA reserved per epoch
_METRIC_KEYS = RESULTS_COLUMNS[5:12]


def select_device(device=None) -> torch.device:
    """None -> cuda:0 if available else cpu; "cpu", 0, "0", "cuda", "cuda:1" (Ultralytics' forms)."""
    if isinstance(device, torch.device):
        return device
    if device is None or str(device).strip() == "":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    s = str(device).strip().lower()
    if s.replace(",", "").isdigit():
        if "," in s:
            raise CfgError(f"device={device!r}: several GPUs need torchrun (one process per GPU); pass one")
        s = f"cuda:{s}"
    try:
        dev = torch.device(s)
    except RuntimeError as e:
        raise CfgError(f"device={device!r} is not a device; use cpu, 0, cuda or cuda:N") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CfgError(f"device={device!r} asks for CUDA but torch.cuda.is_available() is False "
                       f"(torch {torch.__version__}); use device=cpu")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise CfgError(f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return dev


def increment_path(path: str | Path, exist_ok: bool = False) -> Path:
    """runs/train/train -> train2, train3, ... unless ``exist_ok`` or the folder does not exist yet."""
    path = Path(path)
    if exist_ok or not path.exists():
        return path
    n = 2
    while (p := path.with_name(f"{path.name}{n}")).exists():
        n += 1
    return p


def init_seeds(seed: int = 0, deterministic: bool = True) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic (CUDA >= 10.2); warn_only: a few CUDA ops
        # (e.g. index_put backward) have no deterministic kernel and would otherwise raise.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def cpu_has_native_bf16() -> bool:
    """True on x86 CPUs with AVX512-BF16 or AMX-BF16 (Linux /proc/cpuinfo flags) that oneDNN uses."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags)) and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _memory_gb(device: torch.device) -> float:
    """For the progress bar: CUDA memory reserved now, or this process's resident set size."""
    return torch.cuda.memory_reserved(device) / 1e9 if device.type == "cuda" else cpu_rss_gb()


class _ValBatchEvents:
    """Wraps a validation loader so ``on_val_batch_start/end`` fire around every batch the validator runs."""

    def __init__(self, loader, fire):
        self.loader, self.fire = loader, fire

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):  # dataset, batch_size, ... of the wrapped loader
        return getattr(self.loader, name)

    def __iter__(self):
        for batch in self.loader:
            self.fire("on_val_batch_start")
            yield batch
            self.fire("on_val_batch_end")


class Trainer:
    """Trains a YOLOv8-style detector. ``Trainer(overrides=None, **recipe)``; see the module docstring.

    ``model``: "yolov8n" (any scale), a model yaml/dict, a yolofast checkpoint path (its weights are the
    start) or an ``nn.Module``; ``data``: a data yaml, a dict or "shapes". Unknown keys and bad data fail
    here, before anything is built. ``resume=True`` (latest last.pt under ``project``) or
    ``resume="path/last.pt"`` continues that run with its own recipe.
    """

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
        elastic_dir = None if self.args.resume else self._elastic_restart(overrides)
        if self.args.resume:
            self._load_resume_args(overrides)
        self.device = select_device(self.args.device)
        self.rank, self.world_size = get_rank(), get_world_size()

        validate_args(self.args, self._model_obj)  # imgsz, model: before any data or model is made
        from yolofast.data import check_data

        self.data = check_data(self.args.data)  # fails fast (DataError) on a wrong yaml
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
        self.loss_names = ["box_loss", "cls_loss", "dfl_loss"]  # the loss items; + "dis_loss" with a teacher
        self.stop = False
        self.train_time = 0.0  # seconds, carried across resumes for results.csv's `time`

    # ------------------------------------------------------------------ public API
    def add_callback(self, event: str, fn) -> None:
        """Append ``fn(trainer)`` to ``event`` (an unknown event name is a ValueError)."""
        self.callbacks.add(event, fn)

    def set_callback(self, event: str, fn) -> None:
        self.callbacks.set(event, [fn])

    def run_callbacks(self, event: str) -> None:
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
            model = self._model_from_weights(cfg, nc, names)
        else:
            model = build_model(cfg, nc=nc, verbose=self.args.verbose and is_main_process())
        if weights is not None:
            model.load_state_dict(weights.state_dict() if isinstance(weights, nn.Module) else weights)
        model.names = names
        for n, p in model.named_parameters():  # the DFL's fixed 0..15 bin weights stay frozen (DDP needs
            p.requires_grad_(".dfl." not in n)  # every trainable parameter to get a gradient)
        return model

    def _model_from_weights(self, path, nc: int, names: dict) -> nn.Module:
        """A fresh model of the checkpoint's architecture for the data's classes, started from its weights
        (yolofast's or Ultralytics' .pt, read safely); class rows are carried over by class name."""
        from yolofast.io import read_checkpoint
        from yolofast.io.transfer import transfer_weights
        from yolofast.nn import build_model

        if not Path(path).is_file():
            raise CfgError(f"model={str(path)!r}: checkpoint not found (yolofast downloads no weights; use "
                           f"'yolov8n' to train from scratch or a path to a yolofast or Ultralytics .pt)")
        src = read_checkpoint(path)
        if src["cfg"] is None:
            raise CfgError(f"model={str(path)!r} holds a custom {src['arch']} without a model config; pass "
                           f"the module itself (Trainer(model=module)) with its weights loaded")
        model = build_model(src["cfg"], nc=nc)
        names = dict(enumerate(names)) if isinstance(names, (list, tuple)) else dict(names)
        names = {int(k): str(v) for k, v in names.items()}
        n = transfer_weights(model, src["state_dict"], src["names"], names)
        self.log(f"Transferred {n['tensors']}/{n['total']} tensors, {n['rows']}/{n['classes']} class rows "
                 f"from {path} ({src['source']} {src['arch']}, {src['nc']} classes)")
        return model

    def get_dataloader(self, img_path, batch_size: int = 16, mode: str = "train"):
        """A data loader over ``img_path``: augmented and shuffled for "train", plain for "val"."""
        from yolofast.data import build_dataloader, build_dataset

        a = self.args
        hyp = {k: getattr(a, k) for k in ("hsv_h", "hsv_s", "hsv_v", "degrees", "translate", "scale", "shear",
                                           "perspective", "flipud", "fliplr", "mosaic", "mixup")}
        train = mode == "train"
        stride = max(int(unwrap_model(self.model).stride.max()), 32) if hasattr(self, "model") else 32
        dataset = build_dataset(img_path, imgsz=a.imgsz, augment=train, hyp=hyp, stride=stride, cache=a.cache,
                                prefix=f"{mode}: ", nc=self.data["nc"])
        rank = self.rank if train else -1  # validation runs on rank 0 over the whole split
        return build_dataloader(dataset, batch_size, a.workers, shuffle=train, rank=rank, seed=a.seed,
                                drop_last=train and self._static_batches(len(dataset), batch_size))

    def _static_batches(self, n_images: int, batch_size: int) -> bool:
        """Drop an epoch's short last batch when the step is compiled or graphed: a batch of another size
        is one more compile (or an eager step beside the graph). The order is reshuffled every epoch, so
        no image is left out for good."""
        graphed = self.args.cuda_graph and self.device.type == cudagraph.GRAPH_DEVICE
        static = compile_mode(self.args.compile)[0] or graphed
        return static and n_images >= batch_size

    def get_loss(self, model: nn.Module):
        """``loss(feats, batch) -> (total, items)``: DetectionLoss with the recipe's box/cls/dfl gains."""
        from yolofast.loss import DetectionLoss

        m = unwrap_model(model)
        strides = tuple(float(s) for s in m.stride)
        loss = DetectionLoss(m.nc, reg_max=getattr(m, "reg_max", 16), strides=strides, box=self.args.box,
                             cls=self.args.cls, dfl=self.args.dfl)
        return loss.to(self.device) if isinstance(loss, nn.Module) else loss

    def get_validator(self):
        """``validator(model) -> metrics dict`` over the ``split`` data, with the validation loss."""
        from yolofast.val import Validator

        return Validator(self.val_loader, self.data["names"], conf=self.args.conf, iou=self.args.iou,
                         max_det=self.args.max_det, loss=self.criterion, device=self.device,
                         half=self.amp_dtype is not None, progress=self.args.verbose and is_main_process(),
                         map_convention=self.args.map_convention)

    # ------------------------------------------------------------------ setup
    def log(self, msg: str) -> None:
        if self.args.verbose and is_main_process():
            tqdm.write(msg)

    def _load_resume_args(self, overrides: dict) -> None:
        r = self.args.resume
        path = ckpt_io.find_last_checkpoint(self.args.project) if r is True else Path(str(r))
        ckpt = ckpt_io.load_checkpoint(path)
        args = ckpt_io.resume_args(ckpt, path, overrides)  # safe overrides honoured, the others refused
        ckpt_io.remove_stale_temps(Path(path).parent)  # a save killed before its rename
        self.args = get_cfg(**args)
        self.resume_ckpt = str(path)
        self._resume_state = ckpt

    def _elastic_restart(self, overrides: dict) -> Path | None:
        """Under a torchrun restart, this run's folder (elastic.py); sets ``resume`` to its last.pt when it
        has one, so the restarted group continues the run instead of starting a new one."""
        folder = elastic.restarted_run(self.args.project, self.args.name or "train")
        if folder is None:
            return None
        last = folder / "weights" / "last.pt"
        if last.is_file():
            self.args.resume = str(last)
            if is_main_process():
                tqdm.write(f"torchrun restart {restart_count()}: resuming {last}")
        else:
            (folder / "results.csv").unlink(missing_ok=True)  # rows of an epoch no checkpoint holds
        return folder

    def _setup_amp(self) -> None:
        """bf16 autocast where the hardware does bf16 natively (no scaler), fp16 + GradScaler on older GPUs,
        fp32 otherwise or when ``amp=False``.

        CPU: amp=True means bf16 only on CPUs with native bf16 (AVX512-BF16 or AMX). There, the whole yolov8n
        step at 320 px batch 16 ran 1.9x faster than fp32 (34.0 vs 18.2 images/s, 2 threads,
        benchmarks/bench_train_step.py); CPUs without it emulate bf16 and are slower than fp32.
        """
        a, dev = self.args.amp, self.device.type
        want = str(a).lower() if not isinstance(a, bool) else ("auto" if a else "off")
        if want not in ("auto", "off", "bf16", "fp16", "true", "false"):
            raise CfgError(f"amp={a!r}: use True, False, 'bf16' or 'fp16'")
        dtype = None
        if dev == "cuda" and want in ("auto", "true"):
            dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        elif want == "bf16" or (dev == "cpu" and want in ("auto", "true") and cpu_has_native_bf16()):
            dtype = torch.bfloat16
        elif want == "fp16":
            if dev != "cuda":
                raise CfgError("amp='fp16' needs a CUDA device; on CPU use amp='bf16' or amp=False")
            dtype = torch.float16
        self.amp_dtype = dtype
        self.scaler = torch.amp.GradScaler(dev, enabled=dtype is torch.float16)

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
        self._setup_amp()
        # NHWC lets oneDNN/cuDNN pick their fast conv kernels: on the 2-core dev CPU the yolov8n step ran
        # 1.19x faster in fp32 (21.7 vs 18.2 images/s) and 1.08x in bf16 (36.9 vs 34.0).
        self.channels_last = self.device.type in ("cuda", "cpu")
        if self.channels_last:
            self.model.to(memory_format=torch.channels_last)
        self.model.train()
        if a.sync_bn:
            if self.world_size > 1 and self.device.type == "cuda":
                self.model = nn.SyncBatchNorm.convert_sync_batchnorm(self.model)
            else:
                warnings.warn("sync_bn=True needs DDP on CUDA (torchrun with nccl); BatchNorm statistics "
                              "stay per process", stacklevel=2)
        self.criterion = self.get_loss(self.model)
        # With distill_model: the student + projectors + frozen teacher, and the loss with dis_loss added
        # (engine/distill.py); otherwise the model and criterion themselves.
        self.step_model, step_loss, extra = distill.train_step(
            self.model, self.criterion, a, self.data["names"], self.device, self.channels_last)
        self.loss_names = self.loss_names[:3] + extra
        # DDP wrap, loss x world size, torch.compile (model + whole loss): yolofast/engine/compile.py
        self.train_model, self.train_loss = train_step_modules(self.step_model, step_loss, self.device,
                                                               a.compile, self.world_size)

        auto, fraction = resolve_batch(a.batch)
        self.batch_size = max(DEFAULTS["batch"] if auto else a.batch // self.world_size, 1)
        self.train_loader = self.get_dataloader(self.data["train"], self.batch_size, mode="train")
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
        decay = optim.scaled_weight_decay(a.weight_decay, a.batch, self.accumulate, a.nbs)
        # Optimizer steps of the run, for optimizer=auto: images / max(batch, nbs) per epoch.
        iterations = math.ceil(len(self.train_loader.dataset) / max(a.batch, a.nbs)) * self.epochs
        graph_why = graph_blockers(self.device, compile_mode(a.compile)[0], self.world_size > 1,
                                   self.accumulate, self.scaler.is_enabled()) if a.cuda_graph else None
        name, lr, momentum = a.optimizer, a.lr0, a.momentum
        if name == "auto" and self.resume_ckpt is not None and self._resume_state.get("optimizer_auto"):
            # The resumed run's own choice: extending `epochs` changes the iteration count auto decides by,
            # and an SGD cannot load an AdamW state.
            name, lr, momentum = self._resume_state["optimizer_auto"]
        self.optimizer, name, lr, momentum = optim.build_optimizer(
            self.step_model, name, lr, momentum, decay, iterations, nc=self.data["nc"],
            extra=optimizer_kwargs if graph_why == [] else None)
        self.optimizer_auto = (name, lr, momentum) if a.optimizer == "auto" else None
        if a.optimizer == "auto":
            # The 0.1 bias warmup lr is sized for SGD lr 0.01; from an auto-chosen lr it would blow up biases.
            self.warmup_bias_lr = 0.0
            self.log(f"optimizer: 'optimizer=auto' -> {name}(lr={lr}, momentum={momentum}) "
                     f"for {iterations} iterations")
        else:
            self.warmup_bias_lr = a.warmup_bias_lr
        self.momentum = momentum
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
                                          self.amp_dtype, gt_bucket=bucket, batch_size=self.batch_size)

        if self.resume_ckpt is not None:
            self._restore(self._resume_state)
            del self._resume_state
        self._check_ranks_agree()

    def _check_ranks_agree(self) -> None:
        """Every rank starts at the same epoch of the same run, or none trains: a rank that resumed alone
        (a node that cannot see the run folder) would run other epochs and wait in an all-reduce."""
        if self.world_size <= 1:
            return
        starts = all_gather_objects((self.start_epoch, self.save_dir.name))
        if len(set(starts)) > 1:
            where = ", ".join(f"rank {r}: epoch {e + 1} of '{n}'" for r, (e, n) in enumerate(starts))
            raise CfgError(f"the ranks would start at different points ({where}): put project="
                           f"{self.args.project} on a file system every node sees, or pass the same resume= "
                           f"path to every node")

    def _rng_generators(self) -> dict:
        """Loader-owned generators (shuffle order, worker seeds) that must resume where they stopped."""
        gens = {}
        loader = self.train_loader
        if isinstance(getattr(loader, "generator", None), torch.Generator):
            gens["loader"] = loader.generator
        sampler = getattr(loader, "sampler", None)
        if isinstance(getattr(sampler, "generator", None), torch.Generator):
            gens["sampler"] = sampler.generator
        return gens

    def _rng_state(self) -> dict:
        state = ckpt_io.rng_state(self._rng_generators())
        # The dataset's own augmentation generator (in-process loading, workers=0). With workers > 0 each
        # persistent worker holds its own copy, out of a checkpoint's reach: resume is exact for workers=0.
        ds_rng = getattr(self.train_loader.dataset, "rng", None)
        if isinstance(ds_rng, np.random.Generator):
            state["dataset"] = ds_rng.bit_generator.state
        return state

    def _restore(self, ckpt: dict) -> None:
        """Everything a resumed run needs to continue exactly as if it had never stopped."""
        self.start_epoch = ckpt["epoch"] + 1
        unwrap_model(self.model).load_state_dict(ckpt["model"].state_dict())
        distill.restore_state(self.step_model, ckpt, self.resume_ckpt)
        self.ema.load_state_dict({"ema": ckpt["ema"].state_dict(), "updates": ckpt["updates"]})
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scaler.load_state_dict(ckpt["scaler"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.best_fitness, self.best_epoch = ckpt["best_fitness"], ckpt.get("best_epoch", -1)
        self.metrics = ckpt.get("train_metrics") or {}
        self.train_time = ckpt.get("train_time", 0.0)
        closes_at = self.epochs - self.args.close_mosaic  # the loop's test; < 0 (a short run): never
        if self.args.close_mosaic and 0 <= closes_at < self.start_epoch:
            self._close_mosaic()
        rng = ckpt["rng"]
        if len(ckpt.get("rng_ranks") or ()) == self.world_size > 1:  # this rank's own streams (save_model)
            rng = ckpt["rng_ranks"][self.rank]
        ckpt_io.set_rng_state(rng, self._rng_generators())
        ds_rng = getattr(self.train_loader.dataset, "rng", None)
        if isinstance(ds_rng, np.random.Generator) and "dataset" in rng:
            ds_rng.bit_generator.state = rng["dataset"]
        if self.csv.exists():  # drop rows of epochs the checkpoint does not hold (crash after the csv write)
            with open(self.csv, newline="", encoding="utf-8") as f:
                rows = [r for r in csv.DictReader(f) if int(float(r["epoch"])) <= self.start_epoch]
            self.csv.unlink()
            for r in rows:
                self._write_csv_row(r)
        self.log(f"Resuming {self.resume_ckpt} from epoch {self.start_epoch + 1} to {self.epochs}")

    def _close_mosaic(self) -> None:
        ds = getattr(self.train_loader, "dataset", None)
        if hasattr(ds, "close_mosaic"):
            ds.close_mosaic()

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
            sampler = getattr(self.train_loader, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            if len(self.train_loader) != self.nb:  # the first whole epoch after an out-of-memory halving
                self.nb = len(self.train_loader)
                self.nw = optim.warmup_iters(a.warmup_epochs, self.epochs, self.nb)
            if a.close_mosaic and epoch == self.epochs - a.close_mosaic:
                self.log("Closing dataloader mosaic")
                self._close_mosaic()
            self.run_callbacks("on_train_epoch_start")
            self.nonfinite.snapshot()  # the last good state a run of non-finite losses falls back to
            self.tloss = None
            pbar = self._progress(epoch)
            for i, batch in pbar:
                self.run_callbacks("on_train_batch_start")
                ni = i + self.nb * epoch  # iterations since the run began
                if ni <= self.nw and self.nw > 0:
                    targets = [g["initial_lr"] * self.lf(epoch) for g in opt.param_groups]
                    lrs, mom, self.accumulate = optim.warmup_values(
                        ni, self.nw, lr_targets=targets, bias_lr0=self.warmup_bias_lr,
                        momentum0=a.warmup_momentum, momentum=self.momentum, nbs=a.nbs, batch=a.batch)
                    for g, lr in zip(opt.param_groups, lrs):
                        optim.set_group_value(g, "lr", lr)
                        if "momentum" in g:  # SGD/RMSProp only; Adam's beta1 stays `momentum`
                            g["momentum"] = mom

                batch = self.preprocess_batch(batch)
                try:
                    items = self.train_batch(batch, epoch, i, ni)
                except RuntimeError as e:  # out of memory: half the batch; this batch's images come next
                    if not is_out_of_memory(e):
                        raise
                    i = self.oom.halve(e, epoch, i, self.epoch_images)
                    self.last_opt_step = i + self.nb * epoch - 1
                    pbar.total, pbar.n = self.nb, i
                    continue
                if items is None:  # non-finite loss: the step was skipped (recovery.py)
                    continue

                items = items.detach().float().cpu()
                self.tloss = items if self.tloss is None else (self.tloss * i + items) / (i + 1)
                if a.verbose and is_main_process():
                    pbar.set_description(self._progress_line(epoch, batch))
                self.run_callbacks("on_train_batch_end")
                if a.time and broadcast_flag(time.time() - t_start > a.time * 3600):  # ranks stop together
                    self.stop = True
                    self.log(f"Time limit of {a.time} h reached in epoch {epoch + 1}; stopping")
                    break
            pbar.close()

            self.lr = {f"lr/pg{j}": float(g["lr"]) for j, g in enumerate(opt.param_groups)}
            self.run_callbacks("on_train_epoch_end")
            self.scheduler.step()
            self.run_callbacks("on_params_update")

            if a.val or epoch + 1 == self.epochs or self.stop:  # self.stop here: the time limit
                self.metrics, self.fitness = rank0_broadcast(self.validate)  # rank 0 validates
                if self.best_fitness is None or self.fitness > self.best_fitness:
                    self.best_fitness, self.best_epoch = self.fitness, epoch
                if a.patience and epoch - self.best_epoch >= a.patience:
                    self.stop = True
                    self.log(f"Stopping early: no improvement in the last {a.patience} epochs; best was "
                             f"epoch {self.best_epoch + 1} (fitness {self.best_fitness:.4f})")
            final = epoch + 1 == self.epochs or self.stop
            self.train_time = time.time() - t_start
            self.save_metrics()
            if a.save or final:
                self.save_model()
                self.run_callbacks("on_model_save")
            self.run_callbacks("on_fit_epoch_end")
            if self.stop:
                break
        self.epoch = epoch
        self._final_eval()
        if a.plots and is_main_process() and self.csv.exists():
            from yolofast.engine.plots import plot_results

            plot_results(self.csv)
        self.run_callbacks("on_train_end")
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
        loss, items = self.train_loss([f.float() for f in feats], batch)  # loss in fp32
        if not self.nonfinite.check(loss, batch, epoch, i):  # skipped; restores or raises (recovery.py)
            self.optimizer.zero_grad(set_to_none=True)
            self.last_opt_step = ni
            return None
        self.scaler.scale(loss).backward()
        # The last batch of an epoch always steps: no gradient crosses an epoch boundary, so a checkpoint
        # holds everything and a resumed run is exact.
        if ni - self.last_opt_step >= self.accumulate or i == self.nb - 1:
            self.optimizer_step()
            self.last_opt_step = ni
        return items

    def _graph_step_done(self, out, batch: dict, epoch: int, i: int, ni: int) -> torch.Tensor | None:
        loss, items = out
        if not self.nonfinite.check(loss, batch, epoch, i):
            # The replayed step is already applied (a graph cannot skip it): back to the last good state,
            # and the eager step, which can, from here on.
            self.graph.disable("non-finite loss")
            if self.nonfinite.streak:  # (check() restored by itself when this ended a streak)
                self.nonfinite.restore(count=False)  # not the loss's fault: the graph could not skip
            return None
        self.last_opt_step = ni
        self.run_callbacks("optimizer_step")
        self.run_callbacks("on_before_zero_grad")
        return items

    def preprocess_batch(self, batch: dict) -> dict:
        """Tensors to the device (non_blocking), images to float in [0, 1]."""
        dev = self.device
        out = {k: (v.to(dev, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
        out["img"] = out["img"].float() / 255
        if self.channels_last:
            out["img"] = out["img"].contiguous(memory_format=torch.channels_last)
        return out

    def optimizer_step(self) -> None:
        """unscale -> clip_grad_norm_(10.0) -> step -> scaler update -> zero_grad -> EMA update."""
        self.scaler.unscale_(self.optimizer)
        # 10.0 bounds the rare huge gradients of early iterations (loss is × batch); normal ones pass.
        torch.nn.utils.clip_grad_norm_(self.step_model.parameters(), max_norm=10.0)
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
        if hasattr(v, "dataloader") and not isinstance(v.dataloader, _ValBatchEvents):
            v.dataloader = _ValBatchEvents(v.dataloader, self.run_callbacks)
        self.run_callbacks("on_val_start")
        metrics = dict(v(self.ema.ema))
        fitness = metrics.get("fitness", metrics.get("metrics/mAP50-95(B)"))
        if fitness is None:  # a custom validator without mAP: lower validation loss is better
            fitness = -sum(metrics.get(k, 0.0) for k in _METRIC_KEYS[4:])
        self.metrics = metrics
        self.run_callbacks("on_val_end")
        return metrics, float(fitness)

    def _epoch_batches(self):
        """(i, batch) over one epoch. When an out-of-memory halving replaces the loader mid-epoch, the rest
        of the epoch comes from the new one (it starts where the old one failed), numbered in its batches."""
        i, loader = 0, self.train_loader
        self.epoch_images = 0  # images before the current batch: where a halved loader starts
        while True:
            for batch in loader:
                yield i, batch
                if self.train_loader is not loader:
                    break
                i += 1
                self.epoch_images += batch["img"].shape[0]
            else:
                return
            loader = self.train_loader
            i = self.nb - len(loader)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # hand the failed step's cached blocks back before the smaller one

    def rebuild_train_loader(self, batch_size: int, epoch: int, skip: int = 0) -> None:
        """A train loader over the same dataset at ``batch_size`` (per rank), starting ``skip`` images into
        ``epoch``'s order; batches per epoch, accumulation and warmup follow the new size."""
        from yolofast.data import build_dataloader

        a = self.args
        ds = self.train_loader.dataset
        self.train_loader = build_dataloader(ds, batch_size, a.workers, shuffle=True, rank=self.rank,
                                             seed=a.seed, drop_last=self._static_batches(len(ds), batch_size))
        self.train_loader.sampler.start_at(epoch, skip)
        self.batch_size = batch_size
        a.batch = batch_size * self.world_size
        if getattr(self, "graph", None) is not None:
            self.graph.disable(f"the batch size changed to {batch_size}")
        self.nb = skip // batch_size + len(self.train_loader)
        self.accumulate = optim.accumulate_steps(a.nbs, a.batch)
        self.nw = optim.warmup_iters(a.warmup_epochs, self.epochs, self.nb)
        if hasattr(self, "optimizer"):  # weight decay is sized for batch x accumulate (group 1: the weights)
            decay = optim.scaled_weight_decay(a.weight_decay, a.batch, self.accumulate, a.nbs)
            self.optimizer.param_groups[1]["weight_decay"] = decay

    def _progress(self, epoch: int):
        it = self._epoch_batches()
        if not (self.args.verbose and is_main_process()):
            return tqdm(it, total=self.nb, disable=True)
        mem = "GPU_mem" if self.device.type == "cuda" else "CPU_mem"
        cols = ("Epoch", mem, *self.loss_names, "Instances", "Size", "lr")
        tqdm.write(("\n" + "%11s" * len(cols)) % cols)
        return tqdm(it, total=self.nb, bar_format="{l_bar}{bar:10}{r_bar}")

    def _progress_line(self, epoch: int, batch: dict) -> str:
        mem = f"{_memory_gb(self.device):.3g}G"
        lr = self.optimizer.param_groups[1]["lr"]
        return ("%11s" * 2 + "%11.4g" * len(self.loss_names) + "%11i" * 2 + "%11.3g") % (
            f"{epoch + 1}/{self.epochs}", mem, *self.tloss.tolist(), batch["cls"].shape[0],
            batch["img"].shape[-1], lr)

    def save_metrics(self) -> None:
        if not is_main_process():
            return
        tl = self.tloss.tolist() if self.tloss is not None else [float("nan")] * len(self.loss_names)
        row = {"epoch": self.epoch + 1, "time": round(self.train_time, 3),
               **{f"train/{n}": v for n, v in zip(self.loss_names, tl)}}
        row.update({k: self.metrics.get(k, float("nan")) for k in _METRIC_KEYS})
        row.update({f"lr/pg{j}": self.lr.get(f"lr/pg{j}", float("nan")) for j in range(3)})
        row.update(memory_usage(self.device))
        self._write_csv_row(row)
        if self.args.verbose and self.metrics and (self.args.val or self.epoch + 1 == self.epochs):
            self.log(f"{'':>22}mAP50 {self.metrics.get('metrics/mAP50(B)', 0):.4f}  mAP50-95 "
                     f"{self.metrics.get('metrics/mAP50-95(B)', 0):.4f}")

    def _write_csv_row(self, row: dict) -> None:
        new = not self.csv.exists()
        with open(self.csv, "a", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=self._results_columns(), extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})

    def _results_columns(self) -> tuple:
        """RESULTS_COLUMNS, with a loss beyond Ultralytics' three (``train/dis_loss``) after its columns."""
        extra = tuple(f"train/{n}" for n in self.loss_names[3:])
        n = RESULTS_COLUMNS.index("lr/pg2") + 1
        return RESULTS_COLUMNS[:n] + extra + RESULTS_COLUMNS[n:]

    def _checkpoint(self) -> dict:
        args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(self.args).items()}
        return {
            "epoch": self.epoch,
            "best_fitness": self.best_fitness,
            "best_epoch": self.best_epoch,
            # fp32 modules (not halved): resume must continue from exactly these numbers.
            "model": unwrap_model(self.model),
            "ema": self.ema.ema,
            "updates": self.ema.updates,
            "optimizer": self.optimizer.state_dict(),
            "optimizer_auto": self.optimizer_auto,  # what optimizer=auto chose: a resume keeps it
            "scaler": self.scaler.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "train_args": args,
            "train_metrics": dict(self.metrics),
            "train_time": self.train_time,
            "rng": self._rng_state(),
            **distill.checkpoint_state(self.step_model),  # the projectors, for resume (not in model/ema)
            **ckpt_io.checkpoint_meta(),
        }

    def save_model(self) -> None:
        """last.pt every time; best.pt when this epoch has the best fitness; epoch{N}.pt every save_period."""
        # Each rank draws its own augmentations: rank 0's checkpoint holds every rank's RNG state, so that
        # a resumed (or torchrun-restarted) group continues each stream where it stopped.
        rng_ranks = gather_to_rank0(self._rng_state()) if self.world_size > 1 else None
        if not is_main_process():
            return
        ckpt = self._checkpoint()
        if rng_ranks is not None:
            ckpt["rng_ranks"] = rng_ranks
        ckpt_io.save_checkpoint(ckpt, self.last)
        if self.best_epoch == self.epoch:
            ckpt_io.save_checkpoint(ckpt, self.best)
        if self.args.save_period > 0 and (self.epoch + 1) % self.args.save_period == 0:
            ckpt_io.save_checkpoint(ckpt, self.wdir / f"epoch{self.epoch + 1}.pt")

    def _final_eval(self) -> None:
        """The returned metrics are best.pt's: validate it again unless it is the model just validated."""
        if not is_main_process() or not self.best.exists() or self.best_epoch == self.epoch:
            return
        best = ckpt_io.load_checkpoint(self.best, map_location=self.device)
        self.log(f"\nValidating {self.best} (epoch {best['epoch'] + 1})...")
        ema_model = self.ema.ema
        self.ema.ema = best["ema"].to(self.device)
        try:
            self.metrics, self.fitness = self.validate()
        finally:
            self.ema.ema = ema_model
