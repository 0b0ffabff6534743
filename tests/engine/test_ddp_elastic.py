"""torchrun with 2 gloo processes on 127.0.0.1: two "nodes" (c10d rendezvous), restarts that resume the same
run (SIGKILL mid-epoch, SIGKILL of rank 0 inside a checkpoint write), and one failing rank (I/O error, NaN,
out of memory) ending every rank within 60 s with its error printed once. Workers: tests/engine/ddp_child.py.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from yolofast.data import make_shapes
from yolofast.engine.checkpoint import load_checkpoint
from yolofast.engine.elastic import RUN_ID_FILE
from yolofast.nn import YOLOV8

CHILD = str(Path(__file__).with_name("ddp_child.py"))
RUN = [sys.executable, "-m", "torch.distributed.run"]
ENV = {**os.environ, "YOLOFAST_DDP_TIMEOUT": "120", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("elastic")
    tiny = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
    tiny.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)
    (root / "tiny.yaml").write_text(yaml.safe_dump(tiny))
    data = make_shapes(root=root / "data", n_train=8, n_val=2, imgsz=64)
    return [f"model={root / 'tiny.yaml'}", f"data={data}", "imgsz=64", "nbs=4", "workers=0", "plots=False",
            "device=cpu", "verbose=False", "deterministic=True"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(launcher: list, mode: str, out: Path, args: list, env=None) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([*RUN, *launcher, CHILD, mode, str(out), *args], env={**ENV, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs: dict) -> dict:
    """{name: (returncode, output, end time)} once every process has ended."""
    done = {}
    for name, p in procs.items():
        log, _ = p.communicate(timeout=400)
        done[name] = (p.returncode, log, time.time())
    return done


def _epochs(run: Path) -> list[str]:
    return [r.split(",")[0] for r in (run / "results.csv").read_text().splitlines()[1:]]


def _state(path: Path):
    ck = load_checkpoint(path)
    return ck["model"].state_dict(), ck["ema"].state_dict(), ck["updates"], ck["epoch"]


def test_two_nodes_c10d_rendezvous(recipe, tmp_path):
    """Two torchrun processes as two nodes of 1 process each: global ranks 0 and 1, local rank 0 on both
    (it picks the device), batch=4 is the global batch (2 per rank), and one run folder written."""
    port, rdzv_id = _free_port(), f"two-nodes-{os.getpid()}"
    args = [*recipe, "epochs=1", "batch=4", f"project={tmp_path / 'runs'}", "name=run"]
    procs = {n: _start(["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                        f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={rdzv_id}", f"--node_rank={n}"],
                       "none", tmp_path / "out", args) for n in (0, 1)}
    for n, (rc, log, _) in _finish(procs).items():
        assert rc == 0, f"node {n}:\n{log[-3000:]}"
    seen = [json.loads((tmp_path / "out" / f"rank{r}_attempt0.json").read_text()) for r in (0, 1)]
    assert [s["rank"] for s in seen] == [0, 1] and [s["local_rank"] for s in seen] == [0, 0]
    assert {(s["world"], s["batch_total"], s["batch_per_rank"], s["batches_per_epoch"]) for s in seen} == {
        (2, 4, 2, 2)}  # 8 images: 4 per rank in 2 batches of 2
    run = tmp_path / "runs" / "run"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["run"]
    assert (run / RUN_ID_FILE).read_text().strip() == rdzv_id
    assert _epochs(run) == ["1"] and (run / "weights" / "last.pt").is_file()


@pytest.mark.slow  # 3 torchrun jobs of 2 workers side by side (~60 s on 2 cores); runs in CI
def test_restart_resumes_same_run_with_same_weights(recipe, tmp_path):
    """--max-restarts=1: rank 1 SIGKILLed mid-epoch 2, or rank 0 SIGKILLed inside epoch 2's last.pt write;
    torchrun restarts both workers, which continue the same run from last.pt (no resume=) and end with
    epochs 1..3 once each and the weights of an uninterrupted run."""
    runs = tmp_path / "runs"
    launcher = ["--standalone", "--nproc_per_node=2", "--max-restarts=1"]
    # Rank 1 of the restarted group starts 3 s late: rank 0 then joins first, which is when it used to read
    # the dead group's rendezvous keys and connect to a dead rank.
    slow_r1 = {"YOLOFAST_TEST_DELAY_RANK1": "3"}
    procs = {n: _start(launcher, mode, tmp_path / n, [*recipe, "epochs=3", "batch=4", f"project={runs}",
                                                      f"name={n}"], env=slow_r1)
             for n, mode in (("full", "none"), ("cut_epoch", "kill_epoch"), ("cut_save", "kill_save"))}
    for n, (rc, log, _) in _finish(procs).items():
        assert rc == 0, f"{n}:\n{log[-4000:]}"
    assert sorted(p.name for p in runs.iterdir()) == ["cut_epoch", "cut_save", "full"]  # none incremented
    # What the restarted group found: epoch 1's last.pt readable; the killed save's temp file beside it.
    found = {n: json.loads((tmp_path / n / "found_attempt1.json").read_text())
             for n in ("cut_epoch", "cut_save")}
    assert found["cut_epoch"] == {"last_epoch": 0, "temps": []}
    assert found["cut_save"]["last_epoch"] == 0 and found["cut_save"]["temps"], found
    restarted = json.loads((tmp_path / "cut_save" / "rank1_attempt1.json").read_text())
    assert restarted["start_epoch"] == 1 and restarted["save_dir"] == str(runs / "cut_save")
    m1, e1, u1, ep1 = _state(runs / "full" / "weights" / "last.pt")
    for n in ("cut_epoch", "cut_save"):
        assert _epochs(runs / n) == ["1", "2", "3"], n
        assert not list((runs / n / "weights").glob(".*.tmp")), "resume removes the killed save's temp file"
        m2, e2, u2, ep2 = _state(runs / n / "weights" / "last.pt")
        assert (u2, ep2) == (u1, ep1) == (6, 2)
        for k in m1:
            torch.testing.assert_close(m2[k], m1[k], rtol=0, atol=1e-6, msg=f"{n} model {k}")
            torch.testing.assert_close(e2[k], e1[k], rtol=0, atol=1e-6, msg=f"{n} ema {k}")


@pytest.mark.slow  # 3 torchrun jobs of 2 workers side by side (~30 s on 2 cores); runs in CI
def test_one_failing_rank_ends_every_rank(recipe, tmp_path):
    """Rank 1 alone hits an I/O error on an image, a NaN loss on every step, or a CUDA out-of-memory error:
    torchrun ends both ranks within 60 s of it, and that error is printed once."""
    cases = {"bad_file": "OSError: [Errno 5] Input/output error",
             "nan": "yolofast: error: the loss stayed non-finite",
             "oom": "yolofast: error: out of memory at epoch 1 step 1 with batch 1 per rank under DDP"}
    procs = {m: _start(["--standalone", "--nproc_per_node=2"], m, tmp_path / m,
                       [*recipe, "epochs=3", "batch=2", f"project={tmp_path / 'runs'}", f"name=run_{m}"])
             for m in cases}
    for m, (rc, log, end) in _finish(procs).items():
        assert (tmp_path / m / "inject.json").is_file(), f"{m}: nothing injected (rc {rc}):\n{log[-4000:]}"
        inject = json.loads((tmp_path / m / "inject.json").read_text())
        took = end - inject["time"]
        print(f"{m}: every rank ended {took:.1f} s after rank {inject['rank']}'s failure")
        assert rc != 0 and inject["rank"] == 1, log[-3000:]
        assert took < 60, f"{m}: {took:.0f} s"
        assert log.count(cases[m]) == 1, f"{m}: error printed {log.count(cases[m])} times:\n{log[-4000:]}"
