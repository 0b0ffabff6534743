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
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

EXT_NAME = "yolofast_C"
BUILD_MESSAGE = "yolofast: building C++ kernels (first use, ~1 min)…"
# -fopenmp: without it at::parallel_for (inlined from the header) runs on one thread, silently.
# -march comes from cpu_arch(): native by default (the build happens on the machine that runs it; the CPU
# is then part of the cache key), or a portable level such as x86-64-v3 for a cluster of mixed CPUs.
CPU_FLAGS = ("-O3", "-g0", "-fopenmp")
CPU_ARCH_ENV = "YOLOFAST_CPU_ARCH"
# A -march value: a gcc/clang CPU or ISA-level name (x86-64-v3, skylake-avx512, armv8.2-a+sve, native).
_ARCH_NAME = re.compile(r"[a-z0-9][a-z0-9._+-]{0,63}")
LD_FLAGS = ("-fopenmp",)
CUDA_EXT_NAME = "yolofast_cuda"
CUDA_BUILD_MESSAGE = "yolofast: building CUDA kernels (first use, ~1 min)…"
# No --use_fast_math: the assigner's integer outputs must equal the reference's (its float math uses
# round-to-nearest intrinsics, never contracted), and the losses match the reference to 1e-5.
CUDA_FLAGS = ("-O3", "-lineinfo")
# The bindings (csrc/cuda/*.cpp) are thin at::Tensor glue: -O2 compiles them ~20% faster than -O3.
CUDA_HOST_FLAGS = ("-O2", "-g0")
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
    cuda_library: str = ""  # the CUDA extension (a separate library), when loaded

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
            f"  cuda:    {('yes: ' + self.cuda_library) if self.cuda else 'no (' + self.cuda_reason + ')'}",
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


def _is_toolkit(home) -> bool:
    return bool(home) and (Path(home) / "bin" / "nvcc").is_file() and (
        Path(home) / "include" / "cuda_runtime_api.h"
    ).is_file()


def _cuda_home() -> str | None:
    """The CUDA toolkit root, also set as torch's ``cpp_extension.CUDA_HOME``.

    torch takes CUDA_HOME/CUDA_PATH, else the parent of the ``nvcc`` on PATH: when that nvcc is a wrapper
    script (here /usr/local/bin/nvcc -> /usr/local, which has no include/cuda_runtime_api.h) the build
    fails. An explicit CUDA_HOME/CUDA_PATH always wins; otherwise the first real toolkit among torch's
    guess, /usr/local/cuda and /usr/local/cuda-* is used."""
    cpp_extension = _cpp_extension()
    current = cpp_extension.CUDA_HOME
    env = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if env:
        cpp_extension.CUDA_HOME = env  # also when set after torch's cpp_extension was imported
        return env
    if _is_toolkit(current):
        return current
    cands = ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    home = next((c for c in cands if _is_toolkit(c)), current)
    cpp_extension.CUDA_HOME = home  # read by cpp_extension at build time (_join_cuda_home)
    return home


def _nvcc_path() -> str:
    home = _cuda_home()
    dirs = [str(Path(home) / "bin")] if home else []
    return os.pathsep.join([*dirs, os.environ.get("PATH", "")])


def _headers(root: Path, kind: str = "cpu") -> list[Path]:
    """The headers that a build of ``kind`` ("cpu" or "cuda") depends on (part of its cache key): its own
    and csrc/common's (the argument checks both backends share)."""
    return sorted(p for d in (kind, "common") for ext in ("*.h", "*.cuh") for p in (root / d).glob(ext))


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
    home = _cuda_home()
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


class CpuArchError(ValueError):
    """YOLOFAST_CPU_ARCH holds a value the compiler cannot take as -march: raised, never a silent fallback."""


def cpu_arch() -> str:
    """The -march of the CPU build: ``$YOLOFAST_CPU_ARCH`` (e.g. ``x86-64-v3`` = AVX2 + FMA, ``x86-64-v4`` =
    AVX-512, ``native``), default ``native``. The explicit SIMD in csrc/cpu follows it (cpu_common.h picks
    ATen's AVX-512, AVX2 or NEON vectors from the macros the compiler defines for it)."""
    value = os.environ.get(CPU_ARCH_ENV, "").strip() or "native"
    if not _ARCH_NAME.fullmatch(value):
        raise CpuArchError(
            f"{CPU_ARCH_ENV}={value!r} is not a -march value: use native (the default), x86-64-v3 (AVX2), "
            f"x86-64-v4 (AVX-512) or another name your compiler knows (`{_compiler()} --help=target`)"
        )
    return value


def cpu_flags() -> list[str]:
    return [*CPU_FLAGS, f"-march={cpu_arch()}"]


def _check_arch_with_compiler(arch: str) -> None:
    """Asks the compiler whether it takes -march=arch (a fraction of a second), so that a typo is an error
    that names the variable instead of a compile failure in every source."""
    if arch == "native":
        return

    def rejects(*flags: str) -> subprocess.CompletedProcess | None:
        try:
            out = subprocess.run([_compiler(), *flags, "-x", "c++", "-fsyntax-only", "-"], input="",
                                 capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
        return out if out.returncode != 0 else None

    out = rejects(f"-march={arch}")
    # A compiler that fails without -march too is missing or broken: the build itself reports that.
    if out is not None and rejects() is None:
        raise CpuArchError(
            f"{CPU_ARCH_ENV}={arch!r}: the compiler {_compiler()} rejects -march={arch} "
            f"({_summarise(out.stderr)}); use native, x86-64-v3, x86-64-v4 or a name it lists in "
            f"`{_compiler()} --help=target`"
        )


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
    # The CPU only for -march=native: a portable -march (x86-64-v3) build is the same on every CPU of a
    # mixed cluster sharing the cache, which is what it is for.
    cpu = _cpu_id() if "-march=native" in flags else platform.machine()
    for part in (*flags, torch.__version__, str(torch.version.cuda), sys.version, cpu):
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
    """Compiles and links the CPU extension (``cuda`` False) with ninja; returns the library's path."""
    stale = build_dir / "lock"  # cpp_extension's own baton; a killed build leaves it and hangs the next
    if stale.exists():
        stale.unlink()
    return _load_with(_cpp_extension(), root, sources, build_dir, cuda, verbose)


def _load_with(cpp_extension, root: Path, sources, build_dir: Path, cuda: bool, verbose: bool) -> str:
    return cpp_extension.load(
        name=EXT_NAME,
        sources=[str(s) for s in sources],
        extra_cflags=cpu_flags(),
        extra_ldflags=list(LD_FLAGS),
        extra_include_paths=[str(root / "cpu"), str(root / "common")],
        build_directory=str(build_dir),
        verbose=verbose,
        with_cuda=False,
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


# kind -> (its name in messages, the command that retries a failed build, the line printed while it builds)
_KINDS = {
    "cpp": ("C++", "yolofast build", BUILD_MESSAGE),
    "cuda": ("CUDA", "yolofast build --cuda", CUDA_BUILD_MESSAGE),
}


def _locked_build(
    kind: str,
    root: Path,
    sources: list[Path],
    key: str,
    flags: list[str],
    force: bool,
    compile_into: Callable[[Path, Path], tuple[Path | None, dict, str]],
    log_head: Callable[[], str],
) -> BuildReport:
    """The build sequence of the extension ``kind`` ("cpp" or "cuda"), under the cache entry's file lock:
    the cached library (its OK marker), else a remembered failure (``FAILED-<compiler tag>``; ``force``
    skips both), else a fresh build in ``cache_root()/key`` with its one-line message.

    compile_into(build_dir, log) -> (library or None, {left-out source: first error line}, failure text);
    it writes the log of a failure. log_head() is the first line of a success's log."""
    label, retry, message = _KINDS[kind]
    build_dir = cache_root() / key
    log = build_dir / "build.log"
    # A failure is remembered per compiler: installing one (or pointing CXX / CUDA_HOME elsewhere) retries.
    failed = build_dir / f"FAILED-{_nvcc_tag() if kind == 'cuda' else _compiler_tag()}"
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
                f"the {label} build failed before ({failed.read_text().strip()}); see {log}; "
                f"fix it and run `{retry}` to retry"
            )
        else:
            build_dir.mkdir(parents=True, exist_ok=True)
            for marker in [build_dir / "OK", *build_dir.glob("FAILED-*")]:
                marker.unlink(missing_ok=True)
            print(message, file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            lib, report.excluded, text = compile_into(build_dir, log)
            if lib is None:
                with contextlib.suppress(OSError):
                    failed.write_text(_summarise(text) + "\n")
                report.reason = f"building the {label} kernels failed ({_summarise(text)}); full log: {log}"
            else:
                report.seconds = time.perf_counter() - t0
                if not report.excluded:  # else the log keeps the left-out sources' errors
                    log.write_text(
                        f"{log_head()}\nflags: {' '.join(flags)}\nbuilt in {report.seconds:.1f} s\n"
                    )
                (build_dir / "OK").write_text(
                    json.dumps({"library": lib.name, "excluded": report.excluded}) + "\n"
                )
        if not report.reason:
            report.library = str(lib)
            report.ok = True
            setattr(report, kind, True)
    return report


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


# ---------------------------------------------------------------------------------------------------- cuda
def cuda_arch_list() -> str:
    """The architectures a CUDA build targets: TORCH_CUDA_ARCH_LIST, else the visible GPUs' (what
    cpp_extension picks), else DEFAULT_CUDA_ARCHS (no GPU to ask, e.g. CI compiling for the GPU machine)."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        return env
    if torch.cuda.is_available():
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        return ";".join(f"{a}.{b}" for a, b in caps)
    return DEFAULT_CUDA_ARCHS


def _nvcc_tag() -> str:
    """Short id of the nvcc a CUDA build would use (resolved path and mtime), for its failure marker."""
    exe = shutil.which("nvcc", path=_nvcc_path())
    ident = "none"
    if exe:
        with contextlib.suppress(OSError):
            ident = f"{os.path.realpath(exe)}:{os.stat(exe).st_mtime_ns}"
    return hashlib.sha256(f"{ident}|{_compiler_tag()}".encode()).hexdigest()[:8]


def _compile_cuda(root: Path, sources, build_dir: Path, arch: str, verbose: bool) -> str:
    """Compiles and links the CUDA extension for ``arch`` (a TORCH_CUDA_ARCH_LIST value)."""
    cpp_extension = _cpp_extension()
    _cuda_home()
    stale = build_dir / "lock"
    if stale.exists():
        stale.unlink()
    prev = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    # The toolkit's own headers are enough: the kernels include no cuBLAS/cuSPARSE (ATen/cuda/
    # CUDAContext.h would); pip's nvidia-* include dirs are added only for a toolkit that lacks the runtime's.
    home = cpp_extension.CUDA_HOME
    has_runtime = bool(home) and (Path(home) / "include" / "cuda_runtime_api.h").is_file()
    extra_inc = [] if has_runtime else _nvidia_include_dirs()
    try:
        return cpp_extension.load(
            name=CUDA_EXT_NAME,
            sources=[str(s) for s in sources],
            extra_cflags=list(CUDA_HOST_FLAGS),
            extra_cuda_cflags=list(CUDA_FLAGS),
            extra_ldflags=_cuda_link_flags(build_dir),
            extra_include_paths=[str(root / "cuda"), str(root / "common"), *extra_inc],
            build_directory=str(build_dir),
            verbose=verbose,
            with_cuda=True,
            is_python_module=False,
        )
    finally:
        if prev is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = prev


def _build_cuda_into(root: Path, sources, build_dir: Path, arch: str, verbose: bool, log: Path):
    """Compile the CUDA extension (all sources or nothing); returns (library or None, {}, failure text)."""
    try:
        return Path(_compile_cuda(root, sources, build_dir, arch, verbose)), {}, ""
    except Exception as e:  # noqa: BLE001 - any failure means "no CUDA kernels"
        text = f"{type(e).__name__}: {e}"
        with contextlib.suppress(OSError):
            log.write_text(f"nvcc: {shutil.which('nvcc', path=_nvcc_path())}\narch: {arch}\n\n{text}\n")
        return None, {}, text


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


# ------------------------------------------------------------------------------------------------- loading
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
