"""Memory measurement for the per-epoch report, and AutoBatch: the largest batch that fits a GPU budget.

``memory_usage(device) -> {"mem/cpu_rss(GB)": ..., "mem/cuda_reserved(GB)": ...}``: the process's resident
set size now (Linux /proc; 0.0 where unavailable) and the CUDA caching allocator's peak reserved bytes on
``device`` (0.0 on CPU). Reserved rather than allocated: it is what the process holds from the GPU, so it is
what decides an out-of-memory error and what nvidia-smi shows.

AutoBatch (recipe ``batch=-1`` or a fraction in (0, 1), see ``resolve_batch``): ``autobatch`` runs one real
train step (forward, fp32 loss, backward; no optimizer step) of synthetic batches of 1, 2, 4, 8, 16 images
with a padded GT of ``max_gt`` boxes each, records each step's peak *reserved* memory (same reason as above:
the allocator's cached blocks and fragmentation are what run out, not the live tensors), fits
memory = a + s * batch by least squares and picks floor((fraction * total - a) / s). The intercept holds
everything already on the GPU (weights, and optimizer/EMA state if created before the call).
"""

from __future__ import annotations

import gc
import math
import numbers
import os
from collections.abc import Callable, Sequence

import numpy as np
import torch

from yolofast.engine.recovery import is_out_of_memory
from yolofast.loss import fp32_preds

__all__ = ["MEMORY_COLUMNS", "memory_usage", "cpu_rss_gb", "autobatch", "resolve_batch", "max_gt_count",
           "autobatch_gt"]

MEMORY_COLUMNS = ("mem/cpu_rss(GB)", "mem/cuda_reserved(GB)")

DEFAULT_FRACTION = 0.60
MAX_BATCH = 1024
# Padded-GT cap for AutoBatch: 4 x the largest image is the worst case of a mosaic, but the affine crop of
# the 2s x 2s canvas back to s x s keeps about a quarter of it on average, and the assigner's buffers grow
# as B*M*A (at 640 px A = 8400: M = 256 is already ~9 MB per fp32 (M, A) tensor per image). Profiling a
# larger M would shrink the batch for boxes real batches almost never hold; the trainer's first-epoch OOM
# recovery (halve the batch) covers the rare outlier.
MAX_AUTOBATCH_GT = 256
_GiB = 2**30


def cpu_rss_gb() -> float:
    try:  # /proc/self/statm: size resident shared ... in pages
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def memory_usage(device: torch.device | str = "cpu") -> dict:
    device = torch.device(device)
    cuda = 0.0
    if device.type == "cuda" and torch.cuda.is_available():
        cuda = torch.cuda.max_memory_reserved(device) / 1e9
    return {MEMORY_COLUMNS[0]: round(cpu_rss_gb(), 4), MEMORY_COLUMNS[1]: round(cuda, 4)}


# -- recipe value and GT size


def resolve_batch(batch) -> tuple[bool, float]:
    """Recipe ``batch`` -> (autobatch wanted, memory fraction): -1 -> (True, 0.60); a float in (0, 1) ->
    (True, batch); an int >= 1 -> (False, 0.0). Anything else raises ValueError."""
    if isinstance(batch, numbers.Integral) and not isinstance(batch, bool):
        if batch == -1:
            return True, DEFAULT_FRACTION
        if batch >= 1:
            return False, 0.0
    elif isinstance(batch, numbers.Real) and not isinstance(batch, bool) and 0.0 < float(batch) < 1.0:
        return True, float(batch)
    raise ValueError(f"batch={batch!r} is not valid: use an int >= 1 (images per step), -1 (AutoBatch at "
                     f"{DEFAULT_FRACTION:.0%} of GPU memory) or a fraction in (0, 1) (AutoBatch at that "
                     f"share of GPU memory)")


def max_gt_count(dataset) -> int:
    """The most labels one image of ``dataset`` has (``dataset.labels[i]["cls"]``), at least 1."""
    return max([1, *(len(lb["cls"]) for lb in dataset.labels)])


def autobatch_gt(dataset, mosaic: float) -> int:
    """Padded GT size (bucket of 16, as data.collate.pad_targets) for AutoBatch: 4 x max_gt_count when
    mosaic > 0 (a mosaic joins 4 images), else max_gt_count; capped at MAX_AUTOBATCH_GT (why: see there)."""
    n = max_gt_count(dataset) * (4 if mosaic > 0 else 1)
    return min(16 * math.ceil(n / 16), MAX_AUTOBATCH_GT)


# -- one profiled step


def _synthetic_batch(b: int, imgsz: int, nc: int, max_gt: int, device: torch.device):
    # A private generator: AutoBatch must not move the global RNG a seeded run depends on.
    g = torch.Generator(device=device).manual_seed(0)
    img = torch.rand(b, 3, imgsz, imgsz, generator=g, device=device)
    xy = torch.rand(b, max_gt, 2, generator=g, device=device) * 0.6 + 0.2
    wh = torch.rand(b, max_gt, 2, generator=g, device=device) * 0.2 + 0.05
    gt = {"gt_cls": torch.randint(0, max(nc, 1), (b, max_gt, 1), generator=g, device=device).float(),
          "gt_bboxes": torch.cat([xy, wh], -1),
          "gt_mask": torch.ones(b, max_gt, 1, device=device)}  # all real: the assigner's worst case
    return img, gt


def _train_step(model, loss_fn, imgsz: int, b: int, max_gt: int, device: torch.device, amp_dtype=None):
    """Forward (under autocast when amp_dtype is given) + fp32 loss + backward of a synthetic batch of b."""
    nc = getattr(loss_fn, "nc", None) or getattr(model, "nc", 1)
    img, gt = _synthetic_batch(b, imgsz, nc, max_gt, device)
    with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
        feats = model(img)
    loss, _ = loss_fn(fp32_preds(feats), gt)
    loss.backward()


class _KeepState:
    """Restores train/eval mode, buffers (BatchNorm running stats move in a train-mode forward) and .grad of
    every parameter on exit, so profiling leaves the model exactly as it found it."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __enter__(self):
        m = self.model
        self.training = m.training
        self.buffers = [(b, b.detach().clone()) for b in m.buffers()]
        self.grads = [(p, p.grad) for p in m.parameters()]
        for p in m.parameters():
            p.grad = None  # the first backward allocates the grads: part of the measured peak
        m.train()
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        for p, g in self.grads:
            p.grad = g
        self.model.train(self.training)
        return False


# -- AutoBatch


def _measure(profile: Callable[[int], int], batch_sizes: Sequence[int], log):
    """-> (sizes, bytes, first size that ran out of memory or None)."""
    sizes, mems, oom_at = [], [], None
    for b in batch_sizes:
        try:
            mem = int(profile(int(b)))
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_out_of_memory(e):
                raise
            oom_at = int(b)
            log(f"AutoBatch: batch {b} ran out of memory; larger sizes are not profiled")
            break
        sizes.append(int(b))
        mems.append(mem)
    return sizes, mems, oom_at


def autobatch(model: torch.nn.Module, loss_fn, imgsz: int, device, fraction: float = DEFAULT_FRACTION,
              max_gt: int = 16, amp_dtype=None, batch_sizes: Sequence[int] = (1, 2, 4, 8, 16),
              default: int = 16, profile: Callable[[int], int] | None = None, total_memory: int | None = None,
              log: Callable[[str], None] = print) -> int:
    """The batch size whose train step is predicted to use ``fraction`` of the GPU's memory.

    profile: ``profile(b) -> peak bytes`` (or raises torch.OutOfMemoryError); default: one real CUDA train
    step of ``model``/``loss_fn`` at ``imgsz`` with ``max_gt`` padded boxes per image. Without a profile on
    a non-CUDA device the ``default`` batch is returned (logged). total_memory: bytes of the device
    (default: torch.cuda.get_device_properties(device).total_memory).
    """
    device = torch.device(device)
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"autobatch: fraction={fraction} must be in (0, 1]")
    real = profile is None
    if real:
        if device.type != "cuda" or not torch.cuda.is_available():
            log(f"AutoBatch: needs a CUDA device ({device} given); keeping the default batch {default}")
            return default

        def profile(b: int) -> int:
            gc.collect()
            torch.cuda.empty_cache()  # so the peak is this batch's own, not blocks cached by a larger one
            torch.cuda.reset_peak_memory_stats(device)
            try:
                _train_step(model, loss_fn, imgsz, b, max_gt, device, amp_dtype)
                torch.cuda.synchronize(device)
                return torch.cuda.max_memory_reserved(device)
            finally:
                model.zero_grad(set_to_none=True)

    if total_memory is None:
        if device.type != "cuda":
            raise ValueError(f"autobatch: pass total_memory with a custom profile on {device}")
        total_memory = torch.cuda.get_device_properties(device).total_memory

    with _KeepState(model):
        sizes, mems, oom_at = _measure(profile, sorted(batch_sizes), log)
    if real:
        gc.collect()
        torch.cuda.empty_cache()
    if sizes:
        log("AutoBatch: measured " + ", ".join(f"b{b} {m / _GiB:.2f} GiB" for b, m in zip(sizes, mems)))

    fallback = sizes[-1] if oom_at is not None and sizes else default
    if len(sizes) < 2:
        log(f"AutoBatch: only {len(sizes)} batch size(s) could be profiled, no fit; using batch {fallback}")
        return fallback
    s, a = np.polyfit(np.asarray(sizes, float), np.asarray(mems, float), 1)
    if not s > 0:
        log(f"AutoBatch: memory does not grow with the batch (slope {s / _GiB:.3g} GiB/image over {sizes}); "
            f"using batch {fallback}")
        return fallback
    free = fraction * total_memory
    # +1e-6: a fit of an exactly linear profile may land a hair below a whole number of images.
    batch = min(max(math.floor((free - a) / s + 1e-6), 1), MAX_BATCH)
    if free < a + s:
        log(f"AutoBatch: even batch 1 is predicted over {fraction:.0%} of memory ({(a + s) / _GiB:.2f} GiB)")
    if oom_at is not None and batch >= oom_at:
        log(f"AutoBatch: the fit asks for {batch} but batch {oom_at} ran out of memory; using {sizes[-1]}, "
            f"the largest that fitted")
        batch = sizes[-1]
    log(f"AutoBatch: batch {batch} for {fraction:.0%} of {total_memory / _GiB:.1f} GiB "
        f"(predicted {(a + s * batch) / _GiB:.1f} GiB)")
    return batch
