"""Loader workers reuse shared-memory blocks for batches (yolofast/data/batch_ring.py): the same batches as
a fresh block per batch, and a block is never written again while the main process holds any view of it."""

import gc
import itertools
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing  # noqa: F401  registers torch's reductions: shared storages go by reference

from yolofast.data import build_dataloader, build_dataset, collate_fn
from yolofast.data.batch_ring import BatchRing

KEYS = ("img", "batch_idx", "cls", "bboxes", "gt_cls", "gt_bboxes", "gt_mask")


@pytest.fixture
def train_set(tmp_path, split_factory):
    items = {f"im{i}": f"{i % 3} 0.5 0.5 0.5 0.5\n{(i + 1) % 3} 0.3 0.4 0.2 0.2\n" for i in range(12)}
    return str(split_factory(tmp_path, items))


def _take(loader, n):
    def endless():
        for e in itertools.count():
            loader.sampler.set_epoch(e)
            yield from loader
    return list(itertools.islice(endless(), n))


def test_same_batches_as_a_fresh_block_per_batch(train_set):
    """Only where the bytes live changes: the same seed gives the same batches, key for key."""
    ring = build_dataloader(build_dataset(train_set, imgsz=64, nc=3), 4, 2, shuffle=True, seed=5)
    assert isinstance(ring.collate_fn, BatchRing)
    plain = build_dataloader(build_dataset(train_set, imgsz=64, nc=3), 4, 2, shuffle=True, seed=5)
    plain.collate_fn = collate_fn  # the previous transport: a fresh shared block per batch
    a, b = _take(ring, 13), _take(plain, 13)
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and x["im_file"] == y["im_file"]
        for k in KEYS:
            assert x[k].dtype == y[k].dtype and x[k].stride() == y[k].stride() and torch.equal(x[k], y[k]), k
        assert x["img"].is_contiguous(memory_format=torch.channels_last)
    # all 13 kept (more than 2 workers x 6 blocks): later batches took fresh blocks, the same bytes either way
    assert ring.collate_fn.fresh.sum() > 0


def test_held_blocks_are_never_overwritten_and_released_ones_are_reused(train_set):
    loader = build_dataloader(build_dataset(train_set, imgsz=64, nc=3), 4, 1, shuffle=True, seed=0)
    ring = loader.collate_fn
    kept, copies = [], []
    it = iter(_take_lazily(loader))
    for _ in range(10):  # hold every batch (more than the worker's 6 blocks), then only a view of some
        b = next(it)
        kept.append(b["img"] if len(kept) % 2 else b["img"][1:3, :, 5:])
        copies.append(kept[-1].clone())
        del b
    gc.collect()
    assert int(ring.fresh.sum()) > 0  # all blocks held: the worker fell back to fresh ones
    for _ in range(6):  # the worker keeps producing while the old batches are held
        next(it)
    assert all(torch.equal(k, c) for k, c in zip(kept, copies))
    assert len({c.sum().item() for c in copies}) > 1  # the batches differ, so overwriting would show
    kept.clear()
    gc.collect()
    before = int(ring.fresh.sum())
    for _ in range(12):  # nothing held now: the released blocks serve every batch
        next(it)
    assert int(ring.fresh.sum()) == before


def _take_lazily(loader):
    for e in itertools.count():
        loader.sampler.set_epoch(e)
        yield from loader


def test_ring_batch_round_trip_and_release_in_one_process(monkeypatch):
    """The worker side and the main side of one ring in this process: a block goes back only when the
    last view of its tensor is gone."""
    import yolofast.data.batch_ring as R

    class Info:
        id = 0
    ring = BatchRing(collate_fn, workers=1, slots=2)
    monkeypatch.setattr(R, "get_worker_info", lambda: Info)
    samples = [{"img": torch.full((3, 8, 8), v, dtype=torch.uint8), "cls": torch.zeros(1, 1),
                "bboxes": torch.rand(1, 4), "im_file": f"{v}.jpg", "ori_shape": (8, 8)} for v in (1, 2)]
    sent = ring(samples)
    assert ring.held.tolist() == [1, 0]
    got = pickle.loads(ForkingPickler.dumps(sent))  # the main side, as the DataLoader sends it
    want = collate_fn(samples)
    assert all(torch.equal(got[k], want[k]) for k in KEYS) and got["im_file"] == ["1.jpg", "2.jpg"]
    view = got["img"][1]
    del got, sent
    gc.collect()
    assert ring.held.tolist() == [1, 0]  # a view still points into the block
    del view
    gc.collect()
    assert ring.held.tolist() == [0, 0]


def test_a_larger_batch_gets_a_larger_block(monkeypatch):
    """Rect batches change shape: a block too small for the next batch is replaced (and sent again)."""
    import yolofast.data.batch_ring as R

    class Info:
        id = 0
    ring = BatchRing(collate_fn, workers=1, slots=1)
    monkeypatch.setattr(R, "get_worker_info", lambda: Info)

    def sample(v, h, w):
        return {"img": torch.full((3, h, w), v, dtype=torch.uint8), "cls": torch.zeros(0, 1),
                "bboxes": torch.zeros(0, 4), "im_file": "x.jpg", "ori_shape": (h, w)}
    for v, (h, w) in enumerate([(8, 8), (8, 16), (4, 8), (16, 16)]):
        samples = [sample(v, h, w), sample(v + 1, h, w)]
        got = pickle.loads(ForkingPickler.dumps(ring(samples)))
        assert torch.equal(got["img"], collate_fn(samples)["img"]) and ring.held.tolist() == [1]
        del got
        gc.collect()
        assert ring.held.tolist() == [0]
    assert ring._own[0].numel() == 2 * 3 * 16 * 16 and int(ring.fresh[0]) == 0
