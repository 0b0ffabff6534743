"""Process-group helpers. Runs are single-process for now; these read torchrun's environment so the loop
already knows its rank/world and only rank 0 logs and saves (DESIGN §4: DDP via torchrun, no relaunch)."""

from __future__ import annotations

import os

import torch

__all__ = ["get_rank", "get_local_rank", "get_world_size", "is_main_process", "unwrap_model",
           "init_distributed"]


def get_rank() -> int:
    """Global rank from torchrun's RANK (-1 when not launched by torchrun, as in Ultralytics)."""
    return int(os.environ.get("RANK", -1))


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", -1))


def get_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def is_main_process() -> bool:
    return get_rank() in (-1, 0)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DataParallel/DistributedDataParallel/torch.compile wrappers."""
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def init_distributed(device: torch.device) -> None:
    """Refuse multi-process runs until DDP lands, with the reason (instead of silently training N copies)."""
    if get_world_size() > 1:
        raise NotImplementedError(
            f"WORLD_SIZE={get_world_size()}: multi-process (torchrun) training is not implemented yet; "
            "run a single process"
        )
