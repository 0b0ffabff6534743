"""Errors of checkpoint reading: each names the file, what was found and what to do instead."""

from __future__ import annotations

from yolofast.cfg import CfgError

__all__ = ["CheckpointError", "UnsafeCheckpointError", "UnsupportedCheckpointError"]


class CheckpointError(CfgError):
    """A checkpoint that is truncated, corrupt, foreign, or lacks what the caller needs (a CfgError, so
    ``yolofast train model=...`` / ``resume=...`` prints the message instead of a traceback)."""


class UnsafeCheckpointError(CheckpointError):
    """The pickle inside a checkpoint asks for a global (a function or class) that is not on the allow list:
    loading it could run code, so nothing of the file is used."""


class UnsupportedCheckpointError(CheckpointError):
    """A well-formed checkpoint of an architecture or task yolofast does not build (YOLO11, v5u, seg, ...)."""
