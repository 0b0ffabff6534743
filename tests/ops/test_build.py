"""Building, caching and loading the C++ extension (yolofast/ops/_build.py), and its fallbacks; the CUDA
extension compiled for sm_90 with nvcc (a CUDA build of torch), and the GPU-only checks of all its ops
(dispatch, CUDA graphs, opcheck, streams; marker ``cuda``); benchmarks/gpu_bench.py's dry run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from cuda_emulation import HAS_GPU, gpu
from op_inputs import (
    ALPHA,
    BETA,
    EPS,
    NAMES,
    TOPK,
    anchors_640,
    ema_pair,
    losses_and_grads,
    make_inputs,
    random_scene,
)

from yolofast.ops import _build, _compile_ext, _toolchain, reference
from yolofast.ops.reference import ema_update_ref

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def loaded():
    ok, why = _build.extension_status("cpp")
    assert ok, f"the C++ extension did not build/load: {why}"
    from yolofast.ops import _library

    return _library


def test_extension_builds_and_registers_cpu_kernels(loaded):
    report = _build.load_extension()
    assert report.ok and report.cpp and Path(report.library).is_file()
    assert {"cpu/bbox_loss_kernel.cpp", "cpu/ema_update_kernel.cpp"} <= set(report.sources)
    for op in ("bbox_loss", "ema_update", "_threads_seen"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"yolofast::{op}", "CPU"), op
    from yolofast.ops._backend import select_backend

    assert select_backend("bbox_loss", "cpu") == "cpp"
    assert select_backend("ema_update", "cpu") == "cpp"
    assert "built" in str(report) or "cache" in str(report)


def test_cuda_status_explains_itself(loaded):
    ok, why = _build.extension_status("cuda")
    assert isinstance(ok, bool) and why
    with pytest.raises(ValueError, match="kind"):
        _build.extension_status("rocm")


@pytest.mark.parametrize("threads", [1, 2])
def test_kernels_use_the_threads_torch_has(loaded, threads):
    """Without -fopenmp at::parallel_for runs on one thread silently: count the OpenMP threads that ran a
    chunk of each kernel (recorded by the kernels themselves) and compare with torch's setting."""
    B, A, C = 2, 4000, 8
    args = (torch.randn(B, A, 64), torch.randn(B, A, C), torch.rand(A, 2) * 40, torch.rand(B, A, 4) * 40,
            torch.rand(B, A, C), torch.rand(B, A) < 0.1)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        loaded.threads_seen()  # clear
        ema = torch.zeros(1 << 20)
        loaded.ema_update(ema, torch.ones(1 << 20), 0.5)
        assert loaded.threads_seen() == threads
        torch.ops.yolofast.bbox_loss(*args)
        assert loaded.threads_seen() == threads
    finally:
        torch.set_num_threads(prev)


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=300
    )


NO_COMPILER_CHECK = """
import warnings, torch
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    from yolofast.ops import _build, select_backend, bbox_loss, ema_update, reference
    ok, why = _build.extension_status("cpp")
    assert not ok, why
    assert "build.log" in why, why
    assert select_backend("bbox_loss", "cpu") == "ref"
    ok2, _ = _build.extension_status("cpp")  # asked again: no second warning, no second build
    args = (torch.randn(1, 8, 64), torch.randn(1, 8, 3), torch.rand(8, 2) * 4, torch.rand(1, 8, 4) * 4,
            torch.rand(1, 8, 3), torch.ones(1, 8, dtype=torch.bool))
    torch.testing.assert_close(bbox_loss(*args), reference.bbox_loss_ref(*args))
    e = torch.zeros(5); ema_update(e, torch.ones(5), 0.5)
    assert torch.equal(e, torch.full((5,), 0.5))
mine = [w for w in caught if "yolofast" in str(w.message) or "C++" in str(w.message)]
assert len(mine) == 1, [str(w.message) for w in caught]
print("FALLBACK-OK", why)
"""


def test_no_compiler_falls_back_to_reference_with_one_warning(tmp_path):
    res = _run(NO_COMPILER_CHECK, CXX="/bin/false", YOLOFAST_CACHE=str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "FALLBACK-OK" in res.stdout
    logs = list(tmp_path.glob("*/build.log"))
    assert len(logs) == 1 and logs[0].read_text().strip()
    # The failure is remembered: a second process does not retry the build (no build message).
    res2 = _run(NO_COMPILER_CHECK, CXX="/bin/false", YOLOFAST_CACHE=str(tmp_path))
    assert res2.returncode == 0, res2.stdout + res2.stderr
    assert _build.BUILD_MESSAGE not in res2.stderr


def test_cached_build_loads_without_a_compiler(loaded):
    """Once built, a new process loads the cached library even with no compiler (CXX=/bin/false)."""
    report = _build.load_extension()
    root = _build.csrc_dir()
    srcs = _build._cpu_sources(root)
    key = _build._cache_key(srcs, _build._headers(root), [*report.flags, "ld:", *_build.LD_FLAGS])
    if Path(report.build_dir).name != key:
        pytest.skip("csrc/ changed since this process built the extension")
    code = "from yolofast.ops import _build; ok, why = _build.extension_status('cpp'); assert ok, why"
    res = _run(code, CXX="/bin/false")
    assert res.returncode == 0, res.stdout + res.stderr
    assert _build.BUILD_MESSAGE not in res.stderr


def test_missing_sources_are_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("YOLOFAST_CSRC", str(tmp_path))
    report = _build._build_or_load(force=False, verbose=False)
    assert not report.ok and "no C++ sources" in report.reason


def test_concurrent_first_builds_compile_once(tmp_path, monkeypatch):
    """Two builders at once (threads here; flock also excludes processes): one compiles, the other waits
    and then finds the cached library. The compiler is faked: this tests the locking, not gcc."""
    monkeypatch.setenv("YOLOFAST_CACHE", str(tmp_path))
    active, calls, peak = [0], [], [0]
    guard = threading.Lock()

    def fake_compile(root, sources, build_dir, cuda, verbose):
        with guard:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            calls.append(build_dir)
        time.sleep(0.3)
        lib = Path(build_dir) / "fake.so"
        lib.write_bytes(b"")
        with guard:
            active[0] -= 1
        return str(lib)

    monkeypatch.setattr(_compile_ext, "_compile", fake_compile)
    reports = []
    threads = [
        threading.Thread(target=lambda: reports.append(_build._build_or_load(False, False))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and peak[0] == 1
    assert all(r.ok for r in reports) and sum(r.cached for r in reports) == 2
    assert len({r.library for r in reports}) == 1


def test_failed_build_reports_the_compiler_error(tmp_path, monkeypatch):
    """A source that does not compile: (False, reason naming the error and the log), never an exception."""
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "broken_kernel.cpp").write_text("int main( {\n")
    monkeypatch.setenv("YOLOFAST_CSRC", str(tmp_path))
    monkeypatch.setenv("YOLOFAST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(_toolchain, "CPU_FLAGS", ("-O0",))  # fail fast
    report = _build._build_or_load(force=False, verbose=False)
    assert not report.ok
    assert "error" in report.reason and "build.log" in report.reason
    assert "broken_kernel.cpp" in Path(report.log).read_text()


def test_one_broken_kernel_file_does_not_cost_the_others(tmp_path, monkeypatch):
    """A kernel source that does not compile is left out (its op falls back to the reference) and the
    remaining sources still build into a loadable library; the report names the file and the error."""
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "good_kernel.cpp").write_text("int yolofast_good() { return 1; }\n")
    (tmp_path / "cpu" / "broken_kernel.cpp").write_text("int yolofast_broken( {\n")
    monkeypatch.setenv("YOLOFAST_CSRC", str(tmp_path))
    monkeypatch.setenv("YOLOFAST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(_toolchain, "CPU_FLAGS", ("-O0",))
    report = _build._build_or_load(force=False, verbose=False)
    assert report.ok and Path(report.library).is_file(), report.reason
    assert list(report.excluded) == ["cpu/broken_kernel.cpp"]
    assert "error" in report.excluded["cpu/broken_kernel.cpp"]
    assert "FAILED" in str(report) and "good_kernel.cpp" in str(report)
    again = _build._build_or_load(force=False, verbose=False)  # the partial build is cached as such
    assert again.cached and again.excluded == report.excluded


def test_cpu_arch_is_validated_and_keys_the_cache(monkeypatch):
    monkeypatch.delenv(_build.CPU_ARCH_ENV, raising=False)
    assert _build.cpu_arch() == "native" and "-march=native" in _build.cpu_flags()
    monkeypatch.setenv(_build.CPU_ARCH_ENV, "x86-64-v3")
    assert _build.cpu_flags()[-1] == "-march=x86-64-v3"
    root = _build.csrc_dir()
    srcs, heads = _build._cpu_sources(root), _build._headers(root)
    keys = {arch: _build._cache_key(srcs, heads, [*_toolchain.CPU_FLAGS, f"-march={arch}"])
            for arch in ("native", "x86-64-v3", "x86-64-v4")}
    assert len(set(keys.values())) == 3
    for bad in ("x86 64", "-O0", "native;rm", ""):
        monkeypatch.setenv(_build.CPU_ARCH_ENV, bad)
        if bad:
            with pytest.raises(_build.CpuArchError, match=_build.CPU_ARCH_ENV):
                _build.cpu_arch()
        else:
            assert _build.cpu_arch() == "native"  # empty = unset


def test_unknown_cpu_arch_is_an_error_naming_the_variable(tmp_path):
    code = ("from yolofast.ops import _build\n"
            "try:\n    _build.load_extension()\n"
            "except _build.CpuArchError as e:\n    print('ARCH-ERROR', e)\n")
    res = _run(code, YOLOFAST_CPU_ARCH="x86-64-v9", YOLOFAST_CACHE=str(tmp_path))
    assert "ARCH-ERROR" in res.stdout and "YOLOFAST_CPU_ARCH" in res.stdout, res.stdout + res.stderr


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 ISA levels")
def test_avx2_build_uses_avx2_vectors():
    """A x86-64-v3 build (what an AVX2-only CPU runs) uses ATen's 8-float AVX2 vectors, and its kernels still
    give the reference's results; the native build here uses what this CPU has (16 with AVX-512)."""
    code = ("import torch\nfrom yolofast.ops import _library, reference\n"
            "e = torch.randn(1001); m = torch.randn(1001); w = e.clone()\n"
            "_library.ema_update(e, m, 0.3); reference.ema_update_ref(w, m, 0.3)\n"
            "assert torch.equal(e, w)\nprint('LANES', _library.simd_lanes())\n")
    res = _run(code, YOLOFAST_CPU_ARCH="x86-64-v3")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "LANES 8" in res.stdout, res.stdout
    with open("/proc/cpuinfo") as f:
        avx512 = " avx512bw " in f.read()
    res = _run(code, YOLOFAST_CPU_ARCH="native")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"LANES {16 if avx512 else 8}" in res.stdout, res.stdout


# ------------------------------------------------ the CUDA extension: compiled for sm_90 here, run on a GPU
# ============================================================================================== 1. compile
BUILD_AND_LOAD = """
import json, subprocess, sys
from yolofast.ops import _build
report = _build.build_cuda_extension(force=True)
log = open(report.log).read()[-4000:] if report.log else ""
print("REPORT" + json.dumps({"ok": report.ok, "reason": report.reason, "library": report.library,
                             "sources": report.sources, "flags": report.flags, "log": log}))
"""


LOAD_CHECK = """
import sys, torch
import yolofast.ops._schemas  # the schemas
torch.ops.load_library(sys.argv[1])
for op in ("tal_assign", "bbox_loss", "bbox_loss_maps", "_bbox_loss_maps_scale", "ema_update",
           "ns_orthogonalize"):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"yolofast::{op}", "CUDA"), op
print("CUDA-KERNELS-OK")
"""


def _python(code: str, *args, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    full_env.pop("YOLOFAST_NO_CUDA_BUILD", None)
    cmd = [sys.executable, "-c", code, *args]
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cuda_extension_compiles_for_sm90(tmp_path):
    if not torch.version.cuda:
        pytest.skip(f"torch {torch.__version__} is not a CUDA build: no CUDA sources can be compiled here")
    root = _build.csrc_dir()
    assert root is not None and list((root / "cuda").glob("*.cu")), "no CUDA sources in csrc/cuda"
    sources, why = _build._cuda_sources(root)
    if not sources:
        assert "nvcc" in why, why  # the only acceptable reason to skip
        pytest.skip(why)
    # Fresh processes: cpp_extension loads what it builds, and this one may load the session's own build.
    env = {"YOLOFAST_CACHE": str(tmp_path), "TORCH_CUDA_ARCH_LIST": "9.0"}
    res = _python(BUILD_AND_LOAD, **env)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("REPORT")), None)
    assert res.returncode == 0 and line, res.stdout + res.stderr
    report = json.loads(line[len("REPORT") :])
    assert report["ok"], f"{report['reason']}\n{report['log']}"
    want = {"cuda/tal_assign_kernel.cu", "cuda/bbox_loss_kernel.cu", "cuda/ema_update_kernel.cu",
            "cuda/ns_orthogonalize_cuda.cpp"}
    assert want <= set(report["sources"]) and "arch:9.0" in report["flags"]
    res = _python(LOAD_CHECK, report["library"])
    assert res.returncode == 0 and "CUDA-KERNELS-OK" in res.stdout, res.stdout + res.stderr
    # cached: a second build finds the library without compiling
    res = _python(BUILD_AND_LOAD.replace("force=True", "force=False"), **env)
    assert f'"library": "{report["library"]}"' in res.stdout, res.stdout + res.stderr
    assert _build.CUDA_BUILD_MESSAGE not in res.stderr


def test_cuda_status_says_why_not_on_a_machine_without_gpu():
    ok, why = _build.extension_status("cuda")
    if HAS_GPU:
        assert ok, why
    else:
        assert not ok and why
        if torch.version.cuda and not os.environ.get("YOLOFAST_NO_CUDA_BUILD"):
            assert "torch.cuda.is_available()" in why and "--cuda" in why


@gpu
@pytest.mark.cuda
def test_gpu_public_ops_dispatch_to_cuda_with_autograd(cuda_ops):
    from yolofast import ops

    args = tuple(a.cuda() for a in random_scene(13, B=2, M=30))
    with ops.backend("cuda"):
        out = ops.tal_assign(*args)
    for name, a, b in zip(NAMES, out, cuda_ops.tal_assign(*args, TOPK, ALPHA, BETA, EPS)):
        assert torch.equal(a, b), name
    largs = tuple(a.cuda() for a in make_inputs(2, 500, 10, 1, fg_frac=0.2))
    with ops.backend("cuda"):
        got = losses_and_grads(ops.bbox_loss, largs)
    want = losses_and_grads(reference.bbox_loss_ref, largs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()) + 1e-30)


@gpu
@pytest.mark.cuda
def test_gpu_cuda_graph_capture_of_assign_loss_and_ema(cuda_ops):
    """No host syncs: the assigner, the fused loss and the EMA (decay read on device) replay in a graph."""
    args = tuple(a.cuda() for a in random_scene(8, B=2, M=40))
    largs = [a.cuda() for a in make_inputs(2, 8400, 80, 2, anc=anchors_640())]
    ema, model = ema_pair(100_000, torch.float32, 3, "cuda")
    decay = torch.tensor(0.5, dtype=torch.float64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs recommends
        eager_tal = cuda_ops.tal_assign(*args, TOPK, ALPHA, BETA, EPS)
        eager_loss = cuda_ops.bbox_loss(*largs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_tal = cuda_ops.tal_assign(*args, TOPK, ALPHA, BETA, EPS)
        g_loss = cuda_ops.bbox_loss(*largs)
        cuda_ops.ema_update(ema, model, decay)
    for d in (0.9, 0.99):
        decay.fill_(d)
        want = ema.clone()
        ema_update_ref(want, model, decay)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(ema, want, rtol=1.2e-7, atol=0)
    for a, b in zip(g_tal, eager_tal):
        assert torch.equal(a, b)
    for a, b in zip(g_loss, eager_loss):
        assert torch.equal(a, b)


@gpu
@pytest.mark.cuda
def test_gpu_opcheck(cuda_ops):
    args = tuple(a.cuda() for a in random_scene(15, B=2, imgsz=128, M=6, C=3))
    torch.library.opcheck(cuda_ops.tal_assign.default, (*args, TOPK, ALPHA, BETA, EPS))
    largs = tuple(a.cuda() for a in make_inputs(2, 64, 5, 3, fg_frac=0.3))
    torch.library.opcheck(cuda_ops.bbox_loss.default, largs)
    ema, model = ema_pair(1000, torch.float32, 4, "cuda")
    torch.library.opcheck(cuda_ops.ema_update.default, (ema, model, torch.tensor(0.9, device="cuda")))


@gpu
@pytest.mark.cuda
def test_gpu_runs_on_the_current_stream(cuda_ops):
    args = tuple(a.cuda() for a in random_scene(6, B=2, M=40))
    want = cuda_ops.tal_assign(*args, TOPK, ALPHA, BETA, EPS)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = cuda_ops.tal_assign(*args, TOPK, ALPHA, BETA, EPS)
    torch.cuda.current_stream().wait_stream(s)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ========================================================================================= 4. gpu_bench
def test_gpu_bench_dry_run_writes_a_table(tmp_path):
    """benchmarks/gpu_bench.py runs first time on the GPU machine only if its Python works: run it on
    tiny CPU shapes (the GPU backends get their n/a rows)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_bench
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    out = tmp_path / "table.md"
    assert gpu_bench.main(["--dry-run", "--batches", "1", "--n-gt", "3", "--out", str(out)]) == 0
    text = out.read_text()
    for op in ("tal_assign", "bbox_loss fwd+bwd", "ema_update"):
        assert f"| {op} |" in text
    assert "| ref |" in text and "n/a:" in text
    assert "failed" not in text, text
