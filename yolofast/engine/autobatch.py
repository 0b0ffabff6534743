"""Memory measurement for the per-epoch report (results.csv, progress bar). AutoBatch is not done yet.

``memory_usage(device) -> {"mem/cpu_rss(GB)": ..., "mem/cuda_reserved(GB)": ...}``: the process's resident
set size now (Linux /proc; 0.0 where unavailable) and the CUDA caching allocator's peak reserved bytes on
``device`` (0.0 on CPU). Reserved rather than allocated: it is what the process holds from the GPU, so it is
what decides an out-of-memory error and what nvidia-smi shows.
"""

from __future__ import annotations

import os

import torch

__all__ = ["MEMORY_COLUMNS", "memory_usage", "cpu_rss_gb"]

MEMORY_COLUMNS = ("mem/cpu_rss(GB)", "mem/cuda_reserved(GB)")


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
