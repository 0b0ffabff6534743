"""The build cache: ``cache_root()/<key>/`` per configuration (the key hashes the sources, the flags,
torch's and Python's versions and, for ``-march=native``, the CPU), an flock per entry across processes,
the OK / ``FAILED-<compiler tag>`` markers, and the build sequence that runs under that lock
(``_locked_build``), with the ``BuildReport`` it returns. Imports only ``_toolchain`` of yolofast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from yolofast.ops._toolchain import _compiler_tag, _cpu_id, _nvcc_tag, _summarise

BUILD_MESSAGE = "yolofast: building C++ kernels (first use, ~1 min)…"
CUDA_BUILD_MESSAGE = "yolofast: building CUDA kernels (first use, ~1 min)…"
# kind -> (its name in messages, the command that retries a failed build, the line printed while it builds)
_KINDS = {
    "cpp": ("C++", "yolofast build", BUILD_MESSAGE),
    "cuda": ("CUDA", "yolofast build --cuda", CUDA_BUILD_MESSAGE),
}


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


def cache_root() -> Path:
    env = os.environ.get("YOLOFAST_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "yolofast" / "build"


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
