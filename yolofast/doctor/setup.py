"""What the doctor examines, built with the trainer's own hooks (``get_model``, ``get_dataloader``,
``get_loss``, its AMP and optimizer setup), so a subclass or a recipe is diagnosed as it would train.
With ``distill_model`` the step is the trainer's distillation step (``distill.train_step``): the student,
its projectors and the frozen teacher, whose forward appends the 0-d distillation loss to the head maps."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from yolofast.cfg import DEFAULTS
from yolofast.engine import distill, optim
from yolofast.engine.autobatch import resolve_batch
from yolofast.engine.device import setup_amp
from yolofast.engine.trainer import Trainer, init_seeds

__all__ = ["Session", "prepare", "restore"]

# Trainer attributes the doctor sets while it works (the hooks read them) and puts back afterwards.
_BORROWED = ("model", "channels_last", "amp_dtype", "scaler", "stride", "train_loader")


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
    saved: dict

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
    saved = {k: getattr(trainer, k) for k in _BORROWED if hasattr(trainer, k)}
    try:
        return _prepare(trainer, saved)
    except BaseException:
        _put_back(trainer, saved)
        raise


def _prepare(trainer: Trainer, saved: dict) -> Session:
    a = trainer.args
    init_seeds(a.seed, deterministic=False)  # the same model and batch every time; global flags left alone
    if trainer.resume_ckpt is not None and hasattr(trainer, "_resume_state"):
        src = copy.deepcopy(trainer._resume_state["model"])
    elif trainer._model_obj is not None:
        src = copy.deepcopy(trainer._model_obj)  # the doctor trains it: the user's module stays untouched
    else:
        src = a.model
    model = trainer.get_model(src).to(trainer.device)
    trainer.model = model  # get_dataloader reads the stride from it
    trainer.stride = max(int(model.stride.max()), 32)  # multi_scale rounds its sizes to it
    trainer.amp_dtype, trainer.scaler = setup_amp(a.amp, trainer.device)
    # as _setup_train: the recipe's layout
    trainer.channels_last = trainer.device.type in ("cuda", "cpu") and a.channels_last is not False
    if trainer.channels_last:
        model.to(memory_format=torch.channels_last)
    model.train()

    auto, _ = resolve_batch(a.batch)
    bs = DEFAULTS["batch"] if auto else int(a.batch)
    workers, a.workers = a.workers, 0  # two batches: worker processes would cost more than they save
    try:
        train_loader = trainer.get_dataloader(trainer.data["train"], bs, mode="train")
        plain_loader = trainer.get_dataloader(trainer.data["train"], bs, mode="val")  # letterbox only
        batch = trainer.preprocess_batch(_first_batch(plain_loader))
        train_batch = trainer.preprocess_batch(_first_batch(train_loader))
    finally:
        a.workers = workers
    trainer.train_loader = train_loader  # cls_pw weighs the classes by this loader's labels
    criterion = trainer.get_loss(model)
    standard = Trainer.get_loss(trainer, model)
    step, loss, _ = distill.train_step(model, criterion, a, trainer.data["names"], trainer.device,
                                       trainer.channels_last)
    if trainer.resume_ckpt is not None and hasattr(trainer, "_resume_state"):
        distill.restore_state(step, trainer._resume_state, trainer.resume_ckpt)  # the run's projectors

    accumulate = optim.accumulate_steps(a.nbs, bs)
    decay = optim.scaled_weight_decay(a.weight_decay, bs, accumulate, a.nbs)
    n_images = len(getattr(train_loader, "dataset", ()) or ()) or bs
    iterations = math.ceil(n_images / max(bs, a.nbs)) * a.epochs
    opt, name, _, _ = optim.build_optimizer(step, a.optimizer, a.lr0, a.momentum, decay, iterations,
                                            nc=trainer.data["nc"])
    return Session(trainer, model, step, loss, standard, batch, train_batch, opt, name,
                   int(trainer.data["nc"]), saved)


def restore(s: Session) -> None:
    """Put back what ``prepare`` borrowed, so a later ``train()`` starts from its own setup."""
    _put_back(s.trainer, s.saved)


def _put_back(trainer: Trainer, saved: dict) -> None:
    for k in _BORROWED:
        if k in saved:
            setattr(trainer, k, saved[k])
        elif hasattr(trainer, k):
            delattr(trainer, k)
