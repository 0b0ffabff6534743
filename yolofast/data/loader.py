"""Dataset/DataLoader construction: seeding, DDP sampling, worker settings."""

from __future__ import annotations

import itertools
import os
import random

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, get_worker_info

from yolofast.data.batch_ring import BatchRing
from yolofast.data.collate import collate_fn
from yolofast.data.dataset import YOLODataset

__all__ = ["build_dataset", "build_dataloader", "seed_worker", "split_fraction", "EpochSampler"]


class EpochSampler(DistributedSampler):
    """The training order: a pure function of (seed, epoch, rank), also for a single process, so a resumed
    run and a run that changed its batch size mid-epoch (out-of-memory halving) see the same images.

    ``start_at(epoch, n)`` skips the first ``n`` samples of that epoch's order (the ones already trained
    on); the next ``set_epoch`` starts from the beginning again.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.start = 0

    def start_at(self, epoch: int, n: int) -> None:
        super().set_epoch(epoch)
        self.start = max(0, min(int(n), self.num_samples))

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.start, None)

    def __len__(self) -> int:
        return self.num_samples - self.start


def build_dataset(img_path, imgsz=640, augment=True, hyp=None, stride=32, cache=False, prefix="", nc=None,
                  **kwargs):
    """YOLODataset for one split (train: augment=True; val: augment=False, letterbox only); ``kwargs``:
    single_cls, fraction, rect, batch_size, pad (see YOLODataset)."""
    return YOLODataset(img_path, imgsz=imgsz, augment=augment, hyp=hyp, stride=stride, cache=cache,
                       prefix=prefix, nc=nc, **kwargs)


def split_fraction(fraction, split: str):
    """The ``fraction`` of one split: a scalar is the train split's (the others take all), a list is
    [train, val, test] (missing entries: all). A ratio of exactly 1 (or 0 for test) is a float."""
    if isinstance(fraction, (list, tuple)):
        i = ("train", "val", "test").index(split) if split in ("train", "val", "test") else 3
        fraction = fraction[i] if i < len(fraction) else 1.0
    elif split != "train":
        fraction = 1.0
    if fraction in (0, 1):
        fraction = float(fraction)
    if fraction == 0 and split in ("train", "val"):
        raise ValueError(f"fraction: the {split} split must keep at least one image")
    return fraction


def seed_worker(worker_id: int) -> None:
    """worker_init_fn: seed numpy/random and the dataset's generator from the worker's torch seed, which
    the DataLoader derives from its seeded generator -> the same augmentations for the same seed."""
    info = get_worker_info()
    seed = info.seed % 2**32
    np.random.seed(seed)
    random.seed(seed)
    if hasattr(info.dataset, "reseed"):
        info.dataset.reseed(seed)
    # One thread per worker, set once here: W workers x N OpenCV/torch threads would oversubscribe the cores
    # (each worker is one core's worth of samples; collate and pad_targets run in it with torch ops).
    cv2.setNumThreads(0)
    torch.set_num_threads(1)


def build_dataloader(dataset, batch, workers, shuffle, rank=-1, seed=0, drop_last=False, epoch_sampler=False):
    """DataLoader with collate_fn; an EpochSampler when shuffling, rank != -1 or ``epoch_sampler`` (a train
    loader in a fixed order: rect batches) (call sampler.set_epoch each epoch: the order is seeded by
    seed + epoch).

    workers is capped at os.cpu_count(); workers > 0 are persistent (no re-fork per epoch);
    pin_memory only with CUDA. With workers == 0 the dataset's generator is reseeded from seed here.
    """
    nw = max(min(int(workers), os.cpu_count() or 1), 0)
    sampler = None
    if rank != -1:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            sampler = EpochSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)
        else:
            world = int(os.environ.get("WORLD_SIZE", 1))
            sampler = EpochSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                   drop_last=drop_last)
    elif shuffle or epoch_sampler:
        sampler = EpochSampler(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed,
                               drop_last=drop_last)
    generator = torch.Generator()
    generator.manual_seed(seed + max(rank, 0))  # different augmentation streams per rank
    if nw == 0 and hasattr(dataset, "reseed"):
        dataset.reseed(seed + max(rank, 0))
    collate = getattr(dataset, "collate_fn", collate_fn)
    prefetch = _prefetch(dataset, batch) if nw > 0 else None
    if nw > 0 and collate is collate_fn:
        # Workers stack batches into shared blocks they reuse once the main process lets go of them
        # (batch_ring.py): a fresh ~20 MB block per batch cost a worker ~16 ms of a ~65 ms batch.
        collate = BatchRing(collate_fn, nw, slots=prefetch + _SPARE_BLOCKS)
    return DataLoader(
        dataset,
        batch_size=batch,
        sampler=sampler,
        num_workers=nw,
        pin_memory=torch.cuda.is_available(),
        collate_fn=collate,
        worker_init_fn=seed_worker,
        persistent_workers=nw > 0,
        generator=generator,
        drop_last=drop_last,
        prefetch_factor=prefetch,
    )


_RING_BYTES = 256 << 20  # a worker's shared blocks for a deeper queue: at most this much (/dev/shm)
_SPARE_BLOCKS = 2  # a worker's blocks beyond its queue: one batch being read, one the trainer still holds


def _prefetch(dataset, batch: int) -> int:
    """Batches queued per worker: 4 where a worker's 4 + 2 blocks of uint8 images stay under _RING_BYTES
    (batch 16 at 640 px: 6 x 20 MB), else torch's 2.

    Why deeper: batches are handed out in order, so a worker that gets ahead (the other one was preempted,
    or drew slower images) stops when its queue is full, and that core idles. With 2 workers on 2 cores,
    coco128 640 px, batch 16 or 4, a queue of 4 gave 1.018-1.047x the batches per second of 2 (paired
    within 3 runs of 24 alternating rounds, AMD EPYC Zen 4). Large batches vary less from batch to batch
    and would cost more shared memory."""
    side = int(getattr(dataset, "imgsz", 640))
    return 4 if (4 + _SPARE_BLOCKS) * batch * side * side * 3 <= _RING_BYTES else 2
