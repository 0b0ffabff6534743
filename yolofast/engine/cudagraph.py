"""CUDA-graph capture of one whole train iteration (DESIGN §4): forward (autocast), fp32 loss, backward,
clip_grad_norm_(10), optimizer step and EMA update, replayed from static input buffers.

    step = capture_train_step(model, loss_fn, optimizer, ema, example_batch, amp_dtype=torch.bfloat16)
    if step is None: ...  # capture failed; the reason was logged -> run the eager step
    loss, items, grad_norm = step(batch)  # copies img / gt_* into the static buffers and replays

Static shapes are required: the image batch (B, 3, H, W) and the padded GT (B, Mp, ·) must match the
captured ones (``data.collate.pad_targets`` buckets Mp to a multiple of 16; pad to the run's max bucket and
use ``drop_last`` so the last batch has B images). A batch of another shape raises ``ShapeMismatch`` so the
caller can fall back to eager for it. The optimizer must keep its state on the GPU and take tensor lrs
(``fused=True`` SGD, or Adam-type with ``capturable=True``: ``optimizer_kwargs``); the loss must step every
batch (accumulate = 1: no gradient accumulation inside a graph). The ``warmup`` iterations before capture
(lazy allocations must not happen inside it) run on the example batch and are then undone: model, optimizer
and EMA are put back, so the example batch is trained on exactly once, by the first replay.

In the trainer (``cuda_graph=True``): ``GraphedTrainStep`` captures at the first batch after the lr/momentum
warmup (momentum is a constant inside the graph), replays it for every batch of the captured shape and lets
the trainer run the eager step for the others (the short last batch, more GT than the bucket) and for
everything after a capture failure or a non-finite loss. ``graph_blockers`` lists what rules a graph out.
Tested on GPU by tests/engine/test_cudagraph.py (marked ``cuda``, run by benchmarks/gpu_check.sh), and in CI
on the CPU through ``GRAPHS``/``GRAPH_DEVICE``: tests/graph_emulator.py puts a recording stand-in for
``torch.cuda``'s graph API there, so this file's capture/replay logic and the trainer's graph path run
without a GPU (what the stand-in does and does not model is said in that file).
"""

from __future__ import annotations

import copy
import logging

import torch

from yolofast.loss import fp32_preds

__all__ = ["CudaGraphStep", "GraphedTrainStep", "ShapeMismatch", "capture_train_step", "graph_blockers",
           "has_state", "optimizer_kwargs", "pad_gt"]

LOG = logging.getLogger("yolofast")
# What capture uses of torch.cuda (CUDAGraph, graph, Stream, stream, current_stream, synchronize,
# empty_cache, is_available) and the device type it runs on; the CPU emulator of the tests replaces both.
GRAPHS = torch.cuda
GRAPH_DEVICE = "cuda"
_KEYS = ("img", "gt_cls", "gt_bboxes", "gt_mask")


class ShapeMismatch(ValueError):
    """A batch whose tensors differ in shape/dtype from the captured ones."""


def _state(model, optimizer, ema) -> dict:
    """What the warm-up steps change, to be put back in place. In place matters for the optimizer: its
    load_state_dict would swap in new tensors (a tensor lr too), so the caller's lr tensor would no longer
    be the one the graph reads."""
    opt = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    opt += [v for g in optimizer.param_groups for v in g.values() if torch.is_tensor(v)]
    return {"model": copy.deepcopy(model.state_dict()), "optimizer": [(t, t.detach().clone()) for t in opt],
            "ema": copy.deepcopy(ema.state_dict()) if ema is not None else None}


@torch.no_grad()
def _load_state(saved: dict, model, optimizer, ema) -> None:
    model.load_state_dict(saved["model"])  # copies in place, as ModelEMA.load_state_dict does
    for t, before in saved["optimizer"]:
        t.copy_(before)
    if ema is not None:
        ema.load_state_dict(saved["ema"])


class CudaGraphStep:
    """One captured train iteration. Build it with ``capture_train_step`` (which handles failures)."""

    def __init__(self, model, loss_fn, optimizer, ema, example: dict, amp_dtype=None, max_norm: float = 10.0,
                 warmup: int = 3):
        self.model, self.loss_fn, self.optimizer, self.ema = model, loss_fn, optimizer, ema
        self.amp_dtype, self.max_norm = amp_dtype, max_norm
        self.static = {k: example[k].detach().clone() for k in _KEYS}
        self.graph = GRAPHS.CUDAGraph()
        # Warm up on a side stream: lazy allocations (optimizer state, cuBLAS workspaces, autotuning) must
        # happen before capture, or the capture records a one-off path.
        saved = _state(model, optimizer, ema)
        try:
            s = GRAPHS.Stream()
            s.wait_stream(GRAPHS.current_stream())
            with GRAPHS.stream(s):
                for _ in range(warmup):
                    self._iteration()
            GRAPHS.current_stream().wait_stream(s)
        finally:  # undo the warm-up steps, also when one failed: they were not training
            _load_state(saved, model, optimizer, ema)
            del saved
        # The graph allocates from a private pool, which cannot reuse the blocks the caching allocator holds
        # for eager steps (the warm-up's, the lr warmup's): hand those back first, or the device holds the
        # step's activations twice and a batch AutoBatch sized for one eager step runs out of memory here.
        GRAPHS.empty_cache()
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:  # grads stay allocated: the graph accumulates into exactly these tensors
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()
        self.grads = [p.grad for p in self.params]
        # thread_local: the loader's pin-memory thread may allocate pinned host memory during the capture;
        # the default "global" mode would count that as an illegal call and break the capture (and the
        # pinning thread with it).
        with GRAPHS.graph(self.graph, capture_error_mode="thread_local"):
            self.loss, self.items, self.grad_norm = self._iteration()

    def _iteration(self):
        dtype = self.amp_dtype or torch.float32
        with torch.autocast(GRAPH_DEVICE, dtype=dtype, enabled=self.amp_dtype is not None):
            feats = self.model(self.static["img"])
        loss, items = self.loss_fn(fp32_preds(feats), self.static)
        loss.backward()
        # The pre-clip norm comes out of the graph like the loss: the trainer's statistics of it
        # (gradnorm.py) then read the replayed steps' norms too.
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        if self.ema is not None:
            self.ema.update(self.model)
        return loss.detach(), items.detach(), norm.detach()

    def __call__(self, batch: dict):
        for k in _KEYS:
            src, dst = batch[k], self.static[k]
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise ShapeMismatch(f"{k}: captured {tuple(dst.shape)} {dst.dtype}, got {tuple(src.shape)} "
                                    f"{src.dtype}")
            dst.copy_(src, non_blocking=True)
        # An eager step since the last replay (the short last batch, ...) ends with zero_grad(set_to_none):
        # hand the graph its own gradient tensors back, zeroed (eager gradients may still be in them).
        if any(p.grad is not g for p, g in zip(self.params, self.grads)):
            for p, g in zip(self.params, self.grads):
                p.grad = g
            torch._foreach_zero_(self.grads)
        self.graph.replay()
        # The outputs live in the graph's memory and the next replay overwrites them: a caller that keeps
        # one (the epoch's running mean starts as the first batch's items) must hold a copy.
        return self.loss.clone(), self.items.clone(), self.grad_norm.clone()


def capture_train_step(model, loss_fn, optimizer, ema, example: dict, amp_dtype=None, max_norm: float = 10.0):
    """A ``CudaGraphStep``, or None (reason logged as a warning) when capture is impossible or fails."""
    if not GRAPHS.is_available() or example["img"].device.type != GRAPH_DEVICE:
        LOG.warning("cuda_graph: not a CUDA run; using the eager step")
        return None
    dev = example["img"].device
    if not all(torch.is_tensor(lr := g.get("lr")) and lr.device == dev for g in optimizer.param_groups):
        # A float (or host) lr is baked into the graph as a constant: the schedule would be ignored.
        LOG.warning("cuda_graph: the optimizer's lr must be a tensor on %s (updated with g['lr'].fill_(v)); "
                    "using the eager step", dev)
        return None
    if not has_state(optimizer):
        # Optimizer state made inside the capture would be re-made by every replay (momentum reset).
        LOG.warning("cuda_graph: the optimizer has no state yet (take one eager step first); using the "
                    "eager step")
        return None
    if type(optimizer).__name__ in ("Adam", "AdamW") and not optimizer.defaults.get("capturable"):
        LOG.warning("cuda_graph: %s needs capturable=True; using the eager step", type(optimizer).__name__)
        return None
    try:
        return CudaGraphStep(model, loss_fn, optimizer, ema, example, amp_dtype, max_norm)
    except Exception as e:  # noqa: BLE001 - any capture error means "run eager", with the reason
        LOG.warning("cuda_graph: capture failed (%s: %s); using the eager step", type(e).__name__, e)
        GRAPHS.synchronize()
        return None


def has_state(optimizer) -> bool:
    """Every trainable parameter already has its optimizer state (momentum buffers, Adam moments); SGD
    without momentum keeps none."""
    groups = optimizer.param_groups
    stateless = isinstance(optimizer, torch.optim.SGD) and all(g["momentum"] == 0 for g in groups)
    return stateless or all(optimizer.state.get(p) for g in groups for p in g["params"] if p.requires_grad)


def optimizer_kwargs(name: str) -> dict:
    """Constructor arguments that make ``name``'s step capturable with a tensor lr (no host sync)."""
    key = name.lower()
    if key == "sgd":
        return {"fused": True}  # the foreach SGD reads a tensor lr with .item(), which capture forbids
    if key in ("adam", "adamw", "nadam", "radam", "rmsprop"):
        return {"capturable": True}
    return {}


def graph_blockers(device, compile_enabled: bool, distributed: bool, accumulate: int, scaler_enabled: bool):
    """Why a CUDA graph cannot run this training (empty: it can)."""
    why = []
    if torch.device(device).type != GRAPH_DEVICE:
        why.append("not a CUDA run")
    if compile_enabled:
        why.append("compile is on (use compile='reduce-overhead' for torch.compile's own CUDA graphs)")
    if distributed:
        why.append("DDP (its all-reduce hooks are not captured here)")
    if accumulate != 1:
        why.append(f"gradient accumulation (accumulate={accumulate}: set nbs <= batch)")
    if scaler_enabled:
        why.append("fp16 GradScaler (its inf check syncs with the host; bf16 needs none)")
    return why


def pad_gt(batch: dict, m: int) -> dict | None:
    """The batch with its padded GT (B, Mp, .) widened to exactly ``m`` rows, or None when Mp > m."""
    mp = batch["gt_mask"].shape[1]
    if mp > m:
        return None
    if mp == m:
        return batch
    out = dict(batch)
    for k in ("gt_cls", "gt_bboxes", "gt_mask"):
        t = batch[k]
        out[k] = torch.cat([t, t.new_zeros(t.shape[0], m - mp, t.shape[2])], 1)
    return out


class GraphedTrainStep:
    """The trainer's CUDA-graph step: ``step(batch) -> (loss, items, grad_norm)``, or None when this batch
    must run eagerly (other shape, too many GT, capture failed or graphs were turned off)."""

    def __init__(self, model, loss_fn, optimizer, ema, amp_dtype, gt_bucket: int, batch_size: int,
                 max_norm: float = 10.0):
        self.model, self.loss_fn, self.optimizer, self.ema = model, loss_fn, optimizer, ema
        self.max_norm = max_norm
        self.amp_dtype, self.m, self.batch_size = amp_dtype, int(gt_bucket), int(batch_size)
        self.step: CudaGraphStep | None = None
        self.off = None  # the reason graphs were turned off, once they are
        self.replays = self.eager = self.captures = 0
        self.key = None  # the loss's Python-number constants the captured graph holds

    def disable(self, reason: str) -> None:
        """Run eagerly from here on; ``off`` keeps the first reason."""
        if self.off is None:
            LOG.warning("cuda_graph: %s; the eager step runs from here on", reason)
            self.off = reason
        self.step = None

    def __call__(self, batch: dict):
        if self.off is not None:
            return None
        b = pad_gt(batch, self.m)
        if b is None:
            self.eager += 1
            return None
        if self.step is not None and _loss_constants(self.loss_fn) != self.key:
            # The loss's weights changed (YOLO26's branch weights, once per epoch): the graph holds the
            # old ones as constants, so it is captured again on this batch.
            self.step = None
        if self.step is None:
            # Capture on a full batch (not an epoch's short last one) once the optimizer has its state.
            if b["img"].shape[0] != self.batch_size or not has_state(self.optimizer):
                self.eager += 1
                return None
            dev = b["img"].device
            for g in self.optimizer.param_groups:  # a float or host lr would be frozen into the graph
                lr = g["lr"]
                if not torch.is_tensor(lr) or lr.device != dev or lr.dtype != torch.float32:
                    g["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=dev)
            self.step = capture_train_step(self.model, self.loss_fn, self.optimizer, self.ema, b,
                                           self.amp_dtype, self.max_norm)
            if self.step is None:
                self.disable("capture failed (reason above)")
                return None
            self.key, self.captures = _loss_constants(self.loss_fn), self.captures + 1
        try:
            out = self.step(b)
        except ShapeMismatch:
            self.eager += 1
            return None
        self.replays += 1
        return out


def _loss_constants(loss_fn):
    """What a captured step bakes in from the loss as Python numbers and that may change during a run: an
    end-to-end criterion's (w_o2m, w_o2o) (``E2EDetectionLoss.weights``); None for the others."""
    return getattr(loss_fn, "weights", None)
