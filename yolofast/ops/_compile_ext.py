"""Compiling the extensions with torch's ``cpp_extension`` (ninja): the CPU one leaves out a source that
does not compile (its op then runs on the reference) and retries the rest; the CUDA one builds all its
sources or nothing. Imports only ``_toolchain`` of yolofast.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from yolofast.ops._toolchain import (
    CUDA_FLAGS,
    CUDA_HOST_FLAGS,
    LD_FLAGS,
    _compiler,
    _cpp_extension,
    _cuda_home,
    _cuda_link_flags,
    _nvcc_path,
    _nvidia_include_dirs,
    _summarise,
    cpu_flags,
)

EXT_NAME = "yolofast_C"
CUDA_EXT_NAME = "yolofast_cuda"


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
