"""Benchmark machinery: presets, inputs, runner rows, JSON, --compare and the CI gate's floor logic.

Nothing here asserts a time: speed is measured by `yolofast bench` and benchmarks/gate.py, not tests.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from yolofast.bench import bench_main
from yolofast.bench.cases import Case, Variant, build_cases
from yolofast.bench.cli import parse_bench_args
from yolofast.bench.compare import compare, compare_files, decide_files, load_results
from yolofast.bench.floors import check_floors
from yolofast.bench.inputs import ema_inputs, loss_inputs, step_inputs
from yolofast.bench.presets import PRESETS, get_preset, presets_for
from yolofast.bench.runner import (
    Row,
    _peak_one_call_cpu,
    fill_ratios,
    format_table,
    measure_peaks,
    time_case,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _one_thread():
    # The timed calls here are tiny; two OpenMP threads on a busy 2-core CI box only add spin-waits.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------------------------------ presets
@pytest.mark.parametrize("name,kind,b,imgsz,n_gt", [
    ("loss-b8-640-50gt", "loss", 8, 640, 50),
    ("assign-dense-b2-640-1000gt", "assign", 2, 640, 1000),
    ("assign-dense-b1-1024-3000gt", "assign", 1, 1024, 3000),
    ("step-yolov8n-320-b16", "step", 16, 320, None),
    ("gpu-loss-b64-640-1000gt", "loss", 64, 640, 1000),
])
def test_presets_resolve(name, kind, b, imgsz, n_gt):
    p = get_preset(name)
    assert (p.kind, p.batch, p.imgsz) == (kind, b, imgsz)
    if n_gt is not None:
        assert p.n_gt == n_gt and p.m_padded % 16 == 0 and p.m_padded >= n_gt
    assert get_preset("ema-yolov8s").model == "yolov8s"
    assert get_preset("loss-b8-640-50gt").n_anchors == 8400
    assert get_preset("assign-dense-b1-1024-3000gt").n_anchors == 21504


def test_unknown_preset_lists_the_names():
    with pytest.raises(KeyError, match="loss-b8-640-50gt"):
        get_preset("loss-b9")


def test_default_preset_sets_per_device():
    cpu = presets_for("all", "cpu")
    assert cpu and all(p.device == "cpu" and not p.name.startswith("tiny") for p in cpu)
    assert {p.kind for p in presets_for("ops", "cpu")} == {"loss", "assign", "ema", "musgd", "loss26"}
    assert [p.model for p in presets_for("step", "cpu")] == ["yolov8n", "yolo11n", "yolo26n"]
    gpu = presets_for("ops", "cuda")
    assert gpu and all(p.device == "cuda" for p in gpu)
    shapes = {(p.batch, p.n_gt) for p in gpu if p.kind == "loss"}
    assert shapes == {(16, 50), (64, 50), (16, 1000), (64, 1000)}
    assert [p.name for p in presets_for("ops", "cpu", ["tiny-ema"])] == ["tiny-ema"]
    assert all(p.gate for p in PRESETS.values() if p.name.startswith("assign-dense-b1-640"))


# ------------------------------------------------------------------------------------------ inputs
def test_loss_inputs_deterministic_and_shaped():
    a, b, c = loss_inputs("tiny-loss", seed=3), loss_inputs("tiny-loss", seed=3), loss_inputs("tiny-loss", 4)
    for f in ("pred_dist", "pred_scores", "gt_labels", "gt_bboxes", "mask_gt"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert not torch.equal(a.gt_bboxes, c.gt_bboxes) and not torch.equal(a.pred_dist, c.pred_dist)
    p = get_preset("tiny-loss")
    A = p.n_anchors
    assert a.pred_dist.shape == (p.batch, A, 64) and a.pred_scores.shape == (p.batch, A, p.nc)
    assert a.anchor_points.shape == (A, 2) and a.stride_tensor.shape == (A, 1)
    assert a.gt_bboxes.shape == (p.batch, p.m_padded, 4) and a.gt_labels.shape == (p.batch, p.m_padded, 1)
    assert a.mask_gt.sum((1, 2)).tolist() == [p.n_gt] * p.batch
    real = a.gt_bboxes[a.mask_gt[..., 0] > 0]
    assert (real[:, 2:] > real[:, :2]).all() and real.min() >= 0 and real.max() <= p.imgsz
    assert (a.gt_labels >= 0).all() and (a.gt_labels < p.nc).all()
    feats = a.feats()
    assert [tuple(f.shape) for f in feats] == [(2, 68, 16, 16), (2, 68, 8, 8), (2, 68, 4, 4)]
    flat = torch.cat([f.flatten(2) for f in feats], 2).transpose(1, 2)
    assert torch.equal(flat, torch.cat((a.pred_dist, a.pred_scores), -1))


def test_gt_sizes_vary_and_predictions_sit_near_gts():
    from yolofast.boxes import box_iou

    li = loss_inputs(dataclasses.replace(get_preset("loss-b8-640-50gt"), batch=2), seed=0)
    real = li.gt_bboxes[li.mask_gt[..., 0] > 0]
    side = (real[:, 2:] - real[:, :2]).amax(1)
    assert side.min() < 16 and side.max() > 150  # tiny boxes (widened by the assigner) and large ones
    _, _, _, fg, gt_idx = li.assigned
    assert fg.float().mean() > 0.01  # the assigner finds a real foreground
    pd_px = li.assign_args()[1]
    for b in range(2):
        gt = li.gt_bboxes[b, gt_idx[b, fg[b]]]
        iou = box_iou(pd_px[b, fg[b]], gt).diagonal()
        assert iou.mean() > 0.5, "foreground predictions should regress their GT (random boxes give ~0)"
    scores = li.pred_scores.sigmoid()
    lab = li.assigned[0]
    fg_score = scores.gather(2, lab[..., None])[..., 0][fg]
    assert fg_score.mean() > 10 * scores[~fg].mean()


def test_ema_and_step_inputs():
    e1, e2 = ema_inputs("tiny-ema", seed=1), ema_inputs("tiny-ema", seed=1)
    assert torch.equal(e1.ema_flat, e2.ema_flat) and e1.numel == 16 * 27 + 32
    assert torch.equal(torch.cat([t.flatten() for t in e1.ema_list]), e1.ema_flat)
    assert e1.ema_list[0].data_ptr() != e1.ema_flat.data_ptr()  # separate tensors, like a model's
    s = step_inputs("tiny-step", seed=0)
    p = get_preset("tiny-step")
    assert s.img.shape == (p.batch, 3, p.imgsz, p.imgsz) and s.img.min() >= 0 and s.img.max() <= 1
    assert s.batch["gt_bboxes"].shape == (p.batch, 16, 4) and s.batch["gt_bboxes"].max() <= 1


# ------------------------------------------------------------------------------------------ runner
def test_runner_rows_with_ratios_on_a_tiny_preset():
    cases = build_cases("tiny-loss", ops=("tal_assign",))
    assert [c.op for c in cases] == ["tal_assign"] and cases[0].variants[0].name == "ref"
    rows = time_case(cases[0], rounds=2, min_round_s=0.0)
    ref = next(r for r in rows if r.backend == "ref")
    assert ref.status == "ok" and len(ref.times_ms) == 2 and ref.speedup == pytest.approx(1.0)
    cpp = next(r for r in rows if r.backend == "cpp")
    if cpp.status == "ok":
        assert cpp.speedup > 0 and cpp.ratio_vs_ref == pytest.approx(1 / cpp.speedup)
    else:
        assert cpp.status == "n/a" and cpp.note
    assert "tal_assign" in format_table(rows)


def test_rounds_alternate_blocks_and_keep_each_variants_fastest(monkeypatch):
    """Fake clock: each call advances it by a scripted time; a 'burst' makes one block 5x slower."""
    from yolofast.bench import clock as bench_clock

    t = [0.0]
    monkeypatch.setattr(bench_clock, "now", lambda kind: lambda: t[0])
    order = []
    script = {  # warm-up, then 3 blocks of 1 call per round, 2 rounds
        "ref": iter([1.0, 1.0, 5.0, 1.2, 1.1, 1.0, 4.0]),
        "cpp": iter([1.0, 0.5, 0.5, 3.0, 2.5, 0.6, 0.55]),  # warm-up 1 s: 3 calls a round too
    }

    def call(name):
        def fn():
            order.append(name)
            t[0] += next(script[name])
        return fn

    case = Case(get_preset("tiny-loss"), "tal_assign", "cpu", [Variant("ref", call("ref")),
                                                               Variant("cpp", call("cpp"))])
    rows = {r.backend: r for r in time_case(case, rounds=2, min_round_s=3.0, chunks=3)}
    assert rows["ref"].calls_per_round == 3 and rows["cpp"].calls_per_round == 3
    # after the warm-ups: ABBAAB, then the next round starts with the other variant: BAABBA
    assert order[2:] == ["ref", "cpp", "cpp", "ref", "ref", "cpp", "cpp", "ref", "ref", "cpp", "cpp", "ref"]
    assert rows["ref"].times_ms == pytest.approx([1000.0, 1000.0])  # the bursts (5 s, 4 s) are dropped
    assert rows["cpp"].times_ms == pytest.approx([500.0, 550.0])
    assert rows["cpp"].ratios == pytest.approx([0.5, 0.55]) and rows["cpp"].clock == "cpu"


def test_unavailable_and_failing_backends_become_rows():
    def boom():
        raise RuntimeError("kernel exploded")

    case = Case(get_preset("tiny-loss"), "tal_assign", "cpu", [
        Variant("ref", lambda: None),
        Variant("cuda", None, "the cuda kernels run on cuda tensors"),
        Variant("cpp", boom),
    ])
    rows = {r.backend: r for r in time_case(case, rounds=2, min_round_s=0.0)}
    assert rows["ref"].status == "ok"
    assert rows["cuda"].status == "n/a" and "cuda tensors" in rows["cuda"].note
    assert rows["cpp"].status == "error" and "kernel exploded" in rows["cpp"].note
    table = format_table(list(rows.values()))
    assert "n/a (the cuda kernels run on cuda tensors)" in table and "error (RuntimeError" in table


def test_paired_ratios_from_fabricated_times():
    ref = Row("p", "op", "ref", "cpu", times_ms=[10.0, 20.0, 12.0], median_ms=12.0, peak_mb=100.0)
    fused = Row("p", "op", "cpp", "cpu", times_ms=[1.0, 4.0, 1.0], median_ms=1.0, peak_mb=4.0)
    fill_ratios([ref, fused])
    assert fused.speedup == pytest.approx(10.0)  # median of 10, 5, 12: pairs, not 12/1
    assert fused.ratio_vs_ref == pytest.approx(0.1) and fused.mem_saving == pytest.approx(25.0)


@pytest.mark.parametrize("preset", ["tiny-step", "tiny-step26"])
def test_step_case_reports_images_per_second(preset):
    case = build_cases(preset)[0]
    assert [v.name for v in case.variants] == ["ref", "auto"] and "tal_assign=" in case.variants[1].reason
    rows = time_case(case, rounds=1, min_round_s=0.0)
    assert all(r.status == "ok" and r.images_per_s > 0 for r in rows), [r.note for r in rows]


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS reset needs Linux")
def test_cpu_peak_memory_of_one_call():
    mb = _peak_one_call_cpu(lambda: torch.ones(64 * 2**20 // 4).sum())
    assert mb is not None and 48 < mb < 100, mb  # the 64 MB tensor, give or take allocator slack
    assert _peak_one_call_cpu(lambda: None) < 16


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS reset needs Linux")
def test_peak_memory_in_a_fresh_subprocess():
    case = build_cases("tiny-loss", ops=("tal_assign",))[0]
    peaks = measure_peaks(case, seed=0, threads=1)
    assert set(peaks) == {v.name for v in case.variants if v.available}
    # The reference's dense (B, M, A) temporaries (B=2, M=16, A=336) are several 100 kB; a number, not None.
    assert peaks["ref"] is not None and peaks["ref"] > 0.1


# ------------------------------------------------------------------------------------------ CLI + JSON
def test_bench_main_writes_json(tmp_path, capsys):
    out = tmp_path / "run.json"
    rc = bench_main(["ops", "--device", "cpu", "--preset", "tiny-ema", "--json", str(out), "--threads", "1",
                     "--rounds", "2", "--no-memory", "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "ema_update" in printed and "foreach_lerp" in printed
    data = json.loads(out.read_text())
    assert data["schema"] == "yolofast-bench/1" and data["threads"] == 1
    assert set(data["versions"]) == {"yolofast", "torch", "triton", "python"}
    assert data["versions"]["torch"] == torch.__version__
    assert data["device"]["type"] == "cpu" and data["timestamp"]
    assert "git_commit" in data and (data["git_commit"] is None or len(data["git_commit"]) == 40)
    rows = {r["backend"]: r for r in data["rows"]}
    assert {"ref", "cpp", "foreach_lerp", "copy"} <= set(rows)
    for key in ("preset", "op", "backend", "status", "median_ms", "times_ms", "speedup", "ratio_vs_ref",
                "peak_mb", "images_per_s"):
        assert key in rows["ref"], key
    assert rows["ref"]["median_ms"] > 0 and rows["copy"]["baseline"] is True


def test_bench_main_bad_arguments(capsys):
    assert bench_main(["ops", "--preset", "no-such-preset", "--quiet", "--no-memory"]) == 2
    assert "unknown benchmark preset" in capsys.readouterr().err
    assert bench_main(["--compare", "/nonexistent/a.json", "/nonexistent/b.json"]) == 2
    assert bench_main(["--list"]) == 0 and "loss-b8-640-50gt" in capsys.readouterr().out


def test_key_value_arguments():
    a = parse_bench_args(["step", "preset=tiny-step", "rounds=3", "no_memory=true"])
    assert (a.what, a.preset, a.rounds, a.no_memory) == ("step", ["tiny-step"], 3, True)


# ------------------------------------------------------------------------------------------ --compare
def _run(path, rows):
    path.write_text(json.dumps({"schema": "yolofast-bench/1", "rows": rows}))
    return str(path)


def _row(preset, op, backend, ms, ref_ms=None, status="ok", baseline=False, rounds=0, spread=0.03):
    """A row; with ``rounds``, per-round times (and paired ratios) scattered by +-``spread`` around it."""
    r = {"preset": preset, "op": op, "backend": backend, "status": status, "median_ms": ms,
         "baseline": baseline, "note": "" if status == "ok" else "not built"}
    if ref_ms is not None and ms is not None:
        r["ratio_vs_ref"] = ms / ref_ms
    if rounds and ms is not None:
        jitter = [1 + spread * ((7 * i) % rounds / (rounds - 1) * 2 - 1) for i in range(rounds)]
        r["times_ms"] = [ms * j for j in jitter]
        if ref_ms is not None and backend != "ref":
            r["ratios"] = [ms / ref_ms * j for j in jitter]
    return r


def test_compare_flags_a_ratio_regression(tmp_path, capsys):
    old = _run(tmp_path / "old.json", [_row("p", "op", "ref", 100, 100, rounds=9),
                                       _row("p", "op", "cpp", 10, 100, rounds=9)])
    # The new machine is 2x faster in absolute time, but the fused op lost ground against its reference.
    worse = _run(tmp_path / "worse.json", [_row("p", "op", "ref", 50, 50, rounds=9),
                                           _row("p", "op", "cpp", 6, 50, rounds=9)])
    same = _run(tmp_path / "same.json", [_row("p", "op", "ref", 50, 50, rounds=9),
                                         _row("p", "op", "cpp", 5.2, 50, rounds=9)])
    assert bench_main(["--compare", old, worse, "--threshold", "0.1"]) == 1
    text = capsys.readouterr().out
    assert "REGRESSION" in text and "+20.0%" in text and "95 % bootstrap interval" in text
    assert bench_main(["--compare", old, same, "--threshold", "0.1"]) == 0
    # +20 % with rounds spread by +-3 %: the interval lies inside [+10 %, +30 %], so under a 25 %
    # threshold it is neither a regression nor clear of one.
    assert bench_main(["--compare", old, worse, "--threshold", "0.25"]) == 0
    assert "inconclusive" in capsys.readouterr().out
    assert bench_main(["--compare", old, worse, "--threshold", "0.35"]) == 0


def test_compare_of_files_without_rounds_says_it_cannot_tell(tmp_path):
    # Files of an older yolofast kept only medians: a 20 % change is reported, never called a regression.
    old = _run(tmp_path / "old.json", [_row("p", "op", "ref", 100, 100), _row("p", "op", "cpp", 10, 100)])
    new = _run(tmp_path / "new.json", [_row("p", "op", "ref", 50, 50), _row("p", "op", "cpp", 6, 50)])
    [_, c] = compare(load_results(old), load_results(new), 0.1)
    assert c.verdict == "inconclusive" and "no per-round data" in c.note and c.low is None
    assert c.change == pytest.approx(0.2)
    printed = []
    assert compare_files(old, new, 0.1, out=printed.append) == 0
    assert "less reliable" in printed[-1]


def test_compare_without_references_uses_absolute_times(tmp_path):
    old = _run(tmp_path / "a.json", [_row("p", "op", "cpp", 10.0, rounds=9, spread=0.01)])
    new = _run(tmp_path / "b.json", [_row("p", "op", "cpp", 11.5, rounds=9, spread=0.01)])
    [c] = compare(load_results(old), load_results(new), 0.1)
    assert (c.metric, c.verdict) == ("ms", "REGRESSION") and c.change == pytest.approx(0.15)
    assert c.low > 0.1 and c.high < 0.2
    assert compare_files(old, new, 0.2, out=lambda *_: None) == 0
    data = json.loads(Path(new).read_text())
    Path(new).write_text(json.dumps({**data, "threads": 2}))
    Path(old).write_text(json.dumps({**json.loads(Path(old).read_text()), "threads": 1}))
    printed = []
    compare_files(old, new, 0.2, out=printed.append)
    assert "warning: the runs differ in threads: 1 vs 2" in printed


def test_compare_remeasures_a_suspect_once(tmp_path):
    old = _run(tmp_path / "old.json", [_row("p", "op", "ref", 100, 100, rounds=9),
                                       _row("p", "op", "cpp", 10, 100, rounds=9),
                                       _row("q", "op", "ref", 100, 100, rounds=9),
                                       _row("q", "op", "cpp", 10, 100, rounds=9)])
    new = _run(tmp_path / "new.json", [_row("p", "op", "ref", 100, 100, rounds=9),
                                       _row("p", "op", "cpp", 13, 100, rounds=9),
                                       _row("q", "op", "ref", 100, 100, rounds=9),
                                       _row("q", "op", "cpp", 10, 100, rounds=9)])
    asked = []

    def healthy_again(new_res, suspects):  # the second measurement finds the old speed
        asked.append([(c.preset, c.op, c.backend) for c in suspects])
        return [_row("p", "op", "ref", 100, 100, rounds=9), _row("p", "op", "cpp", 10.2, 100, rounds=9)]

    printed = []
    assert compare_files(old, new, 0.1, out=printed.append, remeasure=healthy_again) == 0
    assert asked == [[("p", "op", "cpp")]]  # only the suspect, once
    assert "re-measuring p/op/cpp once" in printed
    assert "first run and re-measurement pooled (first: REGRESSION +30.0%)" in printed[-1]

    def slow_again(new_res, suspects):
        return [_row("p", "op", "ref", 100, 100, rounds=9), _row("p", "op", "cpp", 12.8, 100, rounds=9)]

    assert compare_files(old, new, 0.1, out=lambda *_: None, remeasure=slow_again) == 1


def test_remeasure_pools_the_rounds_of_both_runs(tmp_path):
    """A slowdown seen at +28 %, then at +21 % in a noisier re-measurement: alone, the re-measurement's
    interval reaches under 10 % (inconclusive); pooled with the first run's rounds it is a regression."""
    old = _run(tmp_path / "old.json", [_row("p", "op", "ref", 100, 100, rounds=15),
                                       _row("p", "op", "cpp", 10, 100, rounds=15, spread=0.05)])
    new = _run(tmp_path / "new.json", [_row("p", "op", "ref", 100, 100, rounds=15),
                                       _row("p", "op", "cpp", 12.8, 100, rounds=15, spread=0.15)])
    again = [_row("p", "op", "ref", 100, 100, rounds=15), _row("p", "op", "cpp", 12.1, 100, rounds=15,
                                                                  spread=0.3)]
    alone = _run(tmp_path / "again.json", again)
    [_, c] = compare(load_results(old), load_results(alone), 0.1)
    assert c.verdict == "inconclusive" and c.low < 0.1 < c.change
    [_, c] = decide_files(old, new, 0.1, out=lambda *_: None, remeasure=lambda n, s: again)
    assert c.verdict == "REGRESSION" and "pooled" in c.note
    assert len(load_results(new)["rows"][1]["ratios"]) == 15  # the file itself is not changed


def test_compare_lost_backend_and_reference_drift(tmp_path):
    old = _run(tmp_path / "a.json", [_row("p", "op", "ref", 100, 100), _row("p", "op", "cpp", 10, 100)])
    new = _run(tmp_path / "b.json", [_row("p", "op", "ref", 300, 300), _row("p", "op", "cpp", None,
                                                                                 status="n/a")])
    changes = {c.backend: c for c in compare(load_results(old), load_results(new), 0.1)}
    assert changes["ref"].verdict == "info"  # a slower reference is the machine, never a regression
    assert changes["cpp"].verdict == "lost"
    assert compare_files(old, new, 0.1, out=lambda *_: None) == 1


def test_compare_reads_pytest_benchmark_json(tmp_path):
    def pb(ref_s, cpp_s, n=9):
        spread = [1 + 0.02 * ((5 * i) % n - n // 2) / n for i in range(n)]
        return {"benchmarks": [
            # benchmarks/conftest.py's `measure` records the variant in extra_info; --benchmark-json
            # keeps every round's time in stats.data
            {"group": "loss-b8", "name": "test_tal_assign[ref]", "params": {"impl": "ref"},
             "extra_info": {"variant": "ref"},
             "stats": {"median": ref_s, "data": [ref_s * j for j in spread]}},
            {"group": "loss-b8", "name": "test_tal_assign[cpp]", "params": {"impl": "cpp"},
             "extra_info": {"variant": "cpp"},
             "stats": {"median": cpp_s, "data": [cpp_s * j for j in spread]}},
        ]}

    (tmp_path / "a.json").write_text(json.dumps(pb(1.0, 0.1)))
    (tmp_path / "b.json").write_text(json.dumps(pb(1.0, 0.2)))
    res = load_results(tmp_path / "a.json")
    assert res["source"] == "pytest-benchmark" and {r["backend"] for r in res["rows"]} == {"ref", "cpp"}
    cpp = next(r for r in res["rows"] if r["backend"] == "cpp")
    assert len(cpp["times_ms"]) == 9 and cpp["paired"] is False  # separate tests: rounds do not pair
    assert compare_files(tmp_path / "a.json", tmp_path / "b.json", 0.1, out=lambda *_: None) == 1
    assert compare_files(tmp_path / "a.json", tmp_path / "a.json", 0.1, out=lambda *_: None) == 0
    [_, c] = compare(load_results(tmp_path / "a.json"), load_results(tmp_path / "b.json"))
    assert c.verdict == "REGRESSION" and c.low is not None and c.change == pytest.approx(1.0)


# ------------------------------------------------------------------------------------------ CI gate
def _measured(speedups: dict, status: dict | None = None) -> list[dict]:
    rows = []
    for key, s in speedups.items():
        preset, op = key.split("/")
        st = (status or {}).get(key, "ok")
        rows.append({"preset": preset, "op": op, "backend": "ref", "status": "ok", "median_ms": 100.0})
        rows.append({"preset": preset, "op": op, "backend": "cpp", "status": st, "note": "no compiler",
                     "median_ms": 100.0 / s if st == "ok" else None, "speedup": s if st == "ok" else None})
    return rows


def test_floor_check_logic():
    floors = {"a/tal_assign": 20.0, "b/ema_update": 0.6}
    ok, res = check_floors(_measured({"a/tal_assign": 25.0, "b/ema_update": 0.9}), floors)
    assert ok and [r.verdict for r in res] == ["PASS", "PASS"]
    ok, res = check_floors(_measured({"a/tal_assign": 19.0, "b/ema_update": 0.9}), floors)
    assert not ok and res[0].verdict == "FAIL" and "19.00x < floor 20.00x" in res[0].note
    missing = _measured({"a/tal_assign": 25.0, "b/ema_update": 1.0}, status={"b/ema_update": "n/a"})
    ok, res = check_floors(missing, floors)
    assert not ok and res[1].verdict == "FAIL" and "YOLOFAST_GATE_ALLOW_MISSING" in res[1].note
    ok, res = check_floors(missing, floors, allow_missing=True)
    assert ok and res[1].verdict == "SKIP"
    crashed = _measured({"a/tal_assign": 25.0, "b/ema_update": 1.0}, status={"b/ema_update": "error"})
    assert not check_floors(crashed, floors, allow_missing=True)[0]  # a crash is never "missing"
    assert not check_floors(_measured({"a/tal_assign": 25.0}), floors)[0]  # an op that was not measured
    with pytest.raises(ValueError, match="preset/op"):
        check_floors([], {"no-slash": 1.0})


@pytest.fixture
def gate_module():
    env = dict(os.environ)
    spec = importlib.util.spec_from_file_location("yolofast_gate", ROOT / "benchmarks" / "gate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    yield mod
    os.environ.clear()
    os.environ.update(env)  # the gate pins OMP_NUM_THREADS=1 for its own process


def _jittered(speedups: dict, rounds: int = 9, spread: float = 0.03):
    """_measured rows that also carry per-round ratios scattered by +-``spread``."""
    rows = _measured(speedups)
    for r in rows:
        if r["backend"] != "ref" and r.get("speedup"):
            r["ratios"] = [1 / r["speedup"] * (1 + spread * ((7 * i) % rounds / (rounds - 1) * 2 - 1))
                           for i in range(rounds)]
    return rows


def test_gate_main_on_fabricated_timings(gate_module, tmp_path, monkeypatch):
    monkeypatch.setenv("YOLOFAST_CPU_ARCH", "x86-64-v3")  # an AVX2 build: judged by the avx2 floors
    floors = tmp_path / "floors.json"
    floors.write_text(json.dumps({"backend": "cpp", "rounds": 3, "isa": {
        "avx2": {"floors": {"loss-b8-640-50gt/tal_assign": {"floor": 20.0}, "ema-yolov8s/ema_update": 0.5}},
        "avx512": {"floors": {"loss-b8-640-50gt/tal_assign": {"floor": 35.0},
                              "ema-yolov8s/ema_update": 0.5}}}}))
    printed = []

    def fake(speedups, status=None):
        return lambda keys, **kw: _measured({k: speedups[k] for k in keys}, status)

    good = {"loss-b8-640-50gt/tal_assign": 30.0, "ema-yolov8s/ema_update": 1.0}  # < the avx512 floor
    bad = {"loss-b8-640-50gt/tal_assign": 12.0, "ema-yolov8s/ema_update": 1.0}
    argv = ["--floors", str(floors), "--quiet"]
    assert gate_module.main(argv, measure_fn=fake(good), out=printed.append) == 0
    assert "gate: PASS" in printed[-1] and any("median ms" in p for p in printed)  # the table is printed
    assert any("the avx2 floors" in p for p in printed)
    assert gate_module.main(argv, measure_fn=fake(bad), out=printed.append) == 1
    assert any("gate: FAIL" in p and "CPU:" in p and "-march=x86-64-v3" in p for p in printed[-3:])
    na = fake(good, status={"ema-yolov8s/ema_update": "n/a"})
    monkeypatch.delenv("YOLOFAST_GATE_ALLOW_MISSING", raising=False)
    assert gate_module.main(argv, measure_fn=na, out=printed.append) == 1
    monkeypatch.setenv("YOLOFAST_GATE_ALLOW_MISSING", "1")
    assert gate_module.main(argv, measure_fn=na, out=printed.append) == 0
    # --write-floors sets this ISA's floors at sqrt(lowest x median / 1.3) and keeps the other ISA's
    runs = iter([36.0, 40.0, 44.0])
    vary = lambda keys, **kw: _measured({k: next(runs) if "tal" in k else 1.0 for k in keys})  # noqa: E731
    assert gate_module.main(argv + ["--write-floors", "--repeat", "3"], measure_fn=vary,
                            out=printed.append) == 0
    written = json.loads(floors.read_text())["isa"]
    assert written["avx2"]["floors"]["loss-b8-640-50gt/tal_assign"] == {
        "floor": 33.28, "measured": 40.0, "runs": [36.0, 40.0, 44.0]}  # sqrt(36 x 40 / 1.3)
    assert written["avx2"]["arch"] == "x86-64-v3" and "YOLOFAST_CPU_ARCH=x86-64-v3" in written["avx2"]["how"]
    assert written["avx512"]["floors"]["loss-b8-640-50gt/tal_assign"] == {"floor": 35.0}
    # --more-runs adds a run to the kept ones (a 3-run measurement split into short calls)
    runs = iter([38.0])
    assert gate_module.main(argv + ["--write-floors", "--repeat", "1", "--more-runs"], measure_fn=vary,
                            out=printed.append) == 0
    tal = json.loads(floors.read_text())["isa"]["avx2"]["floors"]["loss-b8-640-50gt/tal_assign"]
    assert tal == {"floor": 32.86, "measured": 39.0, "runs": [36.0, 40.0, 44.0, 38.0]}  # sqrt(36 x 39 / 1.3)
    # runs spread wider than 1.3x: the floor is written, with a warning that it cannot catch 1.3x
    runs = iter([29.0, 40.0, 44.0])
    assert gate_module.main(argv + ["--write-floors", "--repeat", "3"], measure_fn=vary,
                            out=printed.append) == 0
    tal = json.loads(floors.read_text())["isa"]["avx2"]["floors"]["loss-b8-640-50gt/tal_assign"]
    assert "cannot tell a 1.3x slower kernel" in tal["note"]
    assert any(p.startswith("warning: loss-b8-640-50gt/tal_assign") for p in printed)


def test_gate_write_floors_keys_adds_an_op_and_keeps_the_others(gate_module, tmp_path, monkeypatch):
    """--keys: an op this ISA has no floor for yet is measured alone and merged in; the set's other floors
    (and how they were set) stay as they were. The plain gate names the default ops it does not gate."""
    monkeypatch.setenv("YOLOFAST_CPU_ARCH", "x86-64-v3")
    floors = tmp_path / "floors.json"
    old = {"floor": 20.0, "measured": 22.0, "runs": [21.0, 22.0, 23.0]}
    floors.write_text(json.dumps({"backend": "cpp", "rounds": 3, "isa": {"avx2": {
        "floors": {"loss-b8-640-50gt/tal_assign": old}, "how": "earlier", "measured_on": "2026-01-01"}}}))
    argv = ["--floors", str(floors), "--quiet"]
    printed, seen = [], []
    runs = iter([18.0, 19.0, 20.0])

    def measure(keys, **kw):
        seen.append(list(keys))
        return _measured({k: next(runs) if "loss26" in k else 30.0 for k in keys})

    key = "loss26-b8-640-50gt/loss26_step"
    assert gate_module.main(argv + ["--write-floors", "--repeat", "3", "--keys", key], measure_fn=measure,
                            out=printed.append) == 0
    assert seen == [[key]] * 3
    avx2 = json.loads(floors.read_text())["isa"]["avx2"]
    assert avx2["floors"]["loss-b8-640-50gt/tal_assign"] == old and avx2["how"] == "earlier"
    new = avx2["floors"][key]
    assert (new["floor"], new["runs"]) == (16.22, [18.0, 19.0, 20.0])  # sqrt(18 x 19 / 1.3)
    assert f"--keys {key}" in new["how"] and "YOLOFAST_CPU_ARCH=x86-64-v3" in new["how"]
    printed.clear()
    assert gate_module.main(argv, measure_fn=lambda keys, **kw: _measured(dict.fromkeys(keys, 30.0)),
                            out=printed.append) == 0
    assert any(p.startswith("not gated here") and "musgd-yolo26n/musgd_step" in p for p in printed)
    assert gate_module.main(argv + ["--keys", "musgd-yolo26n/musgd_step"], measure_fn=measure,
                            out=printed.append) == 2  # gating a key without a floor: an error, not a pass


def test_a_floor_sits_between_the_healthy_runs_and_a_1_3x_slower_one(gate_module):
    runs = [40.0, 43.0, 46.0]
    floor = gate_module.floor_from_runs(runs)
    assert min(runs) > floor > 43.0 / 1.3 and gate_module.separates(runs)
    assert not gate_module.separates([30.0, 43.0, 46.0])  # 30 < 43 / 1.3: no floor tells them apart


def test_gate_remeasures_and_fails_only_twice_under_the_floor(gate_module, tmp_path, monkeypatch):
    monkeypatch.setenv("YOLOFAST_CPU_ARCH", "x86-64-v3")
    floors = tmp_path / "floors.json"
    floors.write_text(json.dumps({"isa": {"avx2": {"floors": {"a-b8/bbox_loss": 3.0,
                                                              "c-b1/tal_assign": 20.0}}}}))
    argv = ["--floors", str(floors), "--quiet"]
    calls = []

    def fake(sequence):
        def measure(keys, **kw):
            calls.append(list(keys))
            return _jittered({k: sequence[len(calls) - 1][k] for k in keys})
        return measure

    printed = []
    # a noisy first run of bbox_loss (2.8x < 3.0x) that is healthy again: PASS, and only it re-measured
    seq = [{"a-b8/bbox_loss": 2.8, "c-b1/tal_assign": 30.0}, {"a-b8/bbox_loss": 3.4}]
    assert gate_module.main(argv, measure_fn=fake(seq), out=printed.append) == 0
    assert calls == [["a-b8/bbox_loss", "c-b1/tal_assign"], ["a-b8/bbox_loss"]]
    # under its floor twice (a real 1.3x slowdown of a 3.4x op: 2.6x): FAIL, with both speed-ups named
    calls.clear()
    seq = [{"a-b8/bbox_loss": 2.6, "c-b1/tal_assign": 30.0}, {"a-b8/bbox_loss": 2.65}]
    assert gate_module.main(argv, measure_fn=fake(seq), out=printed.append) == 1
    table = printed[-3]
    assert "first run 2.60x" in table and "2.65x < floor 3.00x" in table and "interval" in table


def test_repository_floors_cover_every_fused_cpu_op(gate_module):
    data = gate_module.load_floors()
    assert set(data["isa"]) == {"avx2", "avx512"}  # both CPU kinds CI runs on
    for isa in ("avx2", "avx512"):
        ops = {k.split("/")[1] for k in data["isa"][isa]["floors"]}
        assert {"tal_assign", "bbox_loss", "ema_update"} <= ops, isa
        for k, v in gate_module.floor_values(data, isa).items():
            preset = get_preset(k.split("/")[0])
            assert preset.device == "cpu" and k.split("/")[1] in preset.ops and v > 0, k


def test_gate_is_runnable_as_a_script():
    import subprocess

    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gate.py"), "--help"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0 and "floors" in res.stdout
