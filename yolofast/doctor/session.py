"""What the doctor examines: one ``Session`` of model, step, loss, batches and optimizer, built by the
trainer's own setup functions (``yolofast/engine/doctor_setup.py``: the doctor sits below the engine and
imports none of it; the trainer hands it a session)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Session"]


@dataclass
class Session:
    trainer: object  # the Trainer: its recipe (args), device, AMP (autocast, scaler) and run folder
    model: nn.Module  # the student
    step: nn.Module  # what the train step runs: ``model``, or the DistillStep with distill_model
    loss: object  # what training optimises: trainer.get_loss(model), + dis x L_dis with distill_model
    standard: object  # Trainer.get_loss: the recipe's DetectionLoss, the yardstick for the branches
    batch: dict  # one batch of the training split without augmentation, on the device, images in [0, 1]
    train_batch: dict | None  # the first batch of the training pipeline (augmented), as the loop sees it
    optimizer: torch.optim.Optimizer
    optimizer_name: str
    nc: int
    saved: object  # the trainer's own parts (TrainParts), handed back by restore
    setup_s: float = 0.0  # seconds the setup took (the report's header)

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

    def restore(self) -> None:
        """Hand the trainer its own parts back, so a later ``train()`` starts from its own setup."""
        self.trainer.use_parts(self.saved)
