"""A torchrun worker for the DDP failure tests: ``yolofast train`` (the CLI, as users run it) with one
failure injected on one rank.

    torchrun ... tests/engine/ddp_child.py MODE OUT key=value ...   (the keys of ``yolofast train``)

MODE: ``none``; ``kill_epoch`` (rank 1 SIGKILLs itself at the 2nd batch of epoch 2, first attempt only);
``kill_save`` (rank 0 SIGKILLs itself inside epoch 2's last.pt write, after the temp file is written and
before its rename, first attempt only); ``bad_file`` / ``nan`` / ``oom`` (rank 1 alone: an I/O error
reading an image, a non-finite loss on every step, a CUDA out-of-memory error in the forward).
Every worker writes ``OUT/rank{R}_attempt{A}.json`` (what it saw once set up) and, where it injects a
failure, ``OUT/inject.json`` (when, in time.time()). ``YOLOFAST_TEST_DELAY_RANK1=s``: rank 1 of a
restarted attempt waits s seconds before it starts, so rank 0 joins the new group first.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from yolofast import cli
from yolofast.engine import trainer as trainer_mod
from yolofast.engine.checkpoint import load_checkpoint

MODE, OUT, ARGS = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
RANK, LOCAL = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def _write(name: str, obj: dict) -> None:
    tmp = OUT / f".{name}.tmp"
    tmp.write_text(json.dumps(obj))
    tmp.replace(OUT / name)


def _injected(what: str) -> None:
    _write("inject.json", {"rank": RANK, "what": what, "time": time.time()})


def _kill_epoch(t) -> None:
    t.seen_batches.append(t.epoch)
    if RANK == 1 and ATTEMPT == 0 and t.seen_batches.count(1) == 2:
        os.kill(os.getpid(), signal.SIGKILL)


def _inject(t) -> None:
    if MODE == "kill_epoch":
        t.seen_batches = []
        t.add_callback("on_train_batch_end", _kill_epoch)
    elif MODE == "kill_save" and RANK == 0 and ATTEMPT == 0:
        real_fsync = os.fsync

        def fsync(fd):  # save_checkpoint: temp file written and flushed, not yet renamed to last.pt
            if t.epoch == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            real_fsync(fd)

        os.fsync = fsync
    elif RANK != 1:
        return
    elif MODE == "bad_file":
        ds, real_read, calls = t.train_loader.dataset, t.train_loader.dataset._read, []

        def read(i):  # the disk (or NFS) fails under this rank's 3rd image read: not a decode error
            calls.append(i)
            if len(calls) == 3:
                _injected("bad_file")
                raise OSError(errno.EIO, "Input/output error", ds.im_files[i])
            return real_read(i)

        ds._read = read
    elif MODE == "nan":
        real_loss = t.train_loss

        def loss(feats, batch):
            total, items = real_loss(feats, batch)
            if not os.path.exists(OUT / "inject.json"):
                _injected("nan")
            return total * float("nan"), items

        t.train_loss = loss
    elif MODE == "oom":
        real_model = t.train_model

        def model(img):
            if t.epoch == 0 and t.seen_steps == 1:
                _injected("oom")
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (injected)")
            t.seen_steps += 1
            return real_model(img)

        t.seen_steps = 0
        t.train_model = model


_setup = trainer_mod.Trainer._setup_train


def setup(self):
    _setup(self)
    _write(f"rank{RANK}_attempt{ATTEMPT}.json", {
        "rank": self.rank, "local_rank": LOCAL, "world": self.world_size, "batch_total": self.args.batch,
        "batch_per_rank": self.batch_size, "batches_per_epoch": self.nb, "save_dir": str(self.save_dir),
        "start_epoch": self.start_epoch, "device": str(self.device)})
    _inject(self)


if __name__ == "__main__":
    if ATTEMPT and RANK == 1:
        time.sleep(float(os.environ.get("YOLOFAST_TEST_DELAY_RANK1", 0)))
    if ATTEMPT and RANK == 0:  # what the restarted group finds of the run the killed one left
        kv = dict(a.split("=", 1) for a in ARGS)
        wdir = Path(kv["project"]) / kv["name"] / "weights"
        last = wdir / "last.pt"
        _write(f"found_attempt{ATTEMPT}.json", {
            "last_epoch": load_checkpoint(last)["epoch"] if last.is_file() else None,
            "temps": sorted(p.name for p in wdir.glob(".*.tmp"))})
    trainer_mod.Trainer._setup_train = setup
    sys.exit(cli.main(["train", *ARGS]))
