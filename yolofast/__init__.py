"""yolofast: a YOLOv8-style detection training engine with fused kernels."""

__version__ = "0.1.0"
__all__ = ["Trainer", "YOLO", "__version__"]


def __getattr__(name):
    # Lazy so that `import yolofast.ops` (used by kernels and tests) does not import the whole trainer.
    if name == "Trainer":
        from yolofast.engine.trainer import Trainer

        return Trainer
    if name == "YOLO":
        from yolofast.model import YOLO

        return YOLO
    raise AttributeError(f"module 'yolofast' has no attribute {name!r}")
