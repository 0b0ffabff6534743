import os
from pathlib import Path

# The Triton interpreter must be chosen before any Triton kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# A CPU Trainer leaves one core free (engine/device.py: cpu_train_threads) unless OMP_NUM_THREADS is set;
# tests compare trainer runs with steps computed here at torch's default count, so keep that count.
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))

COCO128 = Path(__file__).resolve().parents[2] / "shared" / "data" / "coco128" / "coco128.yaml"


@pytest.fixture
def coco128_yaml():
    if not COCO128.exists():
        pytest.skip(f"coco128 not found at {COCO128}")
    return str(COCO128)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def emulated_graphs(monkeypatch):
    """yolofast/engine/cudagraph.py on the CPU emulator of CUDA graphs (graph_emulator.py): capture and
    replay of the real train step, and the trainer's graph path, without a GPU."""
    from graph_emulator import EmulatedCuda

    from yolofast.engine import cudagraph

    monkeypatch.setattr(cudagraph, "GRAPHS", EmulatedCuda)
    monkeypatch.setattr(cudagraph, "GRAPH_DEVICE", "cpu")
    return EmulatedCuda
