"""Builds and loads the compiled kernels: ONE extension from csrc/cpu/*.cpp (+ csrc/cuda/* when possible).

- Lazy: nothing happens at import; the first compiled-op call or ``extension_status()`` loads it.
- Cached: ``$YOLOFAST_CACHE`` (default ``~/.cache/yolofast/build``) / ``<key>/`` where the key hashes the
  sources, the flags, torch's and Python's versions and (for -march=native) the CPU, so a changed file,
  flag, torch or machine gets its own build and an unchanged one loads in milliseconds without a compiler.
- Safe: a threading lock in the process and an flock on ``<key>.lock`` across processes (pytest-xdist
  workers, DDP ranks) -- one builds, the others wait and then load its result.
- Quiet: one line on stderr while building; the compiler output goes to ``<key>/build.log``.
- Never a crash: no compiler or a failing build -> ``extension_status()`` returns (False, reason with the
  log path), ONE warning is issued, and the ops fall back to the reference. A failure is remembered in the
  cache per compiler (so 8 workers do not each retry a 1-minute build; a new or different compiler does);
  ``yolofast build`` (``build()``) always retries.
- CUDA: csrc/cuda/*.cu (+ .cpp there) are compiled in when torch is a CUDA build and nvcc is found (pip's
  nvidia-* include dirs added; with no GPU visible and TORCH_CUDA_ARCH_LIST unset, for sm_80 and sm_90);
  if that build fails, the CPU-only extension is built so the CPU kernels still work.
- ``YOLOFAST_CSRC`` points at another source tree (kernel development); ``YOLOFAST_NO_CUDA_BUILD=1`` skips
  the CUDA sources.
- Sources: ``yolofast/csrc`` (a wheel install) or ``<repo>/csrc`` (an editable install / the checkout).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

EXT_NAME = "yolofast_C"
BUILD_MESSAGE = "yolofast: building C++ kernels (first use, ~1 min)…"
# -fopenmp: without it at::parallel_for (inlined from the header) runs on one thread, silently.
# -march=native: the build happens on the machine that runs it (the CPU is part of the cache key).
CPU_FLAGS = ("-O3", "-g0", "-fopenmp", "-march=native")
LD_FLAGS = ("-fopenmp",)
CUDA_FLAGS = ("-O3", "-lineinfo")  # no --use_fast_math: the kernels must match the references to 1e-5
DEFAULT_CUDA_ARCHS = "8.0;9.0"  # when compiling with no GPU to ask (CI): A100 and H100/H200

LOADED = False  # read (without the lock) by _library._ensure_loaded on every op call

_lock = threading.Lock()
_state: dict = {}  # "cpp"/"cuda" -> (ok, reason), "report" -> BuildReport, "warned" -> bool


@dataclasses.dataclass
class BuildReport:
    """What ``build()`` did; ``str(report)`` is the human summary that ``yolofast build`` prints."""

    ok: bool
    cpp: bool = False
    cuda: bool = False
    reason: str = ""
    cuda_reason: str = ""
    library: str = ""
    build_dir: str = ""
    log: str = ""
    sources: list = dataclasses.field(default_factory=list)
    excluded: dict = dataclasses.field(default_factory=dict)  # source -> first error line (left out)
    flags: list = dataclasses.field(default_factory=list)
    cached: bool = False
    seconds: float = 0.0

    def __str__(self) -> str:
        if not self.ok:
            return f"yolofast: C++ kernels NOT built: {self.reason}"
        how = "loaded from cache" if self.cached else f"built in {self.seconds:.1f} s"
        built = [s for s in self.sources if s not in self.excluded]
        lines = [
            f"yolofast: C++ kernels {how}: {self.library}",
            f"  sources: {', '.join(built)}",
            *(f"  FAILED (its op uses the reference): {k}: {v}" for k, v in self.excluded.items()),
            f"  flags:   {' '.join(self.flags)}",
            f"  cuda:    {'yes' if self.cuda else 'no (' + self.cuda_reason + ')'}",
        ]
        if self.log:
            lines.append(f"  log:     {self.log}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- sources
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
    """(sources, reason when empty). The hook for csrc/cuda: compiled when torch has CUDA and nvcc exists."""
    srcs = sorted((root / "cuda").glob("*.cu")) + sorted((root / "cuda").glob("*.cpp"))
    if not srcs:
        return [], "no CUDA sources in csrc/cuda"
    if os.environ.get("YOLOFAST_NO_CUDA_BUILD"):
        return [], "YOLOFAST_NO_CUDA_BUILD is set"
    if not torch.version.cuda:
        return [], f"torch {torch.__version__} is not a CUDA build"
    cpp_extension = _cpp_extension()
    if cpp_extension.CUDA_HOME is None or not shutil.which("nvcc", path=_nvcc_path()):
        return [], "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    return srcs, ""


def _nvcc_path() -> str:
    home = _cpp_extension().CUDA_HOME
    dirs = [str(Path(home) / "bin")] if home else []
    return os.pathsep.join([*dirs, os.environ.get("PATH", "")])


def _headers(root: Path) -> list[Path]:
    return sorted(p for d in ("cpu", "cuda") for ext in ("*.h", "*.cuh") for p in (root / d).glob(ext))


def _nvidia_include_dirs() -> list[str]:
    """Include dirs of pip's nvidia-* packages (cuda_runtime, cublas, ...), which torch's CUDA wheels use
    but which are not on torch's include path (DESIGN §3)."""
    try:
        import nvidia  # namespace package of the nvidia-* wheels
    except ImportError:
        return []
    dirs = []
    for base in getattr(nvidia, "__path__", []):
        dirs += [str(p) for p in sorted(Path(base).glob("*/include")) if p.is_dir()]
    return dirs


def _cuda_link_flags(build_dir: Path) -> list[str]:
    """-L flags so that cpp_extension's ``-lcudart`` resolves. pip's nvidia-cuda-runtime wheel ships only
    ``libcudart.so.<major>`` (no unversioned name) outside CUDA_HOME: link through a symlink made in the
    build dir. At run time the soname is already loaded by torch's own CUDA library."""
    home = _cpp_extension().CUDA_HOME
    for sub in ("lib64", "lib"):
        if home and (Path(home) / sub / "libcudart.so").exists():
            return []
    try:
        import nvidia
    except ImportError:
        return []
    for base in getattr(nvidia, "__path__", []):
        for lib in sorted(Path(base).glob("*/lib/libcudart.so*")):
            link_dir = build_dir / "cudalib"
            link_dir.mkdir(parents=True, exist_ok=True)
            link = link_dir / "libcudart.so"
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(lib)
            return [f"-L{link_dir}"]
    return []


# --------------------------------------------------------------------------------------------------- cache
def cache_root() -> Path:
    env = os.environ.get("YOLOFAST_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "yolofast" / "build"


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _compiler_id() -> str:
    try:
        out = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.returncode == 0 and out.stdout else f"rc={out.returncode}"
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable: {e}"


def _compiler_tag() -> str:
    """Short id of the compiler a build would use (CXX or c++: its resolved path and mtime)."""
    exe = shutil.which(_compiler())
    ident = _compiler()
    if exe:
        with contextlib.suppress(OSError):
            ident = f"{os.path.realpath(exe)}:{os.stat(exe).st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:8]


def _cpu_id() -> str:
    # -march=native code can SIGILL on another CPU sharing this cache (an NFS home): key on the CPU.
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        model = next((ln for ln in info.splitlines() if ln.startswith("model name")), "")
        flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
        return model + flags
    except OSError:
        return platform.processor() or platform.machine()


def _cache_key(sources: list[Path], headers: list[Path], flags: list[str]) -> str:
    h = hashlib.sha256()
    for p in [*sources, *headers]:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    # Not the compiler's version: a cached build must load on a machine without one (and gcc updates keep
    # the C++ ABI); `yolofast build` rebuilds on demand.
    for part in (*flags, torch.__version__, str(torch.version.cuda), sys.version, _cpu_id()):
        h.update(str(part).encode() + b"\0")
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _file_lock(path: Path):
    """Exclusive lock across processes, released by the OS if the holder dies (unlike a lock file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            import fcntl
        except ImportError:  # Windows: no flock; concurrent first builds there are the user's problem
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read_ok(build_dir: Path) -> tuple[Path, dict] | None:
    """(library, left-out sources) of a finished build, from its OK marker, or None. The library's name is
    recorded because cpp_extension renames a second build of one name in a process to ``<name>_v1``."""
    try:
        info = json.loads((build_dir / "OK").read_text())
        lib = build_dir / info["library"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (lib, dict(info.get("excluded", {}))) if lib.is_file() else None


def _summarise(text: str) -> str:
    """The line of a compiler log that says what went wrong (gcc/clang/nvcc's first "error:" line, else
    the first line), at most 200 characters."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln or "error :" in ln]
    return ((errors or lines or ["unknown error"])[0])[:200]


def _cpp_extension():
    import logging

    # cpp_extension warns at import when torch has CUDA but no GPU is present: noise for a CPU build.
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        logger.setLevel(level)
    return cpp_extension


def _compile(root: Path, sources, build_dir: Path, cuda: bool, verbose: bool) -> str:
    """Compiles and links with ninja; returns the library's path."""
    cpp_extension = _cpp_extension()
    arch_env = {}
    if cuda and not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        arch_env["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCHS
    stale = build_dir / "lock"  # cpp_extension's own baton; a killed build leaves it and hangs the next
    if stale.exists():
        stale.unlink()
    os.environ.update(arch_env)
    try:
        return _load_with(cpp_extension, root, sources, build_dir, cuda, verbose)
    finally:
        for k in arch_env:
            os.environ.pop(k, None)


def _load_with(cpp_extension, root: Path, sources, build_dir: Path, cuda: bool, verbose: bool) -> str:
    return cpp_extension.load(
        name=EXT_NAME,
        sources=[str(s) for s in sources],
        extra_cflags=list(CPU_FLAGS),
        extra_cuda_cflags=list(CUDA_FLAGS) if cuda else None,
        extra_ldflags=list(LD_FLAGS) + (_cuda_link_flags(build_dir) if cuda else []),
        extra_include_paths=[str(root / "cpu")] + (_nvidia_include_dirs() if cuda else []),
        build_directory=str(build_dir),
        verbose=verbose,
        with_cuda=cuda,
        is_python_module=False,
    )


def _failed_source(text: str, sources: list[Path]) -> Path | None:
    """The source whose object ninja reports as FAILED (``FAILED: [code=1] x.o`` / ``x.cuda.o``), if any."""
    for ln in text.splitlines():
        if ln.startswith("FAILED:"):
            obj = ln.split()[-1]
            for src in sources:
                if obj in (f"{src.stem}.o", f"{src.stem}.cuda.o"):
                    return src
    return None


def _build_into(root, sources, build_dir: Path, with_cuda: bool, verbose: bool, log: Path):
    """Compile ``sources``; a source that does not compile is left out and the rest retried (its op then
    runs on the reference), so one broken kernel file does not cost the others. Returns
    (library or None, {left-out source: first error line}, failure text)."""
    excluded: dict[str, str] = {}
    texts = []
    todo = list(sources)
    while todo:
        try:
            return Path(_compile(root, todo, build_dir, with_cuda, verbose)), excluded, ""
        except Exception as e:  # noqa: BLE001 - any failure means "no compiled kernels" for that part
            text = f"{type(e).__name__}: {e}"
            texts.append(text)
            with contextlib.suppress(OSError):  # e.g. the cache dir was removed meanwhile
                log.write_text(f"compiler: {_compiler()}\n\n" + "\n\n".join(texts) + "\n")
            bad = _failed_source(text, todo)
            if bad is None or len(todo) == 1:
                return None, excluded, text
            excluded[str(bad.relative_to(root))] = _summarise(text)
            todo.remove(bad)
    return None, excluded, "no sources left"


def _build_or_load(force: bool, verbose: bool) -> BuildReport:
    root = csrc_dir()
    if root is None:
        why = "kernel sources csrc/cpu not found next to the yolofast package (wheels ship yolofast/csrc)"
        return BuildReport(ok=False, reason=why)
    cpu = _cpu_sources(root)
    if not cpu:
        return BuildReport(ok=False, reason=f"no C++ sources in {root / 'cpu'}")
    cuda, cuda_reason = _cuda_sources(root)
    attempts = [(cpu + cuda, True)] if cuda else []
    attempts.append((cpu, False))
    first_reason = ""
    for sources, with_cuda in attempts:
        flags = [*CPU_FLAGS, *(("nvcc:", *CUDA_FLAGS) if with_cuda else ())]
        key = _cache_key(sources, _headers(root), [*flags, "ld:", *LD_FLAGS])
        build_dir = cache_root() / key
        log = build_dir / "build.log"
        # A failure is remembered per compiler: installing one (or pointing CXX elsewhere) retries.
        failed = build_dir / f"FAILED-{_compiler_tag()}"
        report = BuildReport(
            ok=False, build_dir=str(build_dir), log=str(log), flags=flags,
            sources=[str(s.relative_to(root)) for s in sources],
        )
        with _file_lock(cache_root() / f"{key}.lock"):
            done = _read_ok(build_dir)
            if done is not None and not force:
                lib, report.excluded = done
                report.cached = True
            elif failed.exists() and not force:
                report.reason = (
                    f"the C++ build failed before ({failed.read_text().strip()}); see {log}; "
                    "fix it and run `yolofast build` to retry"
                )
            else:
                build_dir.mkdir(parents=True, exist_ok=True)
                for marker in [build_dir / "OK", *build_dir.glob("FAILED-*")]:
                    marker.unlink(missing_ok=True)
                print(BUILD_MESSAGE, file=sys.stderr, flush=True)
                t0 = time.perf_counter()
                lib, report.excluded, text = _build_into(root, sources, build_dir, with_cuda, verbose, log)
                if lib is None:
                    with contextlib.suppress(OSError):
                        failed.write_text(_summarise(text) + "\n")
                    report.reason = f"building the C++ kernels failed ({_summarise(text)}); full log: {log}"
                else:
                    report.seconds = time.perf_counter() - t0
                    if not report.excluded:
                        log.write_text(
                            f"compiler: {_compiler_id()}\nflags: {' '.join(flags)}\n"
                            f"built in {report.seconds:.1f} s\n"
                        )
                    (build_dir / "OK").write_text(
                        json.dumps({"library": lib.name, "excluded": report.excluded}) + "\n"
                    )
            if not report.reason:
                report.library = str(lib)
                report.ok = report.cpp = True
                report.cuda = with_cuda and not any(k.startswith("cuda/") for k in report.excluded)
                report.cuda_reason = "" if with_cuda else (first_reason or cuda_reason)
                if with_cuda and not report.cuda:
                    report.cuda_reason = "CUDA sources failed to compile (see excluded)"
                return report
        if with_cuda:
            first_reason = f"the CUDA build failed: {report.reason}"
    return report


def _load(report: BuildReport) -> None:
    global LOADED
    from yolofast.ops import _library  # noqa: F401 - the schemas must exist before kernels register

    if report.ok:
        try:
            torch.ops.load_library(report.library)
        except Exception as e:  # noqa: BLE001
            report.ok = report.cpp = report.cuda = False
            report.reason = f"loading {report.library} failed: {type(e).__name__}: {e}"
    _state["report"] = report
    why = "C++ extension loaded"
    if report.excluded:
        why += f" without {', '.join(report.excluded)} (failed to compile; see {report.log})"
    _state["cpp"] = (report.cpp, why if report.cpp else report.reason)
    if report.cuda:
        _state["cuda"] = (True, "CUDA kernels compiled into the extension")
    else:
        _state["cuda"] = (False, report.cuda_reason or report.reason)
    LOADED = report.ok
    if (not report.ok or report.excluded) and not _state.get("warned"):
        _state["warned"] = True
        if report.ok:
            failed = "; ".join(f"{k}: {v}" for k, v in report.excluded.items())
            msg = f"kernels that failed to compile ({failed}): their ops use the reference ({report.log})"
        else:
            msg = f"{report.reason} -- using the pure-PyTorch reference ops"
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


def load_extension() -> BuildReport:
    """Build (if needed) and load the extension once per process; returns what happened."""
    with _lock:
        if "report" not in _state:
            try:
                report = _build_or_load(force=False, verbose=False)
            except Exception as e:  # noqa: BLE001 - e.g. an unwritable cache dir: report, never crash
                report = BuildReport(ok=False, reason=f"{type(e).__name__}: {e}")
            _load(report)
        return _state["report"]


def build(verbose: bool = True) -> BuildReport:
    """Build now (retrying a remembered failure), load, and report: the ``yolofast build`` command.

    In a process that already loaded the extension a library cannot be swapped: this then reports the
    build in use (``yolofast build`` runs in a fresh process, so it really rebuilds).
    """
    with _lock:
        if LOADED:
            report = _build_or_load(force=False, verbose=verbose)
            return report
        try:
            report = _build_or_load(force=True, verbose=verbose)
        except Exception as e:  # noqa: BLE001
            report = BuildReport(ok=False, reason=f"{type(e).__name__}: {e}")
        _state["warned"] = True  # the caller prints the report; no extra warning
        _load(report)
        return report


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
    """(loaded, reason) for kind "cpp" or "cuda"; builds/loads the extension on first call."""
    if kind not in ("cpp", "cuda"):
        raise ValueError(f"extension_status: kind must be 'cpp' or 'cuda', got {kind!r}")
    load_extension()
    return _state[kind]
