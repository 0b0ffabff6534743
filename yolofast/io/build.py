"""``model_from_checkpoint``: a checkpoint (path or ``read_checkpoint`` dict) -> a yolofast model."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from yolofast.io.errors import CheckpointError
from yolofast.io.reader import read_checkpoint

__all__ = ["model_from_checkpoint", "load_weights"]


def load_weights(model: nn.Module, sd: dict, where: str) -> None:
    """``model.load_state_dict(sd)`` (strict) with an error that lists what differs instead of a wall."""
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    shapes = [f"{k} {tuple(sd[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
              if k in sd and sd[k].shape != v.shape]
    if missing or unexpected or shapes:
        parts = [f"{name} ({len(ks)}): {', '.join(ks[:4])}{', ...' if len(ks) > 4 else ''}"
                 for name, ks in (("missing", missing), ("unexpected", unexpected),
                                  ("shape file vs model", shapes)) if ks]
        raise CheckpointError(f"{where}: its tensors do not fit the model it describes; {'; '.join(parts)}")
    model.load_state_dict(sd, strict=True)


def model_from_checkpoint(ckpt: str | Path | dict, weights: str = "best") -> nn.Module:
    """A yolofast DetectionModel (fp32, eval, ``.nc``/``.names``/``.stride`` set) holding the file's weights.

    ``weights``: "best" = the EMA when present (what Ultralytics and yolofast validate), "model" = the raw
    trained weights when the file has them (else the EMA), "ema" = the EMA or an error.
    """
    from yolofast.nn import build_model

    info = ckpt if isinstance(ckpt, dict) else read_checkpoint(ckpt)
    where = f"checkpoint '{info.get('path', '<dict>')}'"
    sd = {"best": info["state_dict"], "model": info.get("model_state_dict") or info["state_dict"],
          "ema": info.get("ema_state_dict")}.get(weights, KeyError)
    if sd is KeyError:
        raise ValueError(f"model_from_checkpoint(weights={weights!r}): use 'best', 'model' or 'ema'")
    if sd is None:
        raise CheckpointError(f"{where} holds no EMA weights; use weights='best' or 'model'")
    if info["cfg"] is None:
        raise CheckpointError(f"{where} holds the weights of a custom {info['arch']} without a model config; "
                              f"build that module and load read_checkpoint(...)['state_dict'] into it")
    model = build_model(info["cfg"], nc=info["nc"])
    load_weights(model, sd, where)
    model.names = info["names"]
    if info.get("stride") is not None and model.stride.tolist() != [float(s) for s in info["stride"]]:
        raise CheckpointError(f"{where}: strides {info['stride']} differ from the rebuilt model's "
                              f"{model.stride.tolist()}")
    for p in model.parameters():
        p.requires_grad_(False)
    return model.float().eval()

