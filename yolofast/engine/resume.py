"""What a checkpoint holds of a trainer and how a resumed run gets all of it back (DESIGN §4: resume
restores model/EMA/optimizer/scaler/scheduler/epoch/best fitness/RNG state and continues exactly).

    ckpt = trainer_checkpoint(trainer)        # the dict save_checkpoint writes (last.pt, best.pt)
    trainer.state = restore(trainer, ckpt)    # after _setup_train built everything: continue from it
    save_checkpoints(trainer)                 # Trainer.save_model: last.pt, best.pt, epoch{N}.pt
    validate_best(trainer)                    # at the end: best.pt's (metrics, fitness), or None

These read the trainer and write none of its attributes: ``restore`` loads the built parts (model, EMA,
optimizer, ...) in place and returns the run's state (``RunState``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from yolofast.cfg import CfgError, get_cfg
from yolofast.engine import checkpoint as ckpt_io
from yolofast.engine import distill, elastic
from yolofast.engine.distributed import (
    all_gather_objects,
    gather_to_rank0,
    is_main_process,
    restart_count,
    unwrap_model,
)
from yolofast.engine.loader import close_mosaic
from yolofast.engine.state import RunState

__all__ = ["check_ranks_agree", "elastic_restart", "load_resume_args", "restore", "rng_state",
           "save_checkpoints", "trainer_checkpoint", "validate_best"]


def load_resume_args(args, overrides: dict):
    """(recipe of the run to resume, its last.pt path, its checkpoint) for ``resume=True|path``."""
    r = args.resume
    path = ckpt_io.find_last_checkpoint(args.project) if r is True else Path(str(r))
    ckpt = ckpt_io.load_checkpoint(path)
    resumed = ckpt_io.resume_args(ckpt, path, overrides)  # safe overrides honoured, the others refused
    ckpt_io.remove_stale_temps(Path(path).parent)  # a save killed before its rename
    return get_cfg(**resumed), str(path), ckpt


def elastic_restart(args) -> Path | None:
    """Under a torchrun restart, this run's folder (elastic.py); sets ``args.resume`` to its last.pt when it
    has one, so the restarted group continues the run instead of starting a new one."""
    folder = elastic.restarted_run(args.project, args.name or "train")
    if folder is None:
        return None
    last = folder / "weights" / "last.pt"
    if last.is_file():
        args.resume = str(last)
        if is_main_process():
            tqdm.write(f"torchrun restart {restart_count()}: resuming {last}")
    else:
        (folder / "results.csv").unlink(missing_ok=True)  # rows of an epoch no checkpoint holds
    return folder


def check_ranks_agree(t) -> None:
    """Every rank starts at the same epoch of the same run, or none trains: a rank that resumed alone
    (a node that cannot see the run folder) would run other epochs and wait in an all-reduce."""
    if t.world_size <= 1:
        return
    starts = all_gather_objects((t.start_epoch, t.save_dir.name))
    if len(set(starts)) > 1:
        where = ", ".join(f"rank {r}: epoch {e + 1} of '{n}'" for r, (e, n) in enumerate(starts))
        raise CfgError(f"the ranks would start at different points ({where}): put project={t.args.project} "
                       f"on a file system every node sees, or pass the same resume= path to every node")


def _rng_generators(t) -> dict:
    """Loader-owned generators (shuffle order, worker seeds) that must resume where they stopped."""
    gens = {}
    loader = t.train_loader
    if isinstance(getattr(loader, "generator", None), torch.Generator):
        gens["loader"] = loader.generator
    sampler = getattr(loader, "sampler", None)
    if isinstance(getattr(sampler, "generator", None), torch.Generator):
        gens["sampler"] = sampler.generator
    return gens


def rng_state(t) -> dict:
    state = ckpt_io.rng_state(_rng_generators(t))
    # The dataset's own augmentation generator (in-process loading, workers=0). With workers > 0 each
    # persistent worker holds its own copy, out of a checkpoint's reach: resume is exact for workers=0.
    ds_rng = getattr(t.train_loader.dataset, "rng", None)
    if isinstance(ds_rng, np.random.Generator):
        state["dataset"] = ds_rng.bit_generator.state
    if hasattr(t.train_loader.dataset, "buffer_state"):  # mosaic companions come from this buffer
        state["dataset_buffer"] = t.train_loader.dataset.buffer_state()
    return state


def trainer_checkpoint(t) -> dict:
    args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(t.args).items()}
    return {
        **t.state.checkpoint(),  # epoch, best_fitness, best_epoch, train_metrics, train_time
        # fp32 modules (not halved): resume must continue from exactly these numbers.
        "model": unwrap_model(t.model),
        "ema": t.ema.ema,
        "updates": t.ema.updates,
        "optimizer": t.optimizer.state_dict(),
        "optimizer_auto": t.optimizer_auto,  # what optimizer=auto chose: a resume keeps it
        "scaler": t.scaler.state_dict(),
        "scheduler": t.scheduler.state_dict(),
        "train_args": args,
        "rng": rng_state(t),
        **distill.checkpoint_state(t.step_model),  # the projectors, for resume (not in model/ema)
        **ckpt_io.checkpoint_meta(),
    }


def save_checkpoints(t) -> None:
    """last.pt every time; best.pt when this epoch has the best fitness; epoch{N}.pt every save_period."""
    # Each rank draws its own augmentations: rank 0's checkpoint holds every rank's RNG state, so that
    # a resumed (or torchrun-restarted) group continues each stream where it stopped.
    rng_ranks = gather_to_rank0(rng_state(t)) if t.world_size > 1 else None
    if not is_main_process():
        return
    ckpt = trainer_checkpoint(t)
    if rng_ranks is not None:
        ckpt["rng_ranks"] = rng_ranks
    ckpt_io.save_checkpoint(ckpt, t.last)
    if t.best_epoch == t.epoch:
        ckpt_io.save_checkpoint(ckpt, t.best)
    if t.args.save_period > 0 and (t.epoch + 1) % t.args.save_period == 0:
        ckpt_io.save_checkpoint(ckpt, t.wdir / f"epoch{t.epoch + 1}.pt")


def validate_best(t) -> tuple[dict, float] | None:
    """best.pt's (metrics, fitness), validated again, for the run to return; None when it is the model
    just validated (or not rank 0, or no best.pt)."""
    if not is_main_process() or not t.best.exists() or t.best_epoch == t.epoch:
        return None
    best = ckpt_io.load_checkpoint(t.best, map_location=t.device)
    t.log(f"\nValidating {t.best} (epoch {best['epoch'] + 1})...")
    ema_model = t.ema.ema
    t.ema.ema = best["ema"].to(t.device)
    try:
        return t.validate()
    finally:
        t.ema.ema = ema_model


def restore(t, ckpt: dict) -> RunState:
    """Everything a resumed run needs to continue exactly as if it had never stopped: loads the built
    model, projectors, EMA, optimizer, scaler, scheduler and RNG streams in place (close_mosaic when the
    checkpoint's epochs are past it); returns the run's state at the epoch after the checkpoint's."""
    state = RunState.resumed(ckpt)
    unwrap_model(t.model).load_state_dict(ckpt["model"].state_dict())
    distill.restore_state(t.step_model, ckpt, t.resume_ckpt)
    t.ema.load_state_dict({"ema": ckpt["ema"].state_dict(), "updates": ckpt["updates"]})
    t.optimizer.load_state_dict(ckpt["optimizer"])
    t.scaler.load_state_dict(ckpt["scaler"])
    t.scheduler.load_state_dict(ckpt["scheduler"])
    closes_at = t.epochs - t.args.close_mosaic  # the loop's test; < 0 (a short run): never
    if t.args.close_mosaic and 0 <= closes_at < state.start_epoch:
        close_mosaic(t.train_loader)
    rng = ckpt["rng"]
    if len(ckpt.get("rng_ranks") or ()) == t.world_size > 1:  # this rank's own streams (save_model)
        rng = ckpt["rng_ranks"][t.rank]
    ckpt_io.set_rng_state(rng, _rng_generators(t))
    ds_rng = getattr(t.train_loader.dataset, "rng", None)
    if isinstance(ds_rng, np.random.Generator) and "dataset" in rng:
        ds_rng.bit_generator.state = rng["dataset"]
    if "dataset_buffer" in rng and hasattr(t.train_loader.dataset, "set_buffer_state"):
        t.train_loader.dataset.set_buffer_state(rng["dataset_buffer"])
    t.log(f"Resuming {t.resume_ckpt} from epoch {state.start_epoch + 1} to {t.epochs}")
    return state
