"""Process-group helpers for DDP via torchrun (DESIGN §4: no self-relaunch).

``torchrun --standalone --nproc_per_node=2 -m yolofast train data=shapes ...`` sets RANK/LOCAL_RANK/
WORLD_SIZE/MASTER_ADDR/MASTER_PORT; ``init_distributed`` reads them and joins the group (nccl on CUDA, gloo on
CPU). Each rank trains on ``batch // world`` images of its DistributedSampler shard; the trainer multiplies
the loss by the world size so DDP's gradient *average* equals the gradient of the whole batch (DESIGN §2.2).

What is exact and what is not: for a model without BatchNorm and a loss that is a sum over images, the
averaged gradients equal the single-process full-batch gradients (tests/engine/test_ddp.py). The real
YOLOv8 differs slightly: BatchNorm normalises with per-rank batch statistics (SyncBN is not used), and
DetectionLoss divides by ``S = max(sum of target scores, 1)`` of the rank's own images — as Ultralytics does.

Only rank 0 validates (the EMA), logs and writes files; ``rank0_broadcast`` hands its results (metrics,
stop flags) to the other ranks so every rank takes the same branch and none waits forever in a collective.
A rank that dies makes the others fail at their next collective after ``YOLOFAST_DDP_TIMEOUT`` seconds
(default 600: longer than a rank-0 validation of coco128 on CPU, short enough not to burn a GPU node).
Under torchrun that timeout is only a backstop: its agent sees a worker exit within its monitor interval
(0.1 s) and stops the others (SIGTERM), so a rank that raises ends the whole run in seconds.

Restarts (``torchrun --max-restarts=K``): the agent keeps one TCPStore for the whole job and the workers
of every attempt join the process group through it. Its keys outlive an attempt, so a restarted rank 0
read the dead rank 1's address of the attempt before and connected to it (gloo's connectFullMesh retried a
dead port, or hung in a futex wait until the timeout). ``init_distributed`` therefore rendezvouses under a
key prefix of its own per attempt (``TORCHELASTIC_RESTART_COUNT``).
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

__all__ = ["get_rank", "get_local_rank", "get_world_size", "is_main_process", "is_distributed",
           "unwrap_model", "init_distributed", "wrap_ddp", "rank0_broadcast", "broadcast_flag",
           "barrier", "destroy_distributed", "ddp_timeout", "restart_count", "gather_to_rank0",
           "all_gather_objects", "PeerFailedError", "is_peer_failure", "branches_may_go_unused"]

# How a collective reports that the other end is gone (gloo's TCP pairs; NCCL's remote error / abort).
_PEER_GONE = ("closed by peer", "reset by peer", "Broken pipe", "ncclRemoteError", "communicator was aborted")


class PeerFailedError(RuntimeError):
    """This rank's collective failed because another rank ended: that rank's own error is the cause."""


def is_peer_failure(e: BaseException) -> bool:
    """True when ``e`` is a collective failing because another rank exited (not this rank's own fault)."""
    return isinstance(e, RuntimeError) and any(s in str(e) for s in _PEER_GONE)


def get_rank() -> int:
    """Global rank from torchrun's RANK (-1 when not launched by torchrun, as in Ultralytics)."""
    return int(os.environ.get("RANK", -1))


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", -1))


def get_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def is_main_process() -> bool:
    return get_rank() in (-1, 0)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def unwrap_model(model: torch.nn.Module, student: bool = False) -> torch.nn.Module:
    """The module under DistributedDataParallel/DataParallel (``.module``) and torch.compile
    (``._orig_mod``) wrappers, in any nesting; with ``student=True`` also the student of a distillation
    step (``DistillStep.student``, engine/distill.py): the model whose EMA is kept.

    ``_orig_mod`` and ``student`` are read from ``_modules``, where nn.Module keeps an assigned submodule:
    getattr of a missing name raises an AttributeError inside Module.__getattr__, the costliest part of a
    per-step EMA update of a plain model. Only a submodule counts (a ``student`` attribute that is not an
    nn.Module is left alone); an object that is not an nn.Module is returned as it is."""
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
            continue
        sub = getattr(model, "_modules", None)
        if sub is None:
            return model
        inner = sub.get("_orig_mod")
        if student and not isinstance(inner, torch.nn.Module):
            inner = sub.get("student")
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def restart_count() -> int:
    """How often torchrun restarted this worker group (0: the first attempt, or not under torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def _attempt_store(world: int):
    """The agent's TCPStore under a prefix of this attempt, or None when torchrun hosts no shared store.

    The prefix keeps a restarted group from reading the keys (gloo addresses, counters) of the group that
    died: same store, fresh names.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # env:// rendezvous: rank 0 hosts a new store on MASTER_PORT for each attempt
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=ddp_timeout())
    return dist.PrefixStore(f"yolofast/attempt_{restart_count()}", store)


def ddp_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("YOLOFAST_DDP_TIMEOUT", 600)))


def init_distributed(device: torch.device) -> torch.device:
    """Join torchrun's process group when WORLD_SIZE > 1; returns the device this rank must use.

    CUDA: one GPU per process, ``cuda:LOCAL_RANK`` (nccl). CPU: gloo. A single process is left alone.
    """
    world = get_world_size()
    if world <= 1:
        return device
    if get_rank() < 0 or "MASTER_ADDR" not in os.environ:
        raise RuntimeError(f"WORLD_SIZE={world} but RANK/MASTER_ADDR are not set: launch multi-process runs "
                           "with `torchrun --standalone --nproc_per_node=N -m yolofast train ...`")
    if device.type == "cuda":
        local = max(get_local_rank(), 0)
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK={local} but only {torch.cuda.device_count()} CUDA device(s) are "
                               "visible; use --nproc_per_node <= the number of GPUs")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, store=_attempt_store(world), timeout=ddp_timeout(), rank=get_rank(),
                                world_size=world)
    return device


def branches_may_go_unused(model: torch.nn.Module) -> bool:
    """True for a model with a head branch that can get no gradient on a step: YOLO26's end-to-end head
    (``end2end``), whose one-to-one branch learns from its own loss term only (YOLO11_YOLO26.md §4.4
    "Gradients"). DDP waits for a gradient of every parameter: when one rank's step leaves a branch
    without one, that rank never all-reduces the branch's bucket, the others wait in theirs (a hang until
    the timeout) and the next step fails with "Expected to have finished reduction in the prior
    iteration". Such models are wrapped with ``find_unused_parameters``: each step then walks the
    autograd graph once and marks the parameters it did not reach as ready (their gradient counts as 0)."""
    return bool(getattr(unwrap_model(model, student=True), "end2end", False))


def wrap_ddp(model: torch.nn.Module, device: torch.device, find_unused: bool | None = None
             ) -> torch.nn.Module:
    """DistributedDataParallel around ``model`` (already on ``device``); the model itself when not DDP.
    ``find_unused``: DDP's find_unused_parameters, by default ``branches_may_go_unused(model)``."""
    if not is_distributed():
        return model
    if next(model.parameters()).device != device:
        raise RuntimeError(f"wrap_ddp: move the model to {device} before wrapping it (DDP broadcasts rank "
                           "0's weights from the model's own device)")
    ids = [device.index] if device.type == "cuda" else None
    unused = branches_may_go_unused(model) if find_unused is None else bool(find_unused)
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, output_device=None if ids is None
                                                     else ids[0], find_unused_parameters=unused)


def rank0_broadcast(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on rank 0 only; every rank returns rank 0's result (picklable objects)."""
    if not is_distributed():
        return fn(*args, **kwargs)
    obj = [fn(*args, **kwargs) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


def gather_to_rank0(obj):
    """``[obj of rank 0, obj of rank 1, ...]`` on rank 0, None on the others; ``[obj]`` in one process."""
    if not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def all_gather_objects(obj) -> list:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank (picklable objects)."""
    if not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_flag(flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank (the time limit: wall clocks differ, the ranks must stop together)."""
    if not is_distributed():
        return bool(flag)
    t = torch.tensor([int(bool(flag))], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.broadcast(t, src=0)
    return bool(t.item())


# The gloo barrier's tensor, kept for the life of the process (see ``barrier``).
_FENCE: list[torch.Tensor] = []


def barrier() -> None:
    """Wait for every rank (no-op in one process).

    On gloo this is an all-reduce of one int held here for good, not ``dist.barrier()``: gloo's barrier
    work keeps every collective still in flight when it was queued alive until a gloo worker thread
    releases it, after the barrier has returned. At the end of a run that release raced the interpreter's
    shutdown: the tensors of the last ``gather_object`` lost their Python owner, the worker thread needed
    the GIL to free them while Python was finalizing, and the process aborted ("terminate called without
    an active exception", SIGABRT of a rank that had finished, about 1 run in 8 of the torchrun restart
    test on 2 loaded cores). An all-reduce holds no earlier work, the ranks block in it with the GIL
    released (so earlier releases finish meanwhile), and its own tensor keeps a Python owner here."""
    if not is_distributed():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
        return
    if not _FENCE:
        _FENCE.append(torch.zeros(1, dtype=torch.int32))
    dist.all_reduce(_FENCE[0])


# How long a gloo rank waits, the GIL released, after leaving its group (see ``destroy_distributed``).
_GLOO_DRAIN_S = 0.5


def destroy_distributed() -> None:
    """Leave the process group. On gloo, then wait ``_GLOO_DRAIN_S`` with the GIL released: a gloo worker
    thread can still hold the last reference to a finished collective's tensors (it drops it after the
    caller's wait has returned), and dropping it needs the GIL; if Python is already shutting down then,
    the thread is killed inside a destructor and the process aborts ("terminate called without an active
    exception", a finished rank's SIGABRT, seen in CI with 6 processes on 2 cores even after the final
    all-reduce). Half a second once per run gives a descheduled worker thread time to finish."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    gloo = dist.get_backend() == "gloo"
    dist.destroy_process_group()
    if gloo:
        time.sleep(_GLOO_DRAIN_S)
