import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_determinism():
    # The trainer turns on torch.use_deterministic_algorithms (deterministic=True): keep other tests clean.
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture
def emulated_graphs(monkeypatch):
    """yolofast/engine/cudagraph.py on the CPU emulator of CUDA graphs (graph_emulator.py): capture and
    replay of the real train step, and the trainer's graph path, without a GPU."""
    from graph_emulator import EmulatedCuda

    from yolofast.engine import cudagraph

    monkeypatch.setattr(cudagraph, "GRAPHS", EmulatedCuda)
    monkeypatch.setattr(cudagraph, "GRAPH_DEVICE", "cpu")
    return EmulatedCuda
