"""Dataset/DataLoader construction: seeding, DDP sampling, worker settings."""

from __future__ import annotations

import os
import random

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, get_worker_info

from yolofast.data.collate import collate_fn
from yolofast.data.dataset import YOLODataset

__all__ = ["build_dataset", "build_dataloader", "seed_worker"]


def build_dataset(img_path, imgsz=640, augment=True, hyp=None, stride=32, cache=False, prefix="", nc=None):
    """YOLODataset for one split (train: augment=True; val: augment=False, letterbox only)."""
    return YOLODataset(img_path, imgsz=imgsz, augment=augment, hyp=hyp, stride=stride, cache=cache,
                       prefix=prefix, nc=nc)


def seed_worker(worker_id: int) -> None:
    """worker_init_fn: seed numpy/random and the dataset's generator from the worker's torch seed, which
    the DataLoader derives from its seeded generator -> the same augmentations for the same seed."""
    info = get_worker_info()
    seed = info.seed % 2**32
    np.random.seed(seed)
    random.seed(seed)
    if hasattr(info.dataset, "reseed"):
        info.dataset.reseed(seed)
    cv2.setNumThreads(0)  # one OpenCV thread per worker: W workers x N threads would oversubscribe 2 cores


def build_dataloader(dataset, batch, workers, shuffle, rank=-1, seed=0, drop_last=False):
    """DataLoader with collate_fn; DistributedSampler when rank != -1 (call sampler.set_epoch each epoch).

    workers is capped at os.cpu_count(); workers > 0 are persistent (no re-fork per epoch);
    pin_memory only with CUDA. With workers == 0 the dataset's generator is reseeded from seed here.
    """
    nw = max(min(int(workers), os.cpu_count() or 1), 0)
    sampler = None
    if rank != -1:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            sampler = DistributedSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)
        else:
            world = int(os.environ.get("WORLD_SIZE", 1))
            sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                         drop_last=drop_last)
    generator = torch.Generator()
    generator.manual_seed(seed + max(rank, 0))  # different augmentation streams per rank
    if nw == 0 and hasattr(dataset, "reseed"):
        dataset.reseed(seed + max(rank, 0))
    return DataLoader(
        dataset,
        batch_size=batch,
        shuffle=shuffle and sampler is None,
        sampler=sampler,
        num_workers=nw,
        pin_memory=torch.cuda.is_available(),
        collate_fn=getattr(dataset, "collate_fn", collate_fn),
        worker_init_fn=seed_worker,
        persistent_workers=nw > 0,
        generator=generator,
        drop_last=drop_last,
    )
