"""CUDA-graph capture of one whole train iteration (DESIGN §4): forward (autocast), fp32 loss, backward,
clip_grad_norm_(10), optimizer step and EMA update, replayed from static input buffers.

    step = capture_train_step(model, loss_fn, optimizer, ema, example_batch, amp_dtype=torch.bfloat16)
    if step is None: ...  # capture failed; the reason was logged -> run the eager step
    loss, items = step(batch)  # copies img / gt_* into the static buffers and replays

Static shapes are required: the image batch (B, 3, H, W) and the padded GT (B, Mp, ·) must match the
captured ones (``data.collate.pad_targets`` buckets Mp to a multiple of 16; pad to the run's max bucket and
use ``drop_last`` so the last batch has B images). A batch of another shape raises ``ShapeMismatch`` so the
caller can fall back to eager for it. The optimizer must keep its state on the GPU and take tensor lrs
(SGD, or Adam/AdamW with ``capturable=True``); the loss must be the same every ``accumulate`` = 1 step
(no gradient accumulation inside a graph). The ``warmup`` iterations before capture are real training
steps on the example batch (3 by default).

Not wired into the trainer yet (``cuda_graph`` is not a recipe key); written and tested on GPU only
(tests/engine/test_cudagraph.py, marked ``cuda``).
"""

from __future__ import annotations

import logging

import torch

__all__ = ["CudaGraphStep", "ShapeMismatch", "capture_train_step"]

LOG = logging.getLogger("yolofast")
_KEYS = ("img", "gt_cls", "gt_bboxes", "gt_mask")


class ShapeMismatch(ValueError):
    """A batch whose tensors differ in shape/dtype from the captured ones."""


class CudaGraphStep:
    """One captured train iteration. Build it with ``capture_train_step`` (which handles failures)."""

    def __init__(self, model, loss_fn, optimizer, ema, example: dict, amp_dtype=None, max_norm: float = 10.0,
                 warmup: int = 3):
        self.model, self.loss_fn, self.optimizer, self.ema = model, loss_fn, optimizer, ema
        self.amp_dtype, self.max_norm = amp_dtype, max_norm
        self.static = {k: example[k].detach().clone() for k in _KEYS}
        self.graph = torch.cuda.CUDAGraph()
        # Warm up on a side stream: lazy allocations (optimizer state, cuBLAS workspaces, autotuning) must
        # happen before capture, or the capture records a one-off path.
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(warmup):
                self._iteration()
        torch.cuda.current_stream().wait_stream(s)
        self.optimizer.zero_grad(set_to_none=False)  # grads stay allocated: the graph writes into them
        with torch.cuda.graph(self.graph):
            self.loss, self.items = self._iteration()

    def _iteration(self):
        dtype = self.amp_dtype or torch.float32
        with torch.autocast("cuda", dtype=dtype, enabled=self.amp_dtype is not None):
            feats = self.model(self.static["img"])
        loss, items = self.loss_fn([f.float() for f in feats], self.static)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        if self.ema is not None:
            self.ema.update(self.model)
        return loss.detach(), items.detach()

    def __call__(self, batch: dict):
        for k in _KEYS:
            src, dst = batch[k], self.static[k]
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise ShapeMismatch(f"{k}: captured {tuple(dst.shape)} {dst.dtype}, got {tuple(src.shape)} "
                                    f"{src.dtype}")
            dst.copy_(src, non_blocking=True)
        self.graph.replay()
        return self.loss, self.items


def capture_train_step(model, loss_fn, optimizer, ema, example: dict, amp_dtype=None, max_norm: float = 10.0):
    """A ``CudaGraphStep``, or None (reason logged as a warning) when capture is impossible or fails."""
    if not torch.cuda.is_available() or example["img"].device.type != "cuda":
        LOG.warning("cuda_graph: not a CUDA run; using the eager step")
        return None
    if not all(torch.is_tensor(g.get("lr")) for g in optimizer.param_groups):
        # A float lr is baked into the graph as a constant: warmup and the schedule would be ignored.
        LOG.warning("cuda_graph: the optimizer's lr must be a CUDA tensor (set with g['lr'].fill_(v)); "
                    "using the eager step")
        return None
    if type(optimizer).__name__ in ("Adam", "AdamW") and not optimizer.defaults.get("capturable"):
        LOG.warning("cuda_graph: %s needs capturable=True; using the eager step", type(optimizer).__name__)
        return None
    try:
        return CudaGraphStep(model, loss_fn, optimizer, ema, example, amp_dtype, max_norm)
    except Exception as e:  # noqa: BLE001 - any capture error means "run eager", with the reason
        LOG.warning("cuda_graph: capture failed (%s: %s); using the eager step", type(e).__name__, e)
        torch.cuda.synchronize()
        return None
