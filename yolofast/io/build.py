"""A checkpoint -> yolofast modules: ``model_from_checkpoint`` (path or ``read_checkpoint`` dict -> the model
to run) and ``load_checkpoint`` (path -> the trainer's entries with ``model``/``ema`` rebuilt, for resume,
validation and the CLI)."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from yolofast.io.errors import CheckpointError
from yolofast.io.reader import read_checkpoint

__all__ = ["model_from_checkpoint", "load_checkpoint", "load_weights"]


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


def _module(info: dict, sd: dict | None, ema: bool) -> nn.Module | dict | None:
    """A fp32 yolofast module holding ``sd`` (train mode with trainable weights, or the eval-mode EMA)."""
    if sd is None:
        return None
    if info["cfg"] is None:
        return sd  # a custom module's weights (to_file_format stores no config): the caller builds it
    from yolofast.nn import build_model

    m = build_model(info["cfg"], nc=info["nc"])
    load_weights(m, sd, f"checkpoint '{info['path']}'")
    m.names = info["names"]
    for n, p in m.named_parameters():  # as the Trainer sets them: the DFL's fixed bins never train
        p.requires_grad_(not ema and ".dfl." not in n)
    return m.eval() if ema else m


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    """Load a checkpoint as the trainer wrote it: its entries, with ``model``/``ema`` rebuilt as fp32
    yolofast modules (``ema`` None when the file has none). Reads yolofast's format, the older pickled one
    and Ultralytics' files safely (``yolofast.io.read_checkpoint``); ``source`` says which wrote it."""
    path = Path(path)
    info = read_checkpoint(path, map_location)
    ckpt = dict(info["train_state"])
    ckpt["model"] = _module(info, info.get("model_state_dict") or info["state_dict"], ema=False)
    ckpt["ema"] = _module(info, info.get("ema_state_dict"), ema=True)
    ckpt["source"] = info["source"]
    return ckpt
