"""The toolchain a build of the kernels uses: the C++ compiler and its flags (``-march`` from
``$YOLOFAST_CPU_ARCH``), torch's ``cpp_extension``, the CUDA toolkit (CUDA_HOME, nvcc, pip's nvidia-* headers
and libcudart) and the CUDA architectures to compile for.

The bottom of the build modules, importing nothing of yolofast: ``_toolchain`` < ``_build_cache`` (the cache
and the locked build sequence) < ``_compile_ext`` (the cpp_extension calls) < ``_build`` (sources, loading,
status; see its docstring for the whole story).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import torch

# -fopenmp: without it at::parallel_for (inlined from the header) runs on one thread, silently.
# -march comes from cpu_arch(): native by default (the build happens on the machine that runs it; the CPU
# is then part of the cache key), or a portable level such as x86-64-v3 for a cluster of mixed CPUs.
CPU_FLAGS = ("-O3", "-g0", "-fopenmp")
CPU_ARCH_ENV = "YOLOFAST_CPU_ARCH"
# A -march value: a gcc/clang CPU or ISA-level name (x86-64-v3, skylake-avx512, armv8.2-a+sve, native).
_ARCH_NAME = re.compile(r"[a-z0-9][a-z0-9._+-]{0,63}")
LD_FLAGS = ("-fopenmp",)
# No --use_fast_math: the assigner's integer outputs must equal the reference's (its float math uses
# round-to-nearest intrinsics, never contracted), and the losses match the reference to 1e-5.
CUDA_FLAGS = ("-O3", "-lineinfo")
# The bindings (csrc/cuda/*.cpp) are thin at::Tensor glue: -O2 compiles them ~20% faster than -O3.
CUDA_HOST_FLAGS = ("-O2", "-g0")
DEFAULT_CUDA_ARCHS = "8.0;9.0"  # when compiling with no GPU to ask (CI): A100 and H100/H200


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


def _summarise(text: str) -> str:
    """The line of a compiler log that says what went wrong (gcc/clang/nvcc's first "error:" line, else
    the first line), at most 200 characters."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln or "error :" in ln]
    return ((errors or lines or ["unknown error"])[0])[:200]


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


def _nvcc_tag() -> str:
    """Short id of the nvcc a CUDA build would use (resolved path and mtime), for its failure marker."""
    exe = shutil.which("nvcc", path=_nvcc_path())
    ident = "none"
    if exe:
        with contextlib.suppress(OSError):
            ident = f"{os.path.realpath(exe)}:{os.stat(exe).st_mtime_ns}"
    return hashlib.sha256(f"{ident}|{_compiler_tag()}".encode()).hexdigest()[:8]


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
