"""Device, seeds and precision of a run: ``select_device``, ``init_seeds``, ``setup_amp``."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from yolofast.cfg import CfgError

__all__ = ["adjust_cpu_threads", "cpu_has_native_bf16", "cpu_train_threads", "init_seeds", "select_device",
           "setup_amp"]


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


def setup_amp(amp, device: torch.device) -> tuple[torch.dtype | None, torch.amp.GradScaler]:
    """(autocast dtype or None, GradScaler) for the recipe's ``amp``: bf16 autocast where the hardware does
    bf16 natively (no scaler), fp16 + GradScaler on older GPUs, fp32 otherwise or when ``amp=False``.

    CPU: amp=True means bf16 only on CPUs with native bf16 (AVX512-BF16 or AMX). There, the whole yolov8n
    step at 320 px batch 16 ran 1.9x faster than fp32 (34.0 vs 18.2 images/s, 2 threads,
    benchmarks/bench_train_step.py); CPUs without it emulate bf16 and are slower than fp32.
    """
    dev = device.type
    want = str(amp).lower() if not isinstance(amp, bool) else ("auto" if amp else "off")
    if want not in ("auto", "off", "bf16", "fp16", "true", "false"):
        raise CfgError(f"amp={amp!r}: use True, False, 'bf16' or 'fp16'")
    dtype = None
    if dev == "cuda" and want in ("auto", "true"):
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    elif want == "bf16" or (dev == "cpu" and want in ("auto", "true") and cpu_has_native_bf16()):
        dtype = torch.bfloat16
    elif want == "fp16":
        if dev != "cuda":
            raise CfgError("amp='fp16' needs a CUDA device; on CPU use amp='bf16' or amp=False")
        dtype = torch.float16
    return dtype, torch.amp.GradScaler(dev, enabled=dtype is torch.float16)



def cpu_train_threads(current: int, cores: int | None = None, load: float | None = None,
                      follow_load: bool = False) -> int:
    """Torch threads for a CPU training epoch: the run's own count (``current``: torch's default, every
    core, or the user's ``OMP_NUM_THREADS``), or with ``follow_load`` the cores other processes leave free;
    at least 1. ``OMP_NUM_THREADS`` set by the user always wins.

    Why follow the load: a step's threads meet at a barrier after every layer, so one preempted by another
    process stalls them all while the waiting ones spin: on a 2-core machine at load 16, the yolov8n 320 px
    batch-16 bf16 step took 27.9 s of wall (6.8 s CPU) with 2 threads against 4.2 s (1.0 s CPU) with 1
    (AMD EPYC Zen 4). Why not by default: the thread count changes the float sums, so a deterministic run
    keeps one count; and on an idle 2-core machine Ultralytics' "all cores but one" would halve the step
    (the quick start was measured with both cores). ``load`` is the 1-minute load average, which counts this
    process's ``current`` running threads too.
    """
    if os.environ.get("OMP_NUM_THREADS") or not follow_load:
        return current
    cores = cores or os.cpu_count() or 1
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (OSError, AttributeError):  # not Unix: keep what torch chose
            return current
    others = max(0.0, load - current)
    return int(max(1, min(cores, round(cores - others))))


def adjust_cpu_threads(most: int, follow_load: bool = False, log=None) -> int:
    """Set torch's threads to ``cpu_train_threads`` capped at ``most`` (the count at the run's start: the
    user's or torch's choice); ``log(message)`` when it changes. Returns the count now set."""
    now = torch.get_num_threads()
    n = min(cpu_train_threads(now, follow_load=follow_load), max(int(most), 1))
    if n != now:
        torch.set_num_threads(n)
        if log is not None:
            why = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
            log(f"CPU threads {now} -> {n}: {why} (OMP_NUM_THREADS fixes the count)")
    return n
