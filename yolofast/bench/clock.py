"""Which clock a benchmark call is timed with: the process's CPU time at 1 CPU thread, else wall time.

Why CPU time: on a shared machine another process that lands on the same core takes whole time slices
in the middle of a call, and a wall clock charges them to the call. On the 2-core AMD EPYC (Zen 4) CI box,
with other jobs scheduled onto the timing core, the per-round fused/ref ratio of one run spread 4.7x
(tal_assign) and 4.3x (bbox_loss, ema_update) by wall clock and 2.7x, 2.4x, 1.7x by CPU time in the same
rounds. With one compute thread (``torch.set_num_threads(1)``: ATen's parallel_for and the C++ kernels
run inline, and CPU autograd runs on the caller's thread) the process's CPU time is the work of the call
and nothing else: what a slower kernel costs, without what a neighbour costs. With more threads the CPU
time would add up the threads (and OpenMP's spin-waits), so the wall clock is used; CUDA is timed with
device events (runner.py) and is not affected.
"""

from __future__ import annotations

import time

__all__ = ["CPU", "WALL", "clock_name", "now"]

CPU, WALL = "cpu", "wall"


def clock_name(device: str, threads: int) -> str:
    """"cpu" on a CPU device at 1 thread, else "wall"."""
    return CPU if not str(device).startswith("cuda") and threads == 1 else WALL


def now(kind: str):
    """The clock function of ``kind`` ("cpu": ``time.process_time``, "wall": ``time.perf_counter``)."""
    return time.process_time if kind == CPU else time.perf_counter
