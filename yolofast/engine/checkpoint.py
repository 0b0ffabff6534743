"""Checkpoints: atomic writes, RNG state capture/restore, and finding the run to resume.

A checkpoint is a dict (``torch.save``):
  epoch (last finished, 0-based), best_fitness, model (fp32 module), ema (EMA module), updates (EMA steps),
  optimizer / scaler / scheduler state_dicts, train_args (dict), train_results (last metrics),
  rng (python, numpy, torch, cuda, loader generator), version, date.
The modules are pickled whole (so ``yolofast val model=best.pt`` needs no config) and kept in fp32 so a
resumed run continues bit-exactly; loading therefore needs ``weights_only=False`` — trusted files only.
"""

from __future__ import annotations

import os
import random
import tempfile
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

__all__ = ["save_checkpoint", "load_checkpoint", "rng_state", "set_rng_state", "find_last_checkpoint",
           "checkpoint_meta"]


def save_checkpoint(ckpt: dict, path: str | Path) -> Path:
    """Write ``ckpt`` to ``path`` atomically: temp file in the same folder, flush + fsync, then rename.

    A crash (or a reader) never sees a half-written last.pt: rename within one file system is atomic.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(ckpt, f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600 files; a checkpoint gets the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    """Load a yolofast checkpoint (a dict); a clear error when the file is missing or not a checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint '{path}' not found")
    # weights_only=False: yolofast checkpoints pickle the model modules (trusted local files only).
    ckpt = torch.load(path, map_location=map_location, weights_only=False)
    if not isinstance(ckpt, dict) or not ({"model", "ema"} & set(ckpt)):
        raise ValueError(f"'{path}' is not a yolofast checkpoint (expected a dict with 'model'/'ema')")
    return ckpt


def checkpoint_meta() -> dict:
    from yolofast import __version__

    return {"version": __version__, "date": datetime.now().isoformat(timespec="seconds")}


def rng_state(generators: dict | None = None) -> dict:
    """Every RNG the loop draws from: python, numpy, torch CPU, CUDA (all devices) and named generators."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    for name, g in (generators or {}).items():
        if g is not None:
            state[f"gen/{name}"] = g.get_state()
    return state


def set_rng_state(state: dict, generators: dict | None = None) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    for name, g in (generators or {}).items():
        s = state.get(f"gen/{name}")
        if g is not None and s is not None:
            g.set_state(s.cpu())


def find_last_checkpoint(project: str | Path = "runs") -> Path:
    """The most recently written ``last.pt`` under ``project`` (for ``resume=True``)."""
    project = Path(project)
    found = sorted(project.rglob("last.pt"), key=lambda p: p.stat().st_mtime) if project.exists() else []
    if not found:
        raise FileNotFoundError(f"resume=True but no last.pt was found under '{project}'; pass "
                                f"resume=path/to/weights/last.pt")
    return found[-1]
