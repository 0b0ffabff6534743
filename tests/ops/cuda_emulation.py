"""The CUDA kernels (csrc/cuda) on a machine without a GPU: the same .cu sources compiled as C++ against a
CPU emulation of CUDA (tests/ops/cuda_emu: blocks run one after another, threads are fibers switched at
__syncthreads and at warp shuffles). ``Impl`` runs an op on the real extension ("gpu") or on the emulation
("emu"); tests/ops/conftest.py's ``impl`` fixture gives every op's tests both, so the kernels' logic (grid
inference, top-k merging, conflict keys, warp butterflies, partial sums) is tested without a GPU.

    TRITON_INTERPRET=0 python -m pytest -q -m cuda tests/ops   # a GPU machine (benchmarks/gpu_check.sh)
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import shutil
from pathlib import Path

import pytest
import torch

from yolofast.ops import _build, _build_cache

REPO = Path(__file__).resolve().parents[2]


EMU_DIR = Path(__file__).resolve().parent / "cuda_emu"


HAS_GPU = torch.cuda.is_available()


_LAUNCH = re.compile(r"([^\n;{}]+?)<<<(.+?)>>>\((.*?)\);", re.S)


_DYNAMIC_SMEM = "extern __shared__ __align__(16) unsigned char smem_raw[];"


# The host-side .cpp files, adapted (file -> edits): cuda_ops.cpp's ops registered as yolofast_cuda_emu::<op>
# taking CPU tensors as "device" ones; the ATen-only ops (ns_orthogonalize) take CPU tensors as well.
_BINDING_EDITS = {
    "cuda_ops.cpp": (
        ("TORCH_LIBRARY_IMPL(yolofast, CUDA, m)", "TORCH_LIBRARY(yolofast_cuda_emu, m)"),
        ("m.impl(", "m.def("),
        ("ref.is_cuda()", "true"),
        ("decay.is_cuda()", "true"),
    ),
    "ns_orthogonalize_cuda.cpp": (("u.is_cuda()", "u.is_cpu()"),),
}


def _emulated_cu(text: str, name: str) -> str:
    """A .cu file as C++ for the emulation: launches become yf_emu::launch calls."""

    def launch(m):
        kernel, config, args = m.groups()
        indent = kernel[: len(kernel) - len(kernel.lstrip())]
        return f"{indent}yf_emu::launch({config}, [&] {{ {kernel.strip()}({args}); }});"

    text, n = _LAUNCH.subn(launch, text)
    assert n, f"{name}: no kernel launch found to emulate"
    return text.replace(_DYNAMIC_SMEM, "unsigned char* smem_raw = yf_emu::dynamic_smem();")


def build_emulation() -> str:
    """Compiles csrc/cuda + the emulation runtime for the CPU (cached by content); returns the library."""
    src = _build.csrc_dir() / "cuda"
    files = sorted(p for p in src.iterdir() if p.suffix in (".cu", ".cuh", ".h", ".cpp"))
    files += sorted((src.parent / "common").glob("*.h"))  # shared argument checks, copied beside the rest
    emu_files = sorted(p for p in EMU_DIR.rglob("*") if p.is_file() and p.suffix in (".h", ".cpp"))
    h = hashlib.sha256(torch.__version__.encode())
    for p in files + emu_files:
        h.update(p.name.encode() + p.read_bytes())
    build_dir = _build.cache_root() / f"cuda-emu-{h.hexdigest()[:16]}"
    gen = build_dir / "src"
    done = build_dir / "OK"
    with _build_cache._file_lock(_build.cache_root() / f"{build_dir.name}.lock"):
        if done.exists() and (build_dir / done.read_text().strip()).is_file():
            return str(build_dir / done.read_text().strip())
        shutil.rmtree(gen, ignore_errors=True)
        gen.mkdir(parents=True)
        sources = []
        for p in files:
            if p.suffix == ".cu":
                out = gen / f"{p.stem}_cu.cpp"
                out.write_text(_emulated_cu(p.read_text(), p.name))
            elif p.suffix == ".cpp":
                text = p.read_text()
                assert p.name in _BINDING_EDITS, f"{p.name}: add its edits to _BINDING_EDITS"
                for old, new in _BINDING_EDITS[p.name]:
                    assert old in text, f"{p.name}: expected {old!r} (update _BINDING_EDITS)"
                    text = text.replace(old, new)
                out = gen / p.name
                out.write_text(text)
            else:
                shutil.copy(p, gen / p.name)
                continue
            sources.append(str(out))
        sources.append(str(EMU_DIR / "emu_runtime.cpp"))
        from torch.utils import cpp_extension

        lib = cpp_extension.load(
            name="yolofast_cuda_emu",
            sources=sources,
            # no fma contraction: the kernels' __fadd_rn & co. are plain operators here
            extra_cflags=["-O1", "-g0", "-ffp-contract=off"],
            extra_include_paths=[str(EMU_DIR), str(gen)],
            build_directory=str(build_dir),
            with_cuda=False,
            is_python_module=False,
        )
        done.write_text(Path(lib).name + "\n")
        return lib


class _EmuBboxLoss(torch.autograd.Function):
    """Autograd of the emulated op, the same rule as yolofast/ops/_library.py's for yolofast::bbox_loss."""

    @staticmethod
    def forward(ctx, pred_dist, pred_scores, *rest):
        # 9 inputs: reg_max 1 (bbox_loss.l1: the stride tensor and the image's height and width after fg_mask)
        ops = torch.ops.yolofast_cuda_emu
        op = ops.bbox_loss.l1 if len(rest) == 7 else ops.bbox_loss
        losses, gd_box, gd_dfl, gs, inv_s = op(pred_dist, pred_scores, *rest)
        ctx.n_rest = len(rest)
        ctx.save_for_backward(gd_box, gd_dfl, gs, inv_s)
        ctx.dtypes = (pred_dist.dtype, pred_scores.dtype)
        return losses

    @staticmethod
    def backward(ctx, g):
        gd_box, gd_dfl, gs, inv_s = ctx.saved_tensors
        c = g.to(inv_s.dtype) * inv_s
        return ((gd_box * c[0] + gd_dfl * c[2]).to(ctx.dtypes[0]), (gs * c[1]).to(ctx.dtypes[1]),
                *(None,) * ctx.n_rest)


@dataclasses.dataclass
class Impl:
    name: str
    device: str
    ops: object  # torch.ops namespace holding tal_assign, bbox_loss, ema_update

    def tal(self, args, topk=10, alpha=0.5, beta=6.0, eps=1e-9):
        return self.ops.tal_assign(*args, topk, alpha, beta, eps, 0)  # topk2 0: off

    def loss(self, *args):
        if self.name == "emu":
            return _EmuBboxLoss.apply(*args)
        return torch.ops.yolofast.bbox_loss(*args)[0]  # autograd registered in _library.py

    def loss_l1(self, *args):
        """reg_max 1: args = bbox_loss's six, stride_tensor, (H, W) (the reference's signature)."""
        *six, stride, hw = args
        rest = (*six, stride, float(hw[0]), float(hw[1]))
        if self.name == "emu":
            return _EmuBboxLoss.apply(*rest)
        return torch.ops.yolofast.bbox_loss.l1(*rest)[0]  # autograd registered in _schemas.py

    def to(self, args):
        return tuple(a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args)


# GPU-only tests
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
