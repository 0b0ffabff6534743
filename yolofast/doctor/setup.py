"""What the doctor examines, built with the trainer's own hooks (``get_model``, ``get_dataloader``,
``get_loss``, its AMP and optimizer setup), so a subclass or a recipe is diagnosed as it would train.
With ``distill_model`` the step is the trainer's distillation step (``distill.train_step``): the student,
its projectors and the frozen teacher, whose forward appends the 0-d distillation loss to the head maps."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from yolofast.cfg import DEFAULTS, CfgError, get_cfg
from yolofast.engine import distill, setup
from yolofast.engine.autobatch import resolve_batch
from yolofast.engine.device import setup_amp
from yolofast.engine.schedule import Schedule
from yolofast.engine.state import TrainParts
from yolofast.engine.trainer import Trainer, init_seeds

__all__ = ["Session", "prepare", "restore"]


@dataclass
class Session:
    trainer: Trainer
    model: nn.Module  # the student
    step: nn.Module  # what the train step runs: ``model``, or the DistillStep with distill_model
    loss: object  # what training optimises: trainer.get_loss(model), + dis x L_dis with distill_model
    standard: object  # Trainer.get_loss: the recipe's DetectionLoss, the yardstick for the branches
    batch: dict  # one batch of the training split without augmentation, on the device, images in [0, 1]
    train_batch: dict | None  # the first batch of the training pipeline (augmented), as the loop sees it
    optimizer: torch.optim.Optimizer
    optimizer_name: str
    nc: int
    saved: TrainParts  # the trainer's own parts, handed back by restore

    def autocast(self):
        return self.trainer.autocast()

    @property
    def distilling(self) -> bool:
        return self.step is not self.model

    def forward(self):
        """The step's outputs on the fixed batch in float32 (the loss runs in float32, as in the trainer):
        the head maps, then L_dis when distilling."""
        with self.autocast():
            feats = self.step(self.batch["img"])
        return [f.float() for f in feats]

    def maps(self, feats: list) -> list:
        """The head maps of ``forward()``'s outputs (without the distillation loss)."""
        return feats[:-1] if self.distilling else feats


def _first_batch(loader) -> dict:
    for batch in loader:
        return batch
    raise ValueError("the training split gave no batch: check data= (its train images and labels)")


def prepare(trainer: Trainer) -> Session:
    """The doctor's model, batches, loss and optimizer, built by the trainer's own setup functions
    (engine/setup.py) into parts of its own: the trainer's are handed back by ``restore``."""
    saved = trainer.use_parts(TrainParts())  # the hooks read what is built so far from trainer.parts
    try:
        return _prepare(trainer, saved)
    except BaseException:
        trainer.use_parts(saved)
        raise


def _prepare(trainer: Trainer, saved: TrainParts) -> Session:
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
    standard = Trainer.get_loss(trainer, model)
    if resumed is not None:
        distill.restore_state(loss.step_model, resumed, trainer.resume_ckpt)  # the run's projectors
    recipe = get_cfg(a, batch=bs)  # the batch the doctor runs: weight decay and optimizer=auto follow it
    n_images = len(getattr(p.train_loader, "dataset", ()) or ()) or bs
    accumulate = Schedule(recipe, nb=1).accumulate
    opt, auto, _, _ = setup.build_optimizer(trainer, loss.step_model, n_images, accumulate, args=recipe)
    name = auto[0] if auto else a.optimizer
    return Session(trainer, model, loss.step_model, loss.step_loss, standard, batch, train_batch, opt, name,
                   int(trainer.data["nc"]), saved)


def restore(s: Session) -> None:
    """Hand the trainer its own parts back, so a later ``train()`` starts from its own setup."""
    s.trainer.use_parts(s.saved)
