"""Builds and loads the compiled kernels: two extensions, each built on first use and cached.

- ``yolofast_C`` from csrc/cpu/*.cpp: the CPU kernels, built wherever a C++ compiler exists.
- ``yolofast_cuda`` from csrc/cuda/*.cu + *.cpp: the CUDA kernels, a SEPARATE extension so that a
  machine without a GPU never waits for nvcc: it is built/loaded automatically only when
  ``torch.cuda.is_available()``, or when asked (``build(cuda=True)``, ``yolofast build --cuda``, the compile
  test). Needs a CUDA build of torch and nvcc; CUDA_HOME is found even when ``nvcc`` on PATH is a wrapper
  script outside the toolkit.
  With no GPU to ask and TORCH_CUDA_ARCH_LIST unset it compiles for sm_80 and sm_90.
- Lazy: nothing happens at import; the first compiled-op call or ``extension_status()`` loads them.
- Cached: ``$YOLOFAST_CACHE`` (default ``~/.cache/yolofast/build``) / ``<key>/`` where the key hashes the
  sources, the flags (-march from ``$YOLOFAST_CPU_ARCH``, default native), torch's and Python's versions and
  (CPU, -march=native only) the CPU, (CUDA) the target architectures, so a changed file, flag, torch or
  machine gets its own build and an unchanged one loads in milliseconds without a compiler.
- Safe: a threading lock in the process and an flock on ``<key>.lock`` across processes (pytest-xdist
  workers, DDP ranks) -- one builds, the others wait and then load its result.
- Quiet: one line on stderr while building; the compiler output goes to ``<key>/build.log``.
- Never a crash: no compiler or a failing build -> ``extension_status()`` returns (False, reason with the
  log path), ONE warning is issued, and the ops fall back to the reference (or Triton on CUDA). A failure is
  remembered in the cache per compiler (so 8 workers do not each retry a 1-minute build; a new or different
  compiler does); ``yolofast build`` (``build()``) always retries.
- ``YOLOFAST_CSRC`` points at another source tree (kernel development); ``YOLOFAST_NO_CUDA_BUILD=1`` never
  builds the CUDA extension.
- Sources: ``yolofast/csrc`` (a wheel install) or ``<repo>/csrc`` (an editable install / the checkout).

The parts, each importing only the ones before it: ``_toolchain.py`` (compiler, flags, ``-march``, the CUDA
toolkit), ``_build_cache.py`` (cache key and folder, lock, markers, the locked build sequence,
``BuildReport``), ``_compile_ext.py`` (the cpp_extension calls); this module finds the sources, builds and
loads the extensions once per process and answers ``extension_status``. Its names below stay importable
from here (``from yolofast.ops._build import build, CpuArchError``, ``_build.cpu_arch()``, ...).
"""

from __future__ import annotations

import os
import shutil
import threading
import warnings
from pathlib import Path

import torch

from yolofast.ops._build_cache import (
    BUILD_MESSAGE,
    CUDA_BUILD_MESSAGE,
    BuildReport,
    _cache_key,
    _locked_build,
    cache_root,
)
from yolofast.ops._compile_ext import CUDA_EXT_NAME, EXT_NAME, _build_cuda_into, _build_into
from yolofast.ops._toolchain import (
    CPU_ARCH_ENV,
    CUDA_FLAGS,
    CUDA_HOST_FLAGS,
    LD_FLAGS,
    CpuArchError,
    _check_arch_with_compiler,
    _compiler_id,
    _cuda_home,
    _nvcc_path,
    cpu_arch,
    cpu_flags,
    cuda_arch_list,
)

__all__ = ["BUILD_MESSAGE", "CPU_ARCH_ENV", "CUDA_BUILD_MESSAGE", "CUDA_EXT_NAME", "EXT_NAME", "BuildReport",
           "CpuArchError", "build", "build_cuda_extension", "cache_root", "cpu_arch", "cpu_flags", "csrc_dir",
           "cuda_arch_list", "extension_status", "load_extension", "missing_kernel_reason"]

LOADED = False  # read (without the lock) by _library._ensure_loaded on every op call
_lock = threading.Lock()
_state: dict = {}  # "cpp"/"cuda" -> (ok, reason), "report" -> BuildReport, "warned" -> bool


def csrc_dir() -> Path | None:
    """Where the kernel sources are: ``$YOLOFAST_CSRC`` (for kernel development), the installed package's
    copy, then the repository root."""
    env = os.environ.get("YOLOFAST_CSRC")
    if env:
        return Path(env).expanduser().resolve()
    here = Path(__file__).resolve().parent.parent  # yolofast/
    for cand in (here / "csrc", here.parent / "csrc"):
        if (cand / "cpu").is_dir():
            return cand
    return None


def _cpu_sources(root: Path) -> list[Path]:
    return sorted((root / "cpu").glob("*.cpp"))


def _cuda_sources(root: Path) -> tuple[list[Path], str]:
    """(csrc/cuda sources, reason when they cannot be built here): needs a CUDA torch and nvcc."""
    srcs = sorted((root / "cuda").glob("*.cu")) + sorted((root / "cuda").glob("*.cpp"))
    if not srcs:
        return [], f"no CUDA sources in {root / 'cuda'}"
    if not torch.version.cuda:
        return [], f"torch {torch.__version__} is not a CUDA build"
    home = _cuda_home()
    if home is None or not shutil.which("nvcc", path=_nvcc_path()):
        return [], "nvcc not found (set CUDA_HOME to the CUDA toolkit, e.g. /usr/local/cuda)"
    return srcs, ""


def _headers(root: Path, kind: str = "cpu") -> list[Path]:
    """The headers that a build of ``kind`` ("cpu" or "cuda") depends on (part of its cache key): its own
    and csrc/common's (the argument checks both backends share)."""
    return sorted(p for d in (kind, "common") for ext in ("*.h", "*.cuh") for p in (root / d).glob(ext))


def _build_or_load(force: bool, verbose: bool) -> BuildReport:
    """The CPU extension: cached library, remembered failure, or a fresh build."""
    root = csrc_dir()
    if root is None:
        why = "kernel sources csrc/cpu not found next to the yolofast package (wheels ship yolofast/csrc)"
        return BuildReport(ok=False, reason=why)
    sources = _cpu_sources(root)
    if not sources:
        return BuildReport(ok=False, reason=f"no C++ sources in {root / 'cpu'}")
    flags = cpu_flags()
    key = _cache_key(sources, _headers(root), [*flags, "ld:", *LD_FLAGS])

    def compile_into(build_dir, log):
        _check_arch_with_compiler(cpu_arch())
        return _build_into(root, sources, build_dir, False, verbose, log)

    return _locked_build(
        "cpp", root, sources, key, flags, force, compile_into,
        lambda: f"compiler: {_compiler_id()}",
    )


def build_cuda_extension(force: bool = False, verbose: bool = False) -> BuildReport:
    """Builds (or finds cached) the CUDA extension; works with no GPU (CI, ``yolofast build --cuda``).
    The report's ``library`` is the .so to load. Note: torch's cpp_extension loads a library it has just
    compiled into the calling process (its CUDA kernels then register; harmless without a GPU), so a
    build for another configuration is best run in a subprocess, as tests/ops/test_cuda.py does."""
    if os.environ.get("YOLOFAST_NO_CUDA_BUILD"):
        return BuildReport(ok=False, reason="YOLOFAST_NO_CUDA_BUILD is set")
    root = csrc_dir()
    if root is None:
        return BuildReport(ok=False, reason="kernel sources csrc/ not found next to the yolofast package")
    sources, why = _cuda_sources(root)
    if not sources:
        return BuildReport(ok=False, reason=why)
    arch = cuda_arch_list()
    flags = [*CUDA_HOST_FLAGS, "nvcc:", *CUDA_FLAGS, f"arch:{arch}"]
    key = "cuda-" + _cache_key(sources, _headers(root, "cuda"), flags)
    return _locked_build(
        "cuda", root, sources, key, flags, force,
        lambda build_dir, log: _build_cuda_into(root, sources, build_dir, arch, verbose, log),
        lambda: f"arch: {arch}",
    )


def _cuda_wanted() -> tuple[bool, str]:
    """Whether loading the compiled kernels should also build/load the CUDA extension, else why not."""
    if os.environ.get("YOLOFAST_NO_CUDA_BUILD"):
        return False, "YOLOFAST_NO_CUDA_BUILD is set"
    if not torch.version.cuda:
        return False, f"torch {torch.__version__} is not a CUDA build"
    if not torch.cuda.is_available():
        return False, (
            "no CUDA device visible (torch.cuda.is_available() is False): the CUDA kernels are built only "
            "for a GPU, or on request with `yolofast build --cuda`"
        )
    return True, ""


def _load_cuda(report: BuildReport) -> None:
    """Loads a built CUDA extension (registers its kernels for the CUDA dispatch key) and records it."""
    from yolofast.ops import _schemas  # noqa: F401 - the schemas must exist before kernels register

    if report.ok and not _state.get("cuda_loaded"):
        try:
            torch.ops.load_library(report.library)
            _state["cuda_loaded"] = report.library
        except Exception as e:  # noqa: BLE001
            report.ok = report.cuda = False
            report.reason = f"loading {report.library} failed: {type(e).__name__}: {e}"
    _state["cuda_report"] = report
    if report.ok:
        how = "loaded from cache" if report.cached else f"built in {report.seconds:.0f} s"
        _state["cuda"] = (True, f"CUDA kernels {how}: {_state.get('cuda_loaded', report.library)}")
    else:
        _state["cuda"] = (False, report.reason)


def _load(report: BuildReport) -> None:
    global LOADED
    from yolofast.ops import _schemas  # noqa: F401 - the schemas must exist before kernels register

    if report.ok:
        try:
            torch.ops.load_library(report.library)
        except Exception as e:  # noqa: BLE001
            report.ok = report.cpp = False
            report.reason = f"loading {report.library} failed: {type(e).__name__}: {e}"
    _state["report"] = report
    why = "C++ extension loaded"
    if report.excluded:
        why += f" without {', '.join(report.excluded)} (failed to compile; see {report.log})"
    _state["cpp"] = (report.cpp, why if report.cpp else report.reason)
    LOADED = report.ok or bool(_state.get("cuda_loaded"))
    if (not report.ok or report.excluded) and not _state.get("warned"):
        _state["warned"] = True
        if report.ok:
            failed = "; ".join(f"{k}: {v}" for k, v in report.excluded.items())
            msg = f"kernels that failed to compile ({failed}): their ops use the reference ({report.log})"
        else:
            msg = f"{report.reason} -- using the pure-PyTorch reference ops"
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


def _cuda_step(want: bool | None, force: bool, verbose: bool) -> None:
    """Builds/loads the CUDA extension when ``want`` (None: when a GPU is visible); records why not."""
    global LOADED
    if _state.get("cuda_loaded") and not force:
        return
    auto_ok, why = _cuda_wanted()
    if want is False or (want is None and not auto_ok):
        if not _state.get("cuda_loaded"):
            _state["cuda"] = (False, why or "not requested")
        return
    try:
        report = build_cuda_extension(force=force, verbose=verbose)
    except Exception as e:  # noqa: BLE001 - report, never crash
        report = BuildReport(ok=False, reason=f"{type(e).__name__}: {e}")
    _load_cuda(report)
    LOADED = LOADED or report.ok
    if not report.ok and not _state.get("cuda_warned") and want is None:
        _state["cuda_warned"] = True
        msg = f"{report.reason} -- CUDA ops use Triton or the reference"
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


def _merge_cuda(report: BuildReport) -> BuildReport:
    """The CPU report with the CUDA extension's outcome in its cuda/cuda_reason fields."""
    ok, why = _state.get("cuda", (False, "not built"))
    report.cuda = ok
    report.cuda_reason = "" if ok else why
    cuda_report = _state.get("cuda_report")
    if ok and cuda_report is not None:
        report.cuda_library = cuda_report.library
    return report


def load_extension() -> BuildReport:
    """Build (if needed) and load the extensions once per process: the CPU one always, the CUDA one when a
    GPU is visible. Returns the CPU build's report (``.cuda``/``.cuda_reason``: the CUDA extension's)."""
    with _lock:
        if "report" not in _state:
            try:
                report = _build_or_load(force=False, verbose=False)
            except CpuArchError:
                raise  # the user asked for this -march: falling back to the reference would hide the typo
            except Exception as e:  # noqa: BLE001 - e.g. an unwritable cache dir: report, never crash
                report = BuildReport(ok=False, reason=f"{type(e).__name__}: {e}")
            _load(report)
            _cuda_step(None, force=False, verbose=False)
            _merge_cuda(report)
        return _state["report"]


def build(verbose: bool = True, cuda: bool | None = None) -> BuildReport:
    """Build now (retrying a remembered failure), load, and report: the ``yolofast build`` command.

    cuda: None builds the CUDA extension when a GPU is visible, True builds (and loads) it anyway (no GPU
    needed: ``yolofast build --cuda``), False skips it. In a process that already loaded an extension a
    library cannot be swapped: this then reports the build in use (``yolofast build`` runs in a fresh
    process, so it really rebuilds).
    """
    with _lock:
        if LOADED:
            report = _build_or_load(force=False, verbose=verbose)
            _cuda_step(cuda, force=False, verbose=verbose)
            return _merge_cuda(report)
        try:
            report = _build_or_load(force=True, verbose=verbose)
        except CpuArchError:
            raise
        except Exception as e:  # noqa: BLE001
            report = BuildReport(ok=False, reason=f"{type(e).__name__}: {e}")
        _state["warned"] = True  # the caller prints the report; no extra warning
        _state["cuda_warned"] = True
        _load(report)
        _cuda_step(cuda, force=True, verbose=verbose)
        return _merge_cuda(report)


def missing_kernel_reason(op: str) -> str:
    """Why the loaded extension has no kernel for ``op`` ("" when nothing is known), for ``yolofast info``."""
    report = _state.get("report")
    if report is None:
        return ""
    for src, err in report.excluded.items():
        if Path(src).stem.startswith(op):
            return f"{src} failed to compile: {err} (log: {report.log})"
    return ""


def extension_status(kind: str) -> tuple[bool, str]:
    """(loaded, reason) for kind "cpp" or "cuda"; builds/loads the extensions on first call (the CUDA one
    only when a GPU is visible; otherwise the reason says so)."""
    if kind not in ("cpp", "cuda"):
        raise ValueError(f"extension_status: kind must be 'cpp' or 'cuda', got {kind!r}")
    load_extension()
    return _state[kind]
