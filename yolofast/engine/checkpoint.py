"""Checkpoints: atomic writes, RNG state capture/restore, and finding the run to resume.

The trainer hands ``save_checkpoint`` a dict: epoch (last finished, 0-based), best_fitness, model (fp32
module), ema (EMA module), updates (EMA steps), optimizer / scaler / scheduler state_dicts, train_args
(dict), train_metrics, rng (python, numpy, torch, cuda, loader generators), version, date.
On disk (``format`` = "yolofast/2") the modules are fp32 state_dicts next to ``model_cfg`` (the
``build_model`` config, nc, names, stride) and every other entry is plain data (numpy arrays of the RNG
state become tensors), so ``torch.load(path, weights_only=True)`` reads a yolofast checkpoint and no code
stored in it can run. ``load_checkpoint`` (``yolofast.io.build``, re-exported here: validation reads
weights with it too) reads that format, the older one that pickled the modules, and Ultralytics' files, all
through ``yolofast.io`` (no pickle code runs), and rebuilds the modules, so a resumed run continues
bit-exactly from the same fp32 numbers.
"""

from __future__ import annotations

import os
import random
import tempfile
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from yolofast.cfg import CfgError
from yolofast.io import FORMAT, to_plain
from yolofast.io.build import load_checkpoint  # below val, which reads weights with it; re-exported
from yolofast.io.errors import CheckpointError

__all__ = ["save_checkpoint", "load_checkpoint", "rng_state", "set_rng_state", "find_last_checkpoint",
           "checkpoint_meta", "check_resumable", "remove_stale_temps", "CheckpointError", "RESUME_KEYS",
           "to_file_format"]

# What a resumed run restores (Trainer._restore); a file without them cannot continue a run exactly.
RESUME_KEYS = ("epoch", "model", "ema", "updates", "optimizer", "scaler", "scheduler", "train_args", "rng")


def _model_cfg(model: torch.nn.Module) -> dict:
    cfg = getattr(model, "yaml", None)
    return {
        # None: a custom module without a build_model config; its weights are kept, it cannot be rebuilt.
        "cfg": to_plain(cfg) if isinstance(cfg, dict) else None,
        "nc": getattr(model, "nc", None),
        "names": dict(getattr(model, "names", None) or {}),
        "stride": [float(s) for s in model.stride] if isinstance(getattr(model, "stride", None),
                                                                  torch.Tensor) else None,
        "class": type(model).__name__,
    }


def _state(module: torch.nn.Module) -> dict:
    return {k: v.detach() for k, v in module.state_dict().items()}


def to_file_format(ckpt: dict) -> dict:
    """The on-disk form of a trainer checkpoint: modules -> fp32 state_dicts + ``model_cfg``, the rest
    plain data that ``torch.load(weights_only=True)`` accepts."""
    out = {k: to_plain(v) for k, v in ckpt.items() if k not in ("model", "ema")}
    model, ema = ckpt.get("model"), ckpt.get("ema")
    ref = model if isinstance(model, torch.nn.Module) else ema
    if isinstance(ref, torch.nn.Module):
        out["model_cfg"] = _model_cfg(ref)
    for k, m in (("model", model), ("ema", ema)):
        if k in ckpt:
            out[k] = _state(m) if isinstance(m, torch.nn.Module) else to_plain(m)
    out["format"] = FORMAT
    return out


def save_checkpoint(ckpt: dict, path: str | Path) -> Path:
    """Write ``ckpt`` to ``path`` atomically: temp file in the same folder, flush + fsync, then rename.

    A crash (or a reader) never sees a half-written last.pt: rename within one file system is atomic.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        data = to_file_format(ckpt)
        with os.fdopen(fd, "wb") as f:
            torch.save(data, f)
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


def check_resumable(ckpt: dict, path: str | Path) -> None:
    """A checkpoint ``resume`` can continue: written by a yolofast Trainer, with the full training state."""
    missing = [k for k in RESUME_KEYS if k not in ckpt or (k in ("model", "ema") and ckpt[k] is None)]
    if missing:
        foreign = ckpt.get("source") not in (None, "yolofast") or "train_args" not in ckpt
        what = ("written by another tool (e.g. Ultralytics), not by the yolofast Trainer" if foreign
                else "a yolofast checkpoint without the training state")
        raise CheckpointError(f"resume: '{path}' is {what}: missing {', '.join(missing)}. Start a new run "
                              f"from its weights with model={path} instead of resume")
    if not isinstance(ckpt["train_args"], dict) or "epochs" not in ckpt["train_args"]:
        raise CheckpointError(f"resume: '{path}' has no usable train_args; start a new run with model={path}")


def remove_stale_temps(folder: str | Path) -> list[Path]:
    """Delete ``.<name>.*.tmp`` files a killed save_checkpoint left behind; returns what was removed."""
    folder = Path(folder)
    stale = sorted(folder.glob(".*.pt.*.tmp")) if folder.is_dir() else []
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


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
    kind, keys, *rest = state["numpy"]  # keys: a uint32 array, stored as a tensor so weights_only reads it
    np.random.set_state((kind, np.asarray(keys.numpy() if isinstance(keys, torch.Tensor) else keys,
                                          dtype=np.uint32), *rest))
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


# Arguments a resumed run may change: they leave the optimisation math of the finished epochs alone (batch
# changes accumulate/lr scaling from here on, epochs may only grow). ``project`` only locates last.pt.
RESUME_SAFE = ("batch", "workers", "device", "patience", "time", "val", "plots", "save_period", "epochs",
               "verbose", "exist_ok", "project", "resume")


def resume_args(ckpt: dict, path: str | Path, overrides: dict) -> dict:
    """The recipe a resumed run uses: the checkpoint's ``train_args`` plus the safe ``overrides``.

    Any other override whose value differs from the checkpoint's is refused (CfgError naming each), as
    are ``epochs`` below the run's own and a run that has nothing left to do."""
    from yolofast.cfg import get_cfg

    check_resumable(ckpt, path)
    args = dict(ckpt["train_args"])
    refused = []
    for k, v in overrides.items():
        if k in RESUME_SAFE:
            continue
        same_file = isinstance(v, (str, Path)) and Path(str(v)).resolve() == Path(path).resolve()
        if k == "model" and (same_file or not isinstance(v, (str, Path))):
            continue  # YOLO("last.pt").train(resume=True) passes the checkpoint itself; a module is its copy
        new = vars(get_cfg(**{k: v}))[k]
        old = args.get(k)
        if (str(new) if isinstance(new, Path) else new) != old:
            refused.append(f"{k}={v!r} (run has {old!r})")
    if refused:
        raise CfgError(f"resume: '{path}' continues its run with its own recipe; these arguments would "
                       f"change it and are refused: {', '.join(refused)}. Resumable changes: "
                       f"{', '.join(k for k in RESUME_SAFE if k not in ('resume', 'project'))}; or start a "
                       f"new run with model={path}")
    done = ckpt["epoch"] + 1
    if "epochs" in overrides and int(overrides["epochs"]) < int(args["epochs"]):
        raise CfgError(f"resume: epochs={overrides['epochs']} is below the run's {args['epochs']}: epochs "
                       f"may only be extended on resume (the learning-rate schedule of done epochs is fixed)")
    for k in RESUME_SAFE:
        if k in overrides and k not in ("resume", "project"):
            args[k] = overrides[k]
    if done >= args["epochs"]:
        raise CfgError(f"resume: '{path}' finished all {args['epochs']} epochs already; nothing to resume "
                       f"(pass a larger epochs= to extend it, or start a new run with model={path})")
    args["resume"] = str(path)
    return args
