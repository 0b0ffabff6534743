"""The trainer's data loaders: what ``Trainer.get_dataloader`` builds from the recipe, the train loader
rebuilt at another batch size (AutoBatch, out-of-memory halving), one epoch's batches across such a
rebuild, and a batch onto the device (``Trainer.preprocess_batch``). Kept out of ``trainer.py`` so the
loop reads top to bottom; the Trainer's hooks call these."""

from __future__ import annotations

import random

import torch

from yolofast.cfg import CfgError
from yolofast.engine import cudagraph
from yolofast.engine.compile import compile_mode
from yolofast.engine.distributed import unwrap_model
from yolofast.engine.multiscale import random_size, resize_batch

__all__ = ["build_loader", "close_mosaic", "epoch_batches", "halved_batch", "rebuild_train_loader",
           "static_batches", "to_device"]

_HYP = ("hsv_h", "hsv_s", "hsv_v", "degrees", "translate", "scale", "shear", "perspective", "flipud",
        "fliplr", "mosaic", "mixup", "bgr", "cutmix", "copy_paste")


def build_loader(t, img_path, batch_size: int, mode: str):
    """A data loader over ``img_path``: augmented and shuffled for "train", plain for "val"."""
    from yolofast.data import build_dataloader, build_dataset
    from yolofast.data.loader import split_fraction

    a = t.args
    train = mode == "train"
    stride = max(int(unwrap_model(t.model).stride.max()), 32) if t.model is not None else 32
    # Ultralytics validates in rect batches (half a stride of padding): with map_convention=ultralytics
    # to reproduce its numbers, or when rect=True asks for them.
    rect = a.rect if train else (a.rect or a.map_convention == "ultralytics")
    try:
        fraction = split_fraction(a.fraction, "train" if train else a.split)
    except ValueError as e:
        raise CfgError(str(e)) from None
    dataset = build_dataset(img_path, imgsz=a.imgsz, augment=train, hyp={k: getattr(a, k) for k in _HYP},
                            stride=stride, cache=a.cache, prefix=f"{mode}: ",
                            nc=t.data.get("label_nc", t.data["nc"]), single_cls=a.single_cls,
                            fraction=fraction, rect=rect, batch_size=batch_size, pad=0.0 if train else 0.5,
                            augment_device=_augment_device(t) if train else None)
    rank = t.rank if train else -1  # validation runs on rank 0 over the whole split
    return build_dataloader(dataset, batch_size, a.workers, shuffle=train and not rect, rank=rank,
                            seed=a.seed, epoch_sampler=train,
                            drop_last=train and static_batches(t, len(dataset), batch_size))


def _augment_device(t):
    """augment_device=true: the training device; a device name as given; null/false: augment on the CPU."""
    dev = getattr(t.args, "augment_device", None)
    return str(t.device) if dev is True else (dev or None)


def static_batches(t, n_images: int, batch_size: int) -> bool:
    """Drop an epoch's short last batch when the step is compiled or graphed: a batch of another size
    is one more compile (or an eager step beside the graph). The order is reshuffled every epoch, so
    no image is left out for good."""
    graphed = t.args.cuda_graph and t.device.type == cudagraph.GRAPH_DEVICE
    static = compile_mode(t.args.compile)[0] or graphed
    return static and n_images >= batch_size


def rebuild_train_loader(t, batch_size: int, epoch: int, skip: int = 0):
    """A train loader over the same dataset as ``t.train_loader`` at ``batch_size`` (per rank), starting
    ``skip`` images into ``epoch``'s order (``Trainer.rebuild_train_loader`` adopts it: batches per
    epoch, accumulation and weight decay follow the new size)."""
    from yolofast.data import build_dataloader

    a = t.args
    ds = t.train_loader.dataset
    if getattr(ds, "rect", False) and skip == 0:  # mid-epoch, halved_batch keeps the rect batches whole
        ds.set_rect_batch_size(batch_size)
    new = build_dataloader(ds, batch_size, a.workers, shuffle=not getattr(ds, "rect", False), rank=t.rank,
                           seed=a.seed, epoch_sampler=True, drop_last=static_batches(t, len(ds), batch_size))
    new.sampler.start_at(epoch, skip)
    return new


def halved_batch(ds, old: int, skip: int) -> int:
    """The batch size after an out-of-memory halving of ``old`` with ``skip`` images of the epoch done.

    Half of it, except for rect batches mid-epoch: their images are letterboxed to the shape of their rect
    batch, so the new size is the largest divisor of ``old`` up to ``old // 2``
    (``old`` divides the rect batch): every new batch is then a whole piece of one rect batch and keeps its
    shape, where ``old // 2`` of an odd ``old`` (7 of 15) would stack two shapes into one batch. At an
    epoch's start the rect batches are re-cut for the new size instead (``rebuild_train_loader``)."""
    new = old // 2
    if getattr(ds, "rect", False) and skip:
        new = max(d for d in range(1, new + 1) if old % d == 0)
    return new


def epoch_batches(t):
    """(i, batch, images before it in the epoch) over one epoch. When an out-of-memory halving replaces
    the loader mid-epoch (it starts where the old one failed: the images-before count), the rest of the
    epoch comes from the new one, numbered in its batches."""
    i, loader, done = 0, t.train_loader, 0
    while True:
        for batch in loader:
            yield i, batch, done
            if t.train_loader is not loader:
                break
            i += 1
            done += len(batch["im_file"])  # also for augment_device batches (no "img" yet)
        else:
            return
        loader = t.train_loader
        i = t.nb - len(loader)
        if t.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the failed step's cached blocks back before the smaller one


def close_mosaic(loader) -> None:
    """The last ``close_mosaic`` epochs train without mosaic (when the loader's dataset has one)."""
    ds = getattr(loader, "dataset", None)
    if hasattr(ds, "close_mosaic"):
        ds.close_mosaic()


def to_device(batch: dict, device: torch.device, channels_last: bool, args, stride: int) -> dict:
    """Tensors to ``device`` (non_blocking), images to float in [0, 1] (NHWC with ``channels_last``); an
    augment_device batch's plans rendered there; with multi_scale, a random size per batch around imgsz
    rounded to ``stride`` (multiscale.py)."""
    if "plans" in batch:  # augment_device: the loader sent plans, the device renders the images
        from yolofast.data.device_aug import apply_plans

        batch = {**batch, "img": apply_plans(batch["plans"], device)}
    out = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
    # Training images arrive channels-last uint8: layout and scaling in one pass here, on the device.
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out["img"] = out["img"].to(torch.float32, memory_format=fmt).div_(255)
    if args.multi_scale:
        size = random_size(args.imgsz, args.multi_scale, stride, random)
        out["img"] = resize_batch(out["img"], size, stride)
    if channels_last:
        out["img"] = out["img"].contiguous(memory_format=torch.channels_last)
    return out
