import os

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from yolofast.data import build_dataloader, build_dataset


@pytest.fixture
def one_box_set(tmp_path, split_factory):
    """8 images, one box each, so a sample with more than one box can only come from mosaic."""
    items = {f"im{i}": f"{i % 3} 0.5 0.5 0.5 0.5\n" for i in range(8)}
    return str(split_factory(tmp_path, items))


BOX = [0.5, 0.5, 0.5, 0.375]  # the 48x64 test images are letterboxed into 64x64: heights x 0.75
NO_JITTER = dict(translate=0.0, scale=0.0, hsv_h=0, hsv_s=0, hsv_v=0, fliplr=0.0)


def _batches(loader, n=2):
    out = []
    for i, b in enumerate(loader):
        out.append(b)
        if i + 1 == n:
            break
    return out


def _same(b1, b2):
    return all(torch.equal(b1[k], b2[k]) for k in ("img", "bboxes", "cls", "batch_idx"))


def test_same_seed_same_batches_workers0(one_box_set):
    ds = build_dataset(one_box_set, imgsz=64, nc=3)
    a = _batches(build_dataloader(ds, 4, 0, shuffle=True, seed=3))
    b = _batches(build_dataloader(ds, 4, 0, shuffle=True, seed=3))
    c = _batches(build_dataloader(ds, 4, 0, shuffle=True, seed=4))
    assert all(_same(x, y) for x, y in zip(a, b))
    assert not all(_same(x, y) for x, y in zip(a, c))


def test_workers_deterministic_and_close_mosaic_reaches_them(one_box_set):
    ds = build_dataset(one_box_set, imgsz=64, nc=3, hyp=dict(NO_JITTER, mosaic=1.0))
    loader = build_dataloader(ds, 4, 2, shuffle=True, seed=0)
    assert loader.num_workers == min(2, os.cpu_count()) and loader.persistent_workers
    e1 = _batches(loader)
    again = _batches(build_dataloader(build_dataset(one_box_set, imgsz=64, nc=3, hyp=dict(NO_JITTER)),
                                      4, 2, shuffle=True, seed=0))
    assert all(_same(x, y) for x, y in zip(e1, again))
    assert any(torch.bincount(b["batch_idx"].long()).max() > 1 for b in e1)  # mosaic was on
    ds.close_mosaic()  # after the workers exist: must still switch them over
    for b in _batches(loader):
        assert torch.bincount(b["batch_idx"].long(), minlength=4).tolist() == [1, 1, 1, 1]
        torch.testing.assert_close(b["bboxes"], torch.tensor([BOX] * 4), atol=1e-6, rtol=0)


def test_distributed_sampler_and_workers_cap(one_box_set, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it; no process group needed for the sampler
    ds = build_dataset(one_box_set, imgsz=64, nc=3, augment=False)
    loaders = [build_dataloader(ds, 2, 10_000, shuffle=True, rank=r, seed=1) for r in (0, 1)]
    parts = []
    for ld in loaders:
        assert isinstance(ld.sampler, DistributedSampler)
        assert ld.num_workers <= (os.cpu_count() or 1)
        ld.sampler.set_epoch(1)
        parts.append(list(ld.sampler))
    assert sorted(parts[0] + parts[1]) == list(range(8))  # each rank gets its own half
    assert loaders[0].pin_memory == torch.cuda.is_available()


def test_val_loader_order_and_no_augmentation(one_box_set):
    ds = build_dataset(one_box_set, imgsz=64, nc=3, augment=False)
    b = next(iter(build_dataloader(ds, 8, 0, shuffle=False)))
    assert b["im_file"] == sorted(b["im_file"])
    assert b["cls"].view(-1).tolist() == [i % 3 for i in range(8)]
    np.testing.assert_allclose(b["bboxes"].numpy(), [BOX] * 8, atol=1e-6)


class _ThreadReport(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        import cv2

        return torch.tensor([torch.get_num_threads(), cv2.getNumThreads()])


def test_workers_run_one_thread_each_and_batches_come_in_shared_memory(one_box_set):
    """No oversubscription: 2 workers x N threads each would fight over 2 cores."""
    loader = build_dataloader(_ThreadReport(), 2, 2, shuffle=False)
    loader.collate_fn = torch.utils.data.default_collate
    for b in loader:
        assert b[:, 0].tolist() == [1, 1] and (b[:, 1] <= 1).all()
    ds = build_dataset(one_box_set, imgsz=64, nc=3)
    b = next(iter(build_dataloader(ds, 4, 2, shuffle=True)))
    assert b["img"].shape == (4, 3, 64, 64) and b["img"].is_contiguous(memory_format=torch.channels_last)


def test_queue_depth_follows_the_shared_memory_it_costs(one_box_set):
    """4 batches queued per worker (and 4 + 2 reusable blocks) while a worker's blocks stay under 256 MB;
    torch's 2 for larger batches. workers=0 has no queue."""
    ds = build_dataset(one_box_set, imgsz=64, nc=3)
    loader = build_dataloader(ds, 4, 2, shuffle=True)
    assert loader.prefetch_factor == 4 and loader.collate_fn.slots == 6
    assert build_dataloader(ds, 4, 0, shuffle=True).prefetch_factor is None
    ds.imgsz = 640  # only the batch's size matters: 16 x 640 px -> 6 x 20 MB; 64 x 640 px -> 6 x 79 MB
    assert build_dataloader(ds, 16, 2, shuffle=True).prefetch_factor == 4
    big = build_dataloader(ds, 64, 2, shuffle=True)
    assert big.prefetch_factor == 2 and big.collate_fn.slots == 4
