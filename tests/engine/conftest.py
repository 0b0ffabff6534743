import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_determinism():
    # The trainer turns on torch.use_deterministic_algorithms (deterministic=True): keep other tests clean.
    yield
    torch.use_deterministic_algorithms(False)

