"""tal_assign: pure-PyTorch reference vs the sparse C++ kernel, side by side in one run (2 threads).

    python -m pytest benchmarks/bench_tal_assign.py --benchmark-columns=min,median,max,rounds

One pytest-benchmark group per scene (ref and cpp rows in the same table), then a summary of the speed and
peak-memory ratios against the goals of DESIGN §7 (dense scenes: >= 20x faster, >= 20x less peak memory).

Peak memory: each (scene, implementation) runs once in a fresh subprocess that builds the inputs, warms
the implementation up on a tiny scene, resets the kernel's peak-RSS counter (``echo 5 >
/proc/self/clear_refs``), calls the op once and reports VmHWM - VmRSS-before from /proc/self/status:
the resident memory the call added at its peak (outputs included), whatever allocated it (torch's CPU
allocator is invisible to tracemalloc). glibc's mmap threshold is pinned to 64 KiB in that process so freed
blocks go back to the OS and cannot hide an allocation. Without clear_refs the ru_maxrss delta is used.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import subprocess
import sys

import pytest
import torch

THREADS = 2
# name -> (B, imgsz, GT per image, smallest and largest GT side in px)
SCENES = {
    "b8_640px_50gt": (8, 640, 50, 4.0, 400.0),
    "dense_b2_640px_1000gt": (2, 640, 1000, 4.0, 96.0),
    "dense_b1_1024px_3000gt": (1, 1024, 3000, 4.0, 128.0),
}
_WARMUP = {"tiny": (1, 64, 3, 4.0, 32.0)}
DENSE_GOAL = 20.0  # DESIGN §7: dense scenes >= 20x faster and >= 20x less peak memory
ARGS = (10, 0.5, 6.0, 1e-9)  # topk, alpha, beta, eps


def make_scene(name: str, seed: int = 0):
    """Realistic inputs: GT sides log-uniform in the scene's range, 80 classes, predictions half jittered
    GT copies (so the GTs compete for anchors) and half boxes around their own anchor."""
    from yolofast.boxes import make_anchors

    B, imgsz, M, lo, hi = SCENES[name] if name in SCENES else _WARMUP[name]
    C = 80
    g = torch.Generator().manual_seed(seed)
    feats = [torch.empty(1, 1, imgsz // s, imgsz // s) for s in (8, 16, 32)]
    pts, stride = make_anchors(feats, (8, 16, 32))
    anc = pts * stride
    A = anc.shape[0]
    centre = torch.rand(B, M, 2, generator=g) * imgsz
    wh = torch.exp(torch.rand(B, M, 2, generator=g) * (math.log(hi) - math.log(lo)) + math.log(lo))
    gt = torch.cat((centre - wh / 2, centre + wh / 2), -1)
    labels = torch.randint(0, C, (B, M, 1), generator=g).float()
    mask = torch.ones(B, M, 1)
    base = gt.gather(1, torch.randint(0, M, (B, A, 1), generator=g).expand(B, A, 4))
    size = (base[..., 2:] - base[..., :2]).repeat(1, 1, 2)
    jittered = base + (torch.rand(B, A, 4, generator=g) - 0.5) * 0.4 * size
    own_wh = torch.exp(torch.rand(B, A, 2, generator=g) * 4 + 1.5)
    own = torch.cat((anc - own_wh / 2, anc + own_wh / 2), -1)
    pd = torch.where(torch.rand(B, A, 1, generator=g) < 0.5, jittered, own)
    pd = torch.cat((torch.minimum(pd[..., :2], pd[..., 2:]), torch.maximum(pd[..., :2], pd[..., 2:])), -1)
    scores = torch.sigmoid(torch.randn(B, A, C, generator=g) * 2 - 2)
    return scores, pd, anc, labels, gt, mask


def get_impl(impl: str):
    """A callable(*inputs) for "ref" or "cpp"; None (with the reason) when cpp cannot be built."""
    if impl == "ref":
        from yolofast.ops.reference import tal_assign_ref

        return (lambda *a: tal_assign_ref(*a, *ARGS)), ""
    from yolofast.ops import _build

    ok, why = _build.extension_status("cpp")
    if not ok:
        return None, why
    op = torch.ops.yolofast.tal_assign
    return (lambda *a: op(*a, *ARGS)), ""


# ------------------------------------------------------------------------------------------- peak memory
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def peak_memory_child(scene: str, impl: str) -> dict:
    """Runs in the subprocess: the extra resident memory (MB) at the peak of one call."""
    torch.set_num_threads(THREADS)
    fn, why = get_impl(impl)
    if fn is None:
        return {"error": why}
    fn(*make_scene("tiny"))  # one-time setup (extension load, thread pool), not counted
    inputs = make_scene(scene)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        method = "VmHWM after clear_refs"
        before = _status_kb("VmRSS")
        fn(*inputs)
        peak = _status_kb("VmHWM") - before
    except OSError:
        method = "ru_maxrss delta"
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        fn(*inputs)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    return {"peak_mb": peak / 1024.0, "method": method}


def measure_peak_memory(scene: str, impl: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--peak-memory", scene, impl]
    # A fixed mmap threshold: every block >= 64 KiB is mapped on malloc and unmapped on free, so RSS follows
    # the live bytes (glibc's dynamic threshold would let warm-up leftovers hide up to 32 MiB blocks).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    if out.returncode != 0:
        return {"error": f"rc={out.returncode}: {out.stderr.strip().splitlines()[-1:]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------- pytest
RESULTS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _summary(request):
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(threads)
    tr = request.config.pluginmanager.getplugin("terminalreporter")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    if tr is None or not RESULTS:
        return
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        _write_summary(tr)


def _write_summary(tr) -> None:
    tr.write_line("")
    tr.write_line(f"tal_assign ratios (reference / cpp), {THREADS} threads, same run:")
    tr.write_line(
        f"{'scene':26s} {'ref ms':>9s} {'cpp ms':>8s} {'speed':>7s} {'ref MB':>8s} {'cpp MB':>7s} {'mem':>7s}"
    )
    for scene in SCENES:
        r, c = RESULTS.get((scene, "ref")), RESULTS.get((scene, "cpp"))
        if not r or not c:
            continue
        speed = r["median_s"] / c["median_s"]
        mem = r["peak_mb"] / max(c["peak_mb"], 1e-3) if "peak_mb" in r and "peak_mb" in c else float("nan")
        goal = ""
        if scene.startswith("dense"):
            goal = "  goal >= 20x: " + ("met" if speed >= DENSE_GOAL and mem >= DENSE_GOAL else "NOT met")
        tr.write_line(
            f"{scene:26s} {r['median_s'] * 1e3:9.1f} {c['median_s'] * 1e3:8.2f} {speed:6.0f}x "
            f"{r.get('peak_mb', float('nan')):8.1f} {c.get('peak_mb', float('nan')):7.1f} {mem:6.0f}x{goal}"
        )
    methods = {v.get("method") for v in RESULTS.values() if v.get("method")}
    tr.write_line(
        f"peak memory: extra resident memory at the peak of one call ({', '.join(sorted(methods))})"
    )


@pytest.mark.parametrize("impl", ["ref", "cpp"])
@pytest.mark.parametrize("scene", list(SCENES))
def test_tal_assign(benchmark, scene, impl):
    fn, why = get_impl(impl)
    if fn is None:
        pytest.skip(f"C++ extension unavailable: {why}")
    benchmark.group = scene
    inputs = make_scene(scene)
    dense_ref = impl == "ref" and scene.startswith("dense")
    # The dense reference takes seconds and gigabytes per call: 3 rounds are plenty next to its spread.
    rounds = 3 if dense_ref else 20
    benchmark.pedantic(fn, args=inputs, rounds=rounds, iterations=1, warmup_rounds=0 if dense_ref else 2)
    mem = measure_peak_memory(scene, impl)
    benchmark.extra_info.update(mem)
    RESULTS[(scene, impl)] = {"median_s": benchmark.stats.stats.median, **mem}
    if "error" in mem:
        pytest.fail(f"peak-memory subprocess failed: {mem['error']}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--peak-memory":
        print(json.dumps(peak_memory_child(sys.argv[2], sys.argv[3])))
    else:
        sys.exit("usage: bench_tal_assign.py --peak-memory SCENE ref|cpp  (or run it with pytest)")
