"""Building, caching and loading the C++ extension (yolofast/ops/_build.py), and its fallbacks."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from yolofast.ops import _build

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

    monkeypatch.setattr(_build, "_compile", fake_compile)
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
    monkeypatch.setattr(_build, "CPU_FLAGS", ("-O0",))  # fail fast
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
    monkeypatch.setattr(_build, "CPU_FLAGS", ("-O0",))
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
    keys = {arch: _build._cache_key(srcs, heads, [*_build.CPU_FLAGS, f"-march={arch}"])
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
