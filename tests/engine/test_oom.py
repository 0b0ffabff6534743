"""Out of memory in a train step: the batch is halved, the loader rebuilt, the epoch goes on from the batch
that failed (same images, same order) -- at most 3 times, then an error naming the batch size. The CUDA
error is injected on the CPU: the model raises torch.OutOfMemoryError for batches above a size."""

import copy
import warnings

import pytest
import torch

from yolofast import Trainer
from yolofast.data import make_shapes
from yolofast.nn import YOLOV8

TINY = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
TINY.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)
FAST = dict(model=TINY, imgsz=64, nbs=2, workers=0, verbose=False, plots=False, val=False, mosaic=0.0,
            warmup_epochs=0.0, amp=False)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """12 train + 2 val images of 64 px."""
    return str(make_shapes(root=tmp_path_factory.mktemp("shapes"), n_train=12, n_val=2, imgsz=64))



class _OOMModel(torch.nn.Module):
    """Wraps the train model: raises the CUDA out-of-memory error when ``fail(n_images)`` says so and
    records, per epoch, the files of every batch that did run."""

    def __init__(self, trainer, fail, error=None):
        super().__init__()
        self.trainer, self.inner, self.fail = trainer, trainer.train_model, fail
        self.error = error or (lambda n: torch.OutOfMemoryError(f"CUDA out of memory (batch {n})"))
        self.calls = 0

    def forward(self, img):
        self.calls += 1
        if self.fail(img.shape[0], self.calls):
            raise self.error(img.shape[0])
        self.trainer.seen.setdefault(self.trainer.epoch, []).extend(self.trainer.files)
        self.trainer.shapes.setdefault(self.trainer.epoch, []).extend([tuple(img.shape[-2:])] * img.shape[0])
        return self.inner(img)


class _Recording(Trainer):
    def preprocess_batch(self, batch):
        self.files = list(batch["im_file"])
        return super().preprocess_batch(batch)


def _train(shapes, tmp_path, name, fail=lambda n, c: False, error=None, **kw):
    t = _Recording(data=shapes, project=tmp_path, name=name, **{**FAST, **kw})
    t.seen, t.shapes = {}, {}
    t.add_callback("on_pretrain_routine_end",
                   lambda tr: setattr(tr, "train_model", _OOMModel(tr, fail, error)))
    return t, t.train()


def test_oom_halves_batch_and_epoch_goes_on(shapes, tmp_path):
    """batch 4 fails on its 2nd batch (images 4..7): batch 2 takes over from image 4; the epoch sees all
    12 images once, in the order an undisturbed run sees them; epoch 2 runs at batch 2."""
    ref, _ = _train(shapes, tmp_path, "ref", batch=4, epochs=2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t, metrics = _train(shapes, tmp_path, "oom", fail=lambda n, c: c == 2, batch=4, epochs=2)
    msgs = [str(x.message) for x in w if "out of memory" in str(x.message)]
    assert len(msgs) == 1 and "batch=4" in msgs[0] and "batch=2" in msgs[0] and "image 4" in msgs[0], msgs
    assert t.batch_size == 2 and t.args.batch == 2 and t.oom.halvings == 1
    assert t.seen[0] == ref.seen[0] and len(set(t.seen[0])) == 12  # every image once, same order
    assert sorted(t.seen[1]) == sorted(ref.seen[1])  # epoch 2: the same images (order is seeded by epoch)
    assert t.nb == 6 and t.accumulate == 1  # 12 images at batch 2; nbs=2
    assert torch.isfinite(t.tloss).all()
    from yolofast.engine.checkpoint import load_checkpoint

    assert load_checkpoint(t.last)["train_args"]["batch"] == 2  # a resumed run keeps the size that fits


def test_oom_odd_batch_twice_mid_epoch(shapes, tmp_path):
    """batch 5 fails on its 2nd batch (5 images done), then batch 2 fails on its first: the epoch goes on
    at batch 1 from image 5 -- every image once, in order; the next epoch has 12 batches and steps on its
    last one."""
    ref, _ = _train(shapes, tmp_path, "ref5", batch=5, epochs=2)
    t, _ = _train(shapes, tmp_path, "odd", fail=lambda n, c: c in (2, 3), batch=5, epochs=2)
    assert t.batch_size == 1 and t.oom.halvings == 2
    assert t.seen[0] == ref.seen[0] and len(t.seen[1]) == 12 and sorted(t.seen[1]) == sorted(ref.seen[1])
    assert t.nb == 12 and t.last_opt_step == 2 * 12 - 1  # epoch 2's last batch stepped (ni = 12 + 11)


def _rect_data(root):
    """9 wide (32 x 64) then 6 tall (64 x 32) images in aspect-ratio order: at batch 5 the rect batches
    are wide, square (4 wide + 1 tall) and tall."""
    import cv2
    import numpy as np

    for d in ("images", "labels"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for i in range(15):
        h, w = (32, 64) if i < 9 else (64, 32)
        img = np.full((h, w, 3), 114, np.uint8)
        img[h // 4: 3 * h // 4, w // 4: 3 * w // 4] = (0, 0, 255)
        cv2.imwrite(str(root / "images" / f"{i:02d}.png"), img)
        (root / "labels" / f"{i:02d}.txt").write_text("0 0.5 0.5 0.5 0.5\n")
    (root / "data.yaml").write_text(f"path: {root}\ntrain: images\nval: images\nnames: [box]\n")
    return str(root / "data.yaml")


@pytest.mark.parametrize("fail_call, new_batch", [(2, 1), (1, 2)])
def test_oom_halving_keeps_rect_batches_of_one_shape(tmp_path, fail_call, new_batch):
    """rect=True at batch 5 (odd): 5 // 2 = 2 would stack a wide and a square image into one batch.
    Mid-epoch (the 2nd batch fails) the new size divides 5, so every image keeps its rect batch's shape;
    on an epoch's first batch the rect batches are re-cut for the new size. Both epochs see every image
    once, in the undisturbed order."""
    data = _rect_data(tmp_path)
    ref, _ = _train(data, tmp_path, "ref", batch=5, epochs=2, rect=True)
    assert sorted(set(ref.shapes[0])) == [(32, 64), (64, 32), (64, 64)]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t, _ = _train(data, tmp_path, "oom", fail=lambda n, c: c == fail_call, batch=5, epochs=2, rect=True)
    assert t.batch_size == new_batch and t.oom.halvings == 1
    msgs = [str(x.message) for x in w if "out of memory" in str(x.message)]
    assert len(msgs) == 1 and f"batch={new_batch}" in msgs[0]
    assert ("a divisor of 5" in msgs[0]) == (new_batch == 1), msgs
    for e in (0, 1):
        assert t.seen[e] == ref.seen[e] and len(set(t.seen[e])) == 15
    if new_batch == 1:  # the images after the failure kept their shapes
        assert t.shapes == ref.shapes
    else:  # re-cut at 2: wide pairs, one square pair (the 9th and 10th image), tall pairs
        assert t.shapes[1] == [(32, 64)] * 8 + [(64, 64)] * 2 + [(64, 32)] * 5
    assert t.nb == 15 // new_batch + (15 % new_batch > 0)


def test_cudnn_alloc_failure_counts_as_oom_other_errors_do_not(shapes, tmp_path):
    """cuDNN reports a failed workspace allocation as a plain RuntimeError: halved like an OOM."""
    t, _ = _train(shapes, tmp_path, "cudnn", fail=lambda n, c: c == 1, batch=4, epochs=1,
                  error=lambda n: RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert t.batch_size == 2 and len(t.seen[0]) == 12
    with pytest.raises(RuntimeError, match="shape mismatch"):
        _train(shapes, tmp_path, "other", fail=lambda n, c: c == 1, batch=4, epochs=1,
               error=lambda n: RuntimeError("shape mismatch"))


def test_oom_halving_repeats_within_one_batch(shapes, tmp_path):
    """Anything above 1 image fails: 8 -> 4 -> 2 -> 1 on the very first batch, then the run trains."""
    t, _ = _train(shapes, tmp_path, "small", fail=lambda n, c: n > 1, batch=8, epochs=1)
    assert t.batch_size == 1 and t.oom.halvings == 3
    assert len(t.seen[0]) == 12 and len(set(t.seen[0])) == 12


def test_oom_gives_up_after_three_halvings(shapes, tmp_path):
    with pytest.raises(torch.OutOfMemoryError, match=r"batch=2 after 3 halving"):
        _train(shapes, tmp_path, "fail", fail=lambda n, c: n > 1, batch=16, epochs=1)


def test_oom_at_batch_one_is_an_error(shapes, tmp_path):
    with pytest.raises(torch.OutOfMemoryError, match=r"batch=1 after 0 halving"):
        _train(shapes, tmp_path, "one", fail=lambda n, c: True, batch=1, epochs=1)


def test_autobatch_on_cpu_keeps_the_default(shapes, tmp_path, capsys):
    t = Trainer(data=shapes, project=tmp_path, name="ab", batch=-1, epochs=1, **{**FAST, "verbose": True})
    t._setup_train()
    assert t.batch_size == 16 and t.args.batch == 16
    out = capsys.readouterr()
    assert "AutoBatch: needs a CUDA device" in out.out + out.err


def test_autobatch_choice_sizes_the_loader(shapes, tmp_path, monkeypatch):
    """The batch AutoBatch picks (here injected: 3 for fraction 0.5) becomes the loader's and the recipe's."""
    import yolofast.engine.setup as tr  # where AutoBatch is called

    seen = {}

    def fake(model, loss, imgsz, device, fraction, max_gt, amp_dtype, default, log):
        seen.update(fraction=fraction, max_gt=max_gt, imgsz=imgsz)
        return 3

    monkeypatch.setattr(tr, "autobatch", fake)
    t = Trainer(data=shapes, project=tmp_path, name="ab2", batch=0.5, epochs=1, **FAST)
    t._setup_train()
    assert seen["fraction"] == 0.5 and seen["imgsz"] == 64 and seen["max_gt"] >= 16
    assert t.batch_size == 3 and t.args.batch == 3 and t.train_loader.batch_size == 3 and t.nb == 4
    assert t.accumulate == 1  # nbs=2 <= 3


def test_autobatch_choice_recuts_rect_batches(tmp_path, monkeypatch):
    """rect=True with AutoBatch: the rect batches are cut again at the chosen size (here 4; at the default
    16 all 15 images were one square batch), so each loader batch is one rect batch with its own shape."""
    import yolofast.engine.setup as tr  # where AutoBatch is called

    monkeypatch.setattr(tr, "autobatch", lambda *a, **k: 4)
    t = Trainer(data=_rect_data(tmp_path), project=tmp_path, name="abr", batch=0.5, epochs=1, rect=True,
                **FAST)
    t._setup_train()
    shapes = [tuple(b["img"].shape[-2:]) for b in t.train_loader]
    assert shapes == [(32, 64)] * 2 + [(64, 64), (64, 32)]  # 8 wide; 1 wide + 3 tall; 3 tall


@pytest.mark.parametrize("bad", [0, -2, 1.5, 2.5])
def test_bad_batch_is_refused_before_work(shapes, tmp_path, bad):
    from yolofast.cfg import CfgError

    with pytest.raises(CfgError, match="batch="):
        Trainer(data=shapes, project=tmp_path, batch=bad, **FAST)
