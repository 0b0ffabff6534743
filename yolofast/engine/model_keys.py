"""Recipe keys that act on the model or the loss at setup: ``freeze``, ``dropout``, ``cls_pw``.

Called from ``setup.recipe_model`` / ``setup.recipe_loss`` (the default ``get_model`` / ``get_loss``).
"""

from __future__ import annotations

from yolofast.cfg import CfgError
from yolofast.engine.class_weights import class_weights
from yolofast.engine.freeze import freeze_layers

__all__ = ["apply_freeze", "class_weights_for"]


def apply_freeze(model, args, log) -> list[str]:
    """``freeze`` (requires_grad off, see freeze.py) and the one-line note for ``dropout``; returns the frozen
    layer prefixes for ``freeze_bn``."""
    if args.dropout:
        # Ultralytics applies dropout in its classification head only; a YOLOv8 Detect head has none.
        log(f"dropout={args.dropout}: dropout belongs to classification heads; the Detect head has none, so "
            f"the detector trains unchanged (as in Ultralytics)")
    if args.freeze is None:
        return []
    try:
        prefixes = freeze_layers(model, args.freeze)
    except ValueError as e:
        raise CfgError(str(e)) from None
    n = sum(p.numel() for k, p in model.named_parameters() if k.startswith(tuple(prefixes)))
    log(f"freeze={args.freeze}: {len(prefixes)} layer prefix(es) frozen ({n:,} parameters get no gradient)")
    return prefixes


def class_weights_for(trainer, nc: int):
    """``cls_pw`` weights from the train labels (on the trainer's device), logged once; None when off."""
    power = trainer.args.cls_pw
    ds = getattr(getattr(trainer, "train_loader", None), "dataset", None)
    if not power or ds is None or not hasattr(ds, "labels"):
        return None
    w = class_weights(ds.labels, nc, power)
    if w is None:
        return None
    trainer.log(f"cls_pw={power}: class weights {[round(float(x), 3) for x in w]} on the class loss (PyTorch "
                f"BCE for that term; the box and DFL terms stay in the fused kernel)")
    return w.to(trainer.device)
