"""Train keys over real steps: freeze, multi_scale, single_cls, fraction, rect, pretrained, channels_last,
dropout, cls_pw."""

import copy

import pytest
import torch

from yolofast import Trainer
from yolofast.cfg import CfgError
from yolofast.data import make_shapes
from yolofast.engine.freeze import freeze_prefixes
from yolofast.engine.multiscale import random_size, resize_batch
from yolofast.nn import YOLOV8

TINY = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
TINY.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return str(make_shapes(root=tmp_path_factory.mktemp("shapes"), n_train=8, n_val=4, imgsz=64))


def fast(tmp_path, data, **kw):
    return {**dict(model=TINY, data=data, imgsz=64, batch=4, workers=0, verbose=False, plots=False, epochs=1,
                   project=str(tmp_path), optimizer="SGD", lr0=0.05, warmup_epochs=0), **kw}


class Recording(Trainer):
    """Keeps the image shape of every train batch and the state at the start of training."""

    def train_batch(self, batch, epoch, i, ni):
        self.shapes = [*getattr(self, "shapes", []), tuple(batch["img"].shape[2:])]
        return super().train_batch(batch, epoch, i, ni)


def _start_state(trainer):
    holder = {}
    trainer.add_callback("on_train_start", lambda t: holder.update(
        {k: v.detach().clone() for k, v in t.model.state_dict().items()}))
    return holder


@pytest.mark.parametrize("freeze", [3, [0, 2, "22.cv2"]])
def test_frozen_layers_never_change_over_real_steps(tmp_path, shapes, freeze):
    t = Trainer(**fast(tmp_path, shapes, freeze=freeze, epochs=2))
    start = _start_state(t)
    grads = {}

    def after_backward(tr):  # optimizer_step fires between step and zero_grad: the gradients exist
        grads.update({n: p.grad for n, p in tr.model.named_parameters()})

    t.add_callback("optimizer_step", after_backward)
    t.train()
    prefixes = tuple(freeze_prefixes(freeze, 23))
    end = t.model.state_dict()
    frozen = [k for k in end if k.startswith(prefixes)]
    assert frozen and any("running_mean" in k for k in frozen)
    for k in frozen:  # weights, BN affine and BN running statistics alike
        assert torch.equal(end[k], start[k]), k
    for n, p in t.model.named_parameters():
        assert p.requires_grad == (not n.startswith(prefixes) and ".dfl." not in n), n
        if n.startswith(prefixes):
            assert grads[n] is None, n
    trained = [k for k in end if not k.startswith(prefixes) and end[k].is_floating_point()
               and "dfl" not in k and "num_batches" not in k]
    assert sum(not torch.equal(end[k], start[k]) for k in trained) > 0.9 * len(trained)


def test_freeze_errors_name_the_key(tmp_path, shapes):
    with pytest.raises(CfgError, match="freeze=30 but the model has 23 layers"):
        Trainer(**fast(tmp_path, shapes, freeze=30)).train()
    with pytest.raises(CfgError, match="names no parameter"):
        Trainer(**fast(tmp_path, shapes, freeze=["22.nothing"])).train()


def test_multi_scale_sizes_and_resize():
    import random

    rng = random.Random(0)
    sizes = {random_size(640, 0.5, 32, rng) for _ in range(2000)}
    assert min(sizes) == 320 and max(sizes) == 960 and all(s % 32 == 0 for s in sizes)
    img = torch.rand(2, 3, 64, 96)
    out = resize_batch(img, 128, 32)
    assert out.shape[2:] == (96, 128)  # long side 128, short side 64 * 4/3 = 85.3 -> up to 96
    assert resize_batch(img, 96, 32) is img


def test_multi_scale_trains_batches_of_several_sizes(tmp_path, shapes):
    t = Recording(**fast(tmp_path, shapes, multi_scale=0.5, epochs=4))
    t.train()
    sides = {max(s) for s in t.shapes}
    assert len(sides) > 1 and all(s % 32 == 0 and 32 <= s <= 96 for s in sides)
    t0 = Recording(**fast(tmp_path, shapes, epochs=1))
    t0.train()
    assert set(t0.shapes) == {(64, 64)}


def test_single_cls_trains_one_class_named_item(tmp_path, shapes):
    t = Trainer(**fast(tmp_path, shapes, single_cls=True))
    m = t.train()
    assert t.model.nc == 1 and t.data["names"] == {0: "item"} and t.model.names == {0: "item"}
    ds = t.train_loader.dataset
    assert {float(c) for lb in ds.labels for c in lb["cls"].ravel()} == {0.0}
    assert "metrics/mAP50-95(B)" in m


def test_fraction_uses_part_of_the_train_split(tmp_path, shapes):
    t = Trainer(**fast(tmp_path, shapes, fraction=0.5))
    t.train()
    assert len(t.train_loader.dataset) == 4 and len(t.val_loader.dataset) == 4  # val: all of it
    t = Trainer(**fast(tmp_path, shapes, fraction=[3, 2]))
    t.train()
    assert len(t.train_loader.dataset) == 3 and len(t.val_loader.dataset) == 2


def make_rect_data(root):
    """4 wide (32 x 64) and 4 tall (64 x 32) images with a box each, train = val."""
    import cv2
    import numpy as np

    for i in range(8):
        h, w = (32, 64) if i % 2 else (64, 32)
        img = np.full((h, w, 3), 114, np.uint8)
        img[h // 4: 3 * h // 4, w // 4: 3 * w // 4] = (0, 0, 255)
        (root / "images").mkdir(parents=True, exist_ok=True)
        (root / "labels").mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(root / "images" / f"{i}.png"), img)
        (root / "labels" / f"{i}.txt").write_text("0 0.5 0.5 0.5 0.5\n")
    (root / "data.yaml").write_text(f"path: {root}\ntrain: images\nval: images\nnames: [box]\n")
    return str(root / "data.yaml")


def test_rect_training_uses_aspect_ratio_batches(tmp_path):
    data = make_rect_data(tmp_path)
    t = Recording(**fast(tmp_path, data, rect=True, mosaic=1.0, epochs=2))
    t.train()
    assert sorted(set(t.shapes)) == [(32, 64), (64, 32)]  # wide and tall batches, every epoch
    assert t.train_loader.dataset.hyp["mosaic"] == 0.0
    v = Recording(**fast(tmp_path, data, epochs=1))  # the default: square batches
    v.train()
    assert set(v.shapes) == {(64, 64)}


def test_pretrained_false_and_a_pretrained_path(tmp_path, shapes):
    first = Trainer(**fast(tmp_path, shapes, name="src"))
    first.train()
    ckpt = str(first.best)
    from yolofast.io import read_checkpoint

    src = read_checkpoint(ckpt)["state_dict"]
    loaded = Trainer(**{**fast(tmp_path, shapes), "model": ckpt, "lr0": 0.0})
    start = _start_state(loaded)
    loaded.train()
    assert same_state(start, src)
    scratch = Trainer(**{**fast(tmp_path, shapes), "model": ckpt, "pretrained": False})
    start = _start_state(scratch)
    scratch.train()
    assert not same_state(start, src)
    into = Trainer(**fast(tmp_path, shapes, pretrained=ckpt))  # model=TINY yaml, weights from the path
    start = _start_state(into)
    into.train()
    assert same_state(start, src)


def same_state(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k].float(), b[k].float()) for k in b)


def test_channels_last_false_trains_nchw(tmp_path, shapes):
    t = Trainer(**fast(tmp_path, shapes, channels_last=False))
    t.train()
    w = t.model.model[0].conv.weight
    assert not t.channels_last and w.is_contiguous()
    t = Trainer(**fast(tmp_path, shapes))
    t.train()
    assert t.channels_last and t.model.model[1].conv.weight.is_contiguous(memory_format=torch.channels_last)


def test_dropout_leaves_the_detector_unchanged_and_says_so(tmp_path, shapes, capsys):
    a = Trainer(**fast(tmp_path, shapes, dropout=0.5, verbose=True))
    a.train()
    assert "dropout=0.5: dropout belongs to classification heads" in capsys.readouterr().out
    b = Trainer(**fast(tmp_path, shapes))
    b.train()
    assert not any(isinstance(m, torch.nn.Dropout) for m in a.model.modules())
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # same seed, same steps: dropout changed nothing


def test_cls_pw_weights_the_class_loss_by_frequency(tmp_path, shapes):
    t = Trainer(**fast(tmp_path, shapes, cls_pw=1.0))
    t.train()
    counts = torch.zeros(t.model.nc)
    for lb in t.train_loader.dataset.labels:
        for c in lb["cls"].ravel():
            counts[int(c)] += 1
    w = 1 / counts.clamp(min=1)
    w = torch.where(counts > 0, w, w[counts > 0].mean())
    assert torch.allclose(t.criterion.class_weights.cpu(), w / w.mean())
    assert not torch.allclose(w, torch.ones_like(w))  # the shapes classes are not balanced
    plain = Trainer(**fast(tmp_path, shapes))
    plain.train()
    assert plain.criterion.class_weights is None


@pytest.mark.parametrize("key", [dict(multi_scale=0.5), dict(rect=True)])
def test_shape_changing_keys_turn_cuda_graphs_off(tmp_path, shapes, emulated_graphs, key):
    """On the CPU emulator of CUDA graphs (where cuda_graph=True captures otherwise): multi_scale and rect
    change the input shape per batch, which one captured graph cannot replay, so the step stays eager."""
    with pytest.warns(UserWarning, match="changes the input shape per batch: using the eager step"):
        t = Trainer(**fast(tmp_path, shapes, batch=2, nbs=2, cuda_graph=True, **key))
        t.train()
    assert t.graph is None and torch.isfinite(t.tloss).all()
    plain = Trainer(**fast(tmp_path, shapes, batch=2, nbs=2, cuda_graph=True))
    plain.train()
    assert plain.graph is not None  # the same run without the key is graphed
