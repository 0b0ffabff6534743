"""What the doctor examines (``yolofast.doctor.Session``), built with the trainer's own hooks (``get_model``,
``get_dataloader``, ``get_loss``, its AMP and optimizer setup), so a subclass or a recipe is diagnosed as
it would train; ``diagnose(trainer)`` runs the doctor on it (``Trainer.doctor()``, ``yolofast doctor``).
With ``distill_model`` the step is the trainer's distillation step (``distill.train_step``): the student,
its projectors and the frozen teacher, whose forward appends the 0-d distillation loss to the head maps."""

from __future__ import annotations

import copy
import time

from yolofast.cfg import DEFAULTS, CfgError, get_cfg
from yolofast.doctor import DEFAULT_FRACTION, DEFAULT_STEPS, Report, Session, check_options, run
from yolofast.engine import distill, setup
from yolofast.engine.autobatch import resolve_batch
from yolofast.engine.device import init_seeds, setup_amp
from yolofast.engine.schedule import Schedule
from yolofast.engine.state import TrainParts

__all__ = ["diagnose", "prepare"]


def diagnose(trainer, steps: int = DEFAULT_STEPS, fraction: float = DEFAULT_FRACTION, save_dir=None,
             verbose: bool | None = None) -> Report:
    """``yolofast.doctor.run`` on a session built by ``prepare(trainer)``; the options are checked first,
    before anything is built. The trainer gets its own parts back (``Session.restore``)."""
    check_options(steps, fraction)
    return run(prepare(trainer), steps, fraction, save_dir=save_dir, verbose=verbose)


def _first_batch(loader) -> dict:
    for batch in loader:
        return batch
    raise ValueError("the training split gave no batch: check data= (its train images and labels)")


def prepare(trainer) -> Session:
    """The doctor's model, batches, loss and optimizer, built by the trainer's own setup functions
    (engine/setup.py) into parts of its own: the trainer's are handed back by ``Session.restore``."""
    t0 = time.time()
    saved = trainer.use_parts(TrainParts())  # the hooks read what is built so far from trainer.parts
    try:
        s = _prepare(trainer, saved)
    except BaseException:
        trainer.use_parts(saved)
        raise
    s.setup_s = time.time() - t0
    return s


def _prepare(trainer, saved: TrainParts) -> Session:
    a, p = trainer.args, trainer.parts
    init_seeds(a.seed, deterministic=False)  # the same model and batch every time; global flags left alone
    resumed = getattr(trainer, "_resume_state", None) if trainer.resume_ckpt is not None else None
    if resumed is not None:
        src = copy.deepcopy(resumed["model"])
    elif trainer._model_obj is not None:
        src = copy.deepcopy(trainer._model_obj)  # the doctor trains it: the user's module stays untouched
    else:
        src = a.model
    p.channels_last = setup.channels_last(a, trainer.device)
    p.model = model = setup.build_model(trainer, src, nhwc=p.channels_last)
    if getattr(model, "end2end", False):
        name = f"model={a.model!r}" if isinstance(a.model, str) else "the model"
        raise CfgError(f"doctor: {name} has an end-to-end head (YOLO26: one-to-many and one-to-one "
                       "branches, each with its own assignment); the doctor traces one head's box/cls/dfl "
                       "terms and does not cover that criterion yet. Train it directly (its loss items are "
                       "box_loss, cls_loss, l1_loss), or run the doctor on yolo11 or yolov8 with this data")
    p.stride = setup.model_stride(model)
    p.amp_dtype, p.scaler = setup_amp(a.amp, trainer.device)
    bs = DEFAULTS["batch"] if resolve_batch(a.batch)[0] else int(a.batch)  # one process, no AutoBatch
    workers, a.workers = a.workers, 0  # two batches: worker processes would cost more than they save
    try:
        p.train_loader = trainer.get_dataloader(trainer.data["train"], bs, mode="train")
        plain_loader = trainer.get_dataloader(trainer.data["train"], bs, mode="val")  # letterbox only
        batch = trainer.preprocess_batch(_first_batch(plain_loader))
        train_batch = trainer.preprocess_batch(_first_batch(p.train_loader))
    finally:
        a.workers = workers
    loss = setup.build_loss(trainer, model)  # cls_pw weighs the classes by the train loader's labels
    standard = setup.recipe_loss(trainer, model)  # the default get_loss, whatever a subclass returns
    if resumed is not None:
        distill.restore_state(loss.step_model, resumed, trainer.resume_ckpt)  # the run's projectors
    recipe = get_cfg(a, batch=bs)  # the batch the doctor runs: weight decay and optimizer=auto follow it
    n_images = len(getattr(p.train_loader, "dataset", ()) or ()) or bs
    accumulate = Schedule(recipe, nb=1).accumulate
    opt, auto, _, _ = setup.build_optimizer(trainer, loss.step_model, n_images, accumulate, args=recipe)
    name = auto[0] if auto else a.optimizer
    return Session(trainer, model, loss.step_model, loss.step_loss, standard, batch, train_batch, opt, name,
                   int(trainer.data["nc"]), saved)

