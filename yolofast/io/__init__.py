"""Reading and writing checkpoints safely: Ultralytics' and yolofast's ``.pt`` files, no pickle code run.

    from yolofast.io import read_checkpoint, model_from_checkpoint
    info = read_checkpoint("yolov8n.pt")          # plain dict: state_dict (fp32), nc, names, stride, ...
    model = model_from_checkpoint("yolov8n.pt")   # yolofast DetectionModel, fp32, eval
"""

from yolofast.io.build import load_weights, model_from_checkpoint
from yolofast.io.errors import CheckpointError, UnsafeCheckpointError, UnsupportedCheckpointError
from yolofast.io.reader import FORMAT, read_checkpoint, to_plain

__all__ = ["FORMAT", "CheckpointError", "UnsafeCheckpointError", "UnsupportedCheckpointError", "load_weights",
           "model_from_checkpoint", "read_checkpoint", "to_plain"]
