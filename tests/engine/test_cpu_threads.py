"""CPU training threads follow the free cores of a shared machine (engine/device.py)."""

import torch

from yolofast.engine.device import adjust_cpu_threads, cpu_train_threads


def test_threads_from_load(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_train_threads(2, cores=2, load=16.0) == 2  # deterministic: the run's own count
    assert cpu_train_threads(15, cores=16, load=30.0) == 15
    assert cpu_train_threads(1, cores=1) == 1
    follow = dict(cores=2, follow_load=True)
    assert cpu_train_threads(2, load=1.0, **follow) == 2  # only this process: every core
    assert cpu_train_threads(2, load=2.3, **follow) == 2  # its own 2 threads are not "others"
    assert cpu_train_threads(2, load=16.0, **follow) == 1  # busy neighbours: one thread, no barrier stalls
    assert cpu_train_threads(1, load=1.2, **follow) == 2  # the neighbours left: back to both cores
    assert cpu_train_threads(8, cores=16, load=12.0, follow_load=True) == 12


def test_user_thread_count_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_train_threads(2, cores=2, load=16.0) == 2
    assert cpu_train_threads(2, cores=2, load=16.0, follow_load=True) == 2


def test_adjust_caps_at_the_start_count(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        msgs = []
        assert adjust_cpu_threads(1, True, msgs.append) == 1  # an idle 64-core machine: still the run's 1
        assert msgs == []
    finally:
        torch.set_num_threads(before)
