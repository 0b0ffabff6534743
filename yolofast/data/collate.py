"""Batch collation and GT padding to static (B, Mp, ·) shapes for the loss/assigner kernels."""

from __future__ import annotations

import math

import torch
from torch.utils.data import get_worker_info

__all__ = ["collate_fn", "pad_targets"]


def pad_targets(batch_idx, cls, bboxes, batch_size: int, bucket: int = 16):
    """Scatter flat targets into per-image padded tensors.

    batch_idx (N,) image index of each target (any order); cls (N, 1) or (N,); bboxes (N, 4).
    Returns gt_cls (B, Mp, 1), gt_bboxes (B, Mp, 4), gt_mask (B, Mp, 1) (1 real, 0 padding), in
    bboxes' dtype/device, with Mp = bucket * ceil(max(max_per_image, 1) / bucket): bucketing keeps the
    number of distinct shapes small (compile / CUDA-graph caches) and Mp >= bucket even for N = 0.
    Targets keep their relative order within an image. Fully vectorised (one host sync for Mp).
    """
    device = bboxes.device
    dtype = bboxes.dtype if bboxes.is_floating_point() else torch.float32
    bi = batch_idx.reshape(-1).to(device=device, dtype=torch.long)
    n = bi.numel()
    counts = torch.bincount(bi, minlength=batch_size) if n else torch.zeros(batch_size, dtype=torch.long,
                                                                             device=device)
    if counts.numel() > batch_size:
        raise ValueError(f"pad_targets: batch_idx holds image index {counts.numel() - 1} >= batch_size "
                         f"{batch_size}")
    m = int(counts.max()) if n else 0
    mp = bucket * max(-(-m // bucket), 1)
    gt_cls = torch.zeros(batch_size, mp, 1, dtype=dtype, device=device)
    gt_bboxes = torch.zeros(batch_size, mp, 4, dtype=dtype, device=device)
    gt_mask = torch.zeros(batch_size, mp, 1, dtype=dtype, device=device)
    if n:
        order = torch.argsort(bi, stable=True)
        bs = bi[order]
        starts = torch.cumsum(counts, 0) - counts  # first flat position of each image after sorting
        slot = torch.arange(n, device=device) - starts[bs]
        gt_cls[bs, slot] = cls.reshape(-1, 1)[order].to(dtype)
        gt_bboxes[bs, slot] = bboxes.reshape(-1, 4)[order].to(dtype)
        gt_mask[bs, slot] = 1
    return gt_cls, gt_bboxes, gt_mask


def _worker_shared(shape, dtype):
    """In a loader worker, the batch's image tensor allocated in shared memory (as torch's default collate
    does): else sending it to the main process copies the ~20 MB of a 16 x 640 px batch once more."""
    if get_worker_info() is None:
        return None
    storage = torch.empty(0, dtype=dtype)._typed_storage()._new_shared(math.prod(shape))
    return torch.empty(0, dtype=dtype).new(storage).view(shape)


def collate_fn(batch: list[dict], alloc=None) -> dict:
    """Stack dataset samples into the batch dict of the data contract (see yolofast/data/__init__.py).
    Plans of augment_device samples go into "plans" instead of "img" (preprocess_batch renders them).

    ``alloc(shape, dtype)``, when given, makes the tensor the images are stacked into (loader workers:
    a reused shared block, ``batch_ring.BatchRing``); else a fresh shared block in a worker, plain memory
    in the main process."""
    if "plans" in batch[0] or "tiles" in batch[0]:
        out = _targets(batch)
        out["plans"] = [{k: b[k] for k in ("tiles", "canvas", "M", "out", "hsv", "flipud", "fliplr")}
                        for b in batch]
        return out
    imgs = [b["img"] for b in batch]
    alloc = alloc or _worker_shared
    if all(im.dim() == 3 and im.stride() == (1, 3 * im.shape[2], 3) and im.shape == imgs[0].shape
           for im in imgs):
        # training samples are HWC views: stack the HWC memory (one memcpy each) -> (B, 3, H, W) channels-last
        hwc = [im.permute(1, 2, 0) for im in imgs]
        out = alloc((len(hwc), *hwc[0].shape), hwc[0].dtype)
        imgs = torch.stack(hwc, out=out).permute(0, 3, 1, 2)
    else:
        imgs = torch.stack(imgs, out=alloc((len(imgs), *imgs[0].shape), imgs[0].dtype))
    return {"img": imgs, **_targets(batch)}


def _targets(batch: list[dict]) -> dict:
    cls = torch.cat([b["cls"] for b in batch])
    bboxes = torch.cat([b["bboxes"] for b in batch])
    batch_idx = torch.cat([torch.full((len(b["cls"]),), i, dtype=torch.float32) for i, b in enumerate(batch)])
    gt_cls, gt_bboxes, gt_mask = pad_targets(batch_idx, cls, bboxes, len(batch))
    out = {
        "batch_idx": batch_idx,
        "cls": cls,
        "bboxes": bboxes,
        "im_file": [b["im_file"] for b in batch],
        "ori_shape": [b["ori_shape"] for b in batch],
        "gt_cls": gt_cls,
        "gt_bboxes": gt_bboxes,
        "gt_mask": gt_mask,
    }
    for k in ("resized_shape", "ratio_pad"):
        if k in batch[0]:
            out[k] = [b[k] for b in batch]
    return out
