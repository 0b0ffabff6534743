"""How a run is built, one function per part, each returning what it builds (``Trainer._setup_train``
calls them in order and keeps the results in ``trainer.parts``; the doctor calls the same ones):

    channels_last(args, device) -> bool          the memory layout of the model and the images
    build_model(t, src, channels_last)          t.get_model(src) on the device, in train mode (+ SyncBN)
    recipe_model(t, cfg, weights)               what the default get_model builds: (model, frozen)
    rank_batch(args, world_size) -> int         the per-rank batch before AutoBatch
    recipe_loss(t, model)                       what the default get_loss builds
    build_loss(t, model) -> LossParts            t.get_loss(model), and the distillation step around it
    auto_batch(t, step_model, step_loss)        AutoBatch's batch (batch=-1 / a fraction), or None
    build_optimizer(t, step_model, ...)          the recipe's optimizer (optim.recipe_optimizer)
    step_blockers(t, accumulate) / build_graph   the CUDA-graph step, when cuda_graph=True and possible
    recipe_validator(t)                          what the default get_validator builds

They read the trainer (its recipe, data, device and hooks) and write none of its attributes. A hook reads
what is built before it from ``trainer.parts`` (get_dataloader the model's stride, get_loss the train
labels for cls_pw), which is why the order is the Trainer's to keep.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import NamedTuple

import torch
import yaml
from torch import nn

from yolofast.cfg import DEFAULTS, CfgError, quantize_half
from yolofast.engine import distill, elastic, model_keys, optim
from yolofast.engine.autobatch import autobatch, autobatch_gt, resolve_batch
from yolofast.engine.compile import compile_mode
from yolofast.engine.cudagraph import GraphedTrainStep, graph_blockers, optimizer_kwargs
from yolofast.engine.device import adjust_cpu_threads
from yolofast.engine.distributed import is_main_process, unwrap_model

__all__ = ["LossParts", "auto_batch", "build_graph", "build_loss", "build_model", "build_optimizer",
           "channels_last", "model_stride", "rank_batch", "recipe_loss", "recipe_model", "recipe_validator",
           "step_blockers", "write_run_dir"]
_VAL_CONF = 0.001  # what conf=None means for validation (Ultralytics' val default)


def write_run_dir(t) -> None:
    """weights/, the elastic-restart mark and args.yaml (rank 0)."""
    if not is_main_process():
        return
    t.wdir.mkdir(parents=True, exist_ok=True)
    elastic.mark_run(t.save_dir)  # where a torchrun restart finds this run (elastic.py)
    _write_args(t)


def _write_args(t) -> None:
    with open(t.save_dir / "args.yaml", "w", encoding="utf-8") as f:
        yaml.safe_dump({k: (str(v) if isinstance(v, Path) else v) for k, v in vars(t.args).items()}, f,
                       sort_keys=False)


def channels_last(args, device: torch.device) -> bool:
    # NHWC lets oneDNN/cuDNN pick their fast conv kernels: on the 2-core dev CPU the yolov8n step ran
    # 1.19x faster in fp32 (21.7 vs 18.2 images/s) and 1.08x in bf16 (36.9 vs 34.0).
    return device.type in ("cuda", "cpu") and args.channels_last is not False


def build_model(t, src, nhwc: bool) -> nn.Module:
    """``t.get_model(src)`` on the trainer's device, NHWC when ``nhwc``, in train mode; SyncBatchNorm with
    sync_bn under DDP on CUDA."""
    model = t.get_model(src).to(t.device)
    if nhwc:
        model.to(memory_format=torch.channels_last)
    model.train()
    if t.args.sync_bn:
        if t.world_size > 1 and t.device.type == "cuda":
            return nn.SyncBatchNorm.convert_sync_batchnorm(model)
        warnings.warn("sync_bn=True needs DDP on CUDA (torchrun with nccl); BatchNorm statistics stay per "
                      "process", stacklevel=3)
    return model


def recipe_model(t, cfg=None, weights=None) -> tuple[nn.Module, list[str]]:
    """What ``Trainer.get_model`` builds: an nn.Module as given, a yolofast checkpoint's weights, or a fresh
    build (with ``pretrained=path``'s weights); then ``weights``, the names, the DFL's fixed bins frozen and
    the recipe's ``freeze``. Returns (model, the frozen layer prefixes)."""
    from yolofast.nn import build_model as build_net

    a, nc, names = t.args, t.data["nc"], t.data["names"]
    if isinstance(cfg, nn.Module):
        model = cfg
        if getattr(model, "nc", nc) != nc:
            raise CfgError(f"the given model predicts {model.nc} classes but data '{a.data}' has "
                           f"nc={nc}; build it with build_model(cfg, nc={nc})")
    elif isinstance(cfg, (str, Path)) and str(cfg).endswith(".pt"):
        from yolofast.io.transfer import model_from_weights

        model = model_from_weights(cfg, nc, names, log=t.log, load=a.pretrained is not False,
                                   remap=a.cls_remap)
    else:
        model = build_net(cfg, nc=nc, verbose=a.verbose and is_main_process())
        if isinstance(a.pretrained, str):  # pretrained=path: that file's weights into `model`
            from yolofast.io.transfer import load_weights

            load_weights(model, a.pretrained, names, remap=a.cls_remap, log=t.log)
    if weights is not None:
        model.load_state_dict(weights.state_dict() if isinstance(weights, nn.Module) else weights)
    model.names = names
    for n, p in model.named_parameters():  # the DFL's fixed 0..15 bin weights stay frozen (DDP needs
        p.requires_grad_(".dfl." not in n)  # every trainable parameter to get a gradient)
    return model, model_keys.apply_freeze(model, a, t.log)


def model_stride(model: nn.Module) -> int:
    """The largest stride, at least 32: multi_scale rounds its sizes to it."""
    return max(int(unwrap_model(model).stride.max()), 32)


def rank_batch(args, world_size: int) -> int:
    """Per-rank batch: batch / world size, or Ultralytics' 16 while AutoBatch has not chosen."""
    auto, _ = resolve_batch(args.batch)
    return max(DEFAULTS["batch"] if auto else args.batch // world_size, 1)


def recipe_loss(t, model: nn.Module):
    """What ``Trainer.get_loss`` builds: the criterion for ``model`` (DetectionLoss, or E2EDetectionLoss
    for an end2end model) with the recipe's box/cls/dfl gains and ``cls_pw``'s class weights, on the
    trainer's device."""
    from yolofast.loss import criterion_for

    m = unwrap_model(model)
    weights = model_keys.class_weights_for(t, m.nc)  # cls_pw
    a = t.args
    loss = criterion_for(m, box=a.box, cls=a.cls, dfl=a.dfl, epochs=t.epochs, class_weights=weights)
    return loss.to(t.device) if isinstance(loss, nn.Module) else loss


class LossParts(NamedTuple):
    criterion: object  # get_loss(model)
    step_model: nn.Module  # the model, or with distill_model the student + projectors + frozen teacher
    step_loss: object  # the criterion, or with distill_model the criterion + dis x L_dis
    extra_names: list  # loss items beyond the criterion's (dis_loss)


def build_loss(t, model: nn.Module) -> LossParts:
    """``t.get_loss(model)`` (after the train loader: cls_pw counts its labels) and, with distill_model,
    the distillation step around model and loss (engine/distill.py)."""
    criterion = t.get_loss(model)
    step_model, step_loss, extra = distill.train_step(model, criterion, t.args, t.data["names"], t.device,
                                                      channels_last(t.args, t.device))
    return LossParts(criterion, step_model, step_loss, list(extra))


def auto_batch(t, step_model, step_loss, train_loader) -> int | None:
    """With batch=-1 or a fraction: the largest batch whose step fits that fraction of the GPU, at the
    data's largest GT count (autobatch.py); None when the batch is given."""
    a = t.args
    auto, fraction = resolve_batch(a.batch)
    if not auto:
        return None
    if t.world_size > 1:
        # Profiling on rank 0 alone would run SyncBN / DDP collectives the other ranks never join.
        t.log(f"AutoBatch: single-process only; under DDP keeping batch {DEFAULTS['batch']} per rank "
              f"(pass batch=N for another size)")
        return None
    max_gt = autobatch_gt(train_loader.dataset, a.mosaic)
    return autobatch(step_model, step_loss, a.imgsz, t.device, fraction, max_gt=max_gt,
                     amp_dtype=t.amp_dtype, default=DEFAULTS["batch"], log=t.log)


def step_blockers(t, accumulate: int, scaler) -> list[str] | None:
    """None without cuda_graph; else why the step cannot be graphed ([] when it can: graph_blockers)."""
    a = t.args
    if not a.cuda_graph:
        return None
    why = graph_blockers(t.device, compile_mode(a.compile)[0], t.world_size > 1, accumulate,
                         scaler.is_enabled())
    if a.multi_scale or a.rect:  # a graph replays one input shape
        why.append(f"{'multi_scale' if a.multi_scale else 'rect'} changes the input shape per batch")
    return why


def build_optimizer(t, step_model: nn.Module, n_images: int, accumulate: int, graphed: bool = False,
                    resumed_auto=None, args=None):
    """The recipe's optimizer over ``step_model``: (optimizer, what optimizer=auto chose or None, momentum,
    warmup bias lr), from optim.recipe_optimizer. ``args``: the recipe when not ``t.args`` (the doctor's,
    with the batch it runs)."""
    out = optim.recipe_optimizer(step_model, args or t.args, n_images, accumulate, t.data["nc"],
                                 resumed_auto, extra=optimizer_kwargs if graphed else None, log=t.log)
    if out[1] is not None and args is None and is_main_process():  # optimizer=auto rewrote the recipe:
        _write_args(t)  # args.yaml says what ran, as the checkpoints' train_args do
    return out


def build_graph(t, why: list[str] | None, parts) -> GraphedTrainStep | None:
    """The CUDA-graph step over ``parts`` (captured after the warmup: cudagraph.py), or None (with a
    warning saying why when cuda_graph=True asked for one)."""
    if why is None:
        return None
    if why:
        warnings.warn(f"cuda_graph=True but {'; '.join(why)}: using the eager step", stacklevel=3)
        return None
    bucket = autobatch_gt(parts.train_loader.dataset, t.args.mosaic)  # GT rows of the captured batch
    return GraphedTrainStep(parts.step_model, parts.train_loss, parts.optimizer, parts.ema, parts.amp_dtype,
                            gt_bucket=bucket, batch_size=parts.batch_size, max_norm=t.max_norm)


def recipe_validator(t):
    """What ``Trainer.get_validator`` builds: the Validator over ``t.val_loader`` with the validation loss
    (``t.criterion``), the recipe's conf/iou/nms/max_det and the run's predictions.json."""
    from yolofast.val import Validator
    from yolofast.val.validator import raise_max_det

    a = t.args
    # max_det left at 300 follows the most labels of one train or val image (as Ultralytics 8.4 does)
    max_det = raise_max_det(a.max_det, *(getattr(getattr(dl, "dataset", None), "labels", None) or []
                                         for dl in (t.train_loader, t.val_loader)))
    return Validator(t.val_loader, t.data["names"], conf=_VAL_CONF if a.conf is None else a.conf,
                     iou=a.iou, nms=a.nms,  # None: one-to-many + NMS, so fitness is Ultralytics'
                     max_det=max_det, loss=t.criterion, device=t.device,
                     half=quantize_half(a.quantize, t.amp_dtype is not None),
                     progress=a.verbose and is_main_process(), map_convention=a.map_convention,
                     save_json=t.save_dir / "predictions.json" if a.save_json else None,
                     coco_json=t.data.get("coco_json"))


def epoch_threads(t, restore: bool = False) -> None:
    """A CPU run's torch threads for the next epoch (``device.adjust_cpu_threads``): the run's own
    count, or with ``deterministic=False`` the cores other processes leave free; at most the count at the
    start. ``restore``: the count at the start again (the run is over)."""
    if restore:
        if t.parts.cpu_threads:
            torch.set_num_threads(t.parts.cpu_threads)
    elif t.device.type == "cpu":
        t.parts.cpu_threads = t.parts.cpu_threads or torch.get_num_threads()
        adjust_cpu_threads(t.parts.cpu_threads, not t.args.deterministic, t.log)
