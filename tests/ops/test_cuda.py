"""The CUDA kernels (csrc/cuda): compiled for sm_90, and run against the references.

Three ways in:
1. ``test_cuda_extension_compiles_for_sm90``: builds the CUDA extension with nvcc (TORCH_CUDA_ARCH_LIST=9.0)
   into a fresh cache and imports it in a new process -- CUDA code that does not compile fails CI. Skipped
   only without a CUDA build of torch or without nvcc (the reason is printed).
2. Every correctness test below runs twice, through the ``impl`` fixture:
   - "gpu" (marker ``cuda``): the real extension on a GPU, against the reference on the same GPU (so the
     assigner's integer outputs must be identical: same CUDA atan/pow, same rounding);
   - "emu" (marker ``slow``): the SAME .cu sources compiled as C++ against a CPU emulation of CUDA
     (tests/ops/cuda_emu: blocks run one after another, threads are fibers switched at __syncthreads and
     at warp shuffles), against the reference on the CPU. This is how the kernels' logic (grid inference,
     top-k merging, conflict keys, warp butterflies, partial sums) is tested on machines without a GPU.
3. GPU-only checks (CUDA graphs, streams, autograd through the public ops, opcheck, a dense scene).
4. benchmarks/gpu_bench.py's --dry-run, so that the GPU timing script runs first time on the GPU machine.

    python -m pytest -q tests/ops/test_cuda.py                 # CPU: compile test + emulation (~2 min)
    TRITON_INTERPRET=0 python -m pytest -q -m cuda tests/ops   # a GPU machine (benchmarks/gpu_check.sh)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Scene generators shared with the CPU kernels' tests (tests/ops is on sys.path under pytest).
from test_bbox_loss import anchors_640, dfl_edge_inputs, losses_and_grads, make_inputs
from test_tal_assign import NAMES, anchors_px, random_scene

from yolofast.ops import _build, reference
from yolofast.ops.reference import bbox_loss_ref, ema_update_ref, tal_assign_ref

REPO = Path(__file__).resolve().parents[2]
EMU_DIR = Path(__file__).resolve().parent / "cuda_emu"
TOPK, ALPHA, BETA, EPS = 10, 0.5, 6.0, 1e-9
HAS_GPU = torch.cuda.is_available()


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
import yolofast.ops._library  # the schemas
torch.ops.load_library(sys.argv[1])
for op in ("tal_assign", "bbox_loss", "ema_update"):
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
    want = {"cuda/tal_assign_kernel.cu", "cuda/bbox_loss_kernel.cu", "cuda/ema_update_kernel.cu"}
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


# ========================================================================================== 2. emulation
_LAUNCH = re.compile(r"([^\n;{}]+?)<<<(.+?)>>>\((.*?)\);", re.S)
_DYNAMIC_SMEM = "extern __shared__ __align__(16) unsigned char smem_raw[];"
# cuda_ops.cpp, adapted: its ops registered as yolofast_cuda_emu::<op> taking CPU tensors as "device" ones
_BINDING_EDITS = (
    ("TORCH_LIBRARY_IMPL(yolofast, CUDA, m)", "TORCH_LIBRARY(yolofast_cuda_emu, m)"),
    ("m.impl(", "m.def("),
    ("ref.is_cuda()", "true"),
    ("decay.is_cuda()", "true"),
)


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
    with _build._file_lock(_build.cache_root() / f"{build_dir.name}.lock"):
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
                for old, new in _BINDING_EDITS:
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
        op = torch.ops.yolofast_cuda_emu.bbox_loss
        losses, gd_box, gd_dfl, gs, inv_s = op(pred_dist, pred_scores, *rest)
        ctx.save_for_backward(gd_box, gd_dfl, gs, inv_s)
        ctx.dtypes = (pred_dist.dtype, pred_scores.dtype)
        return losses

    @staticmethod
    def backward(ctx, g):
        gd_box, gd_dfl, gs, inv_s = ctx.saved_tensors
        c = g.to(inv_s.dtype) * inv_s
        return (gd_box * c[0] + gd_dfl * c[2]).to(ctx.dtypes[0]), (gs * c[1]).to(ctx.dtypes[1]), *(None,) * 4


@dataclasses.dataclass
class Impl:
    name: str
    device: str
    ops: object  # torch.ops namespace holding tal_assign, bbox_loss, ema_update

    def tal(self, args, topk=TOPK, alpha=ALPHA, beta=BETA, eps=EPS):
        return self.ops.tal_assign(*args, topk, alpha, beta, eps, 0)  # topk2 0: off

    def loss(self, *args):
        if self.name == "emu":
            return _EmuBboxLoss.apply(*args)
        return torch.ops.yolofast.bbox_loss(*args)[0]  # autograd registered in _library.py

    def to(self, args):
        return tuple(a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args)


@pytest.fixture(
    scope="module",
    params=[pytest.param("gpu", marks=pytest.mark.cuda), pytest.param("emu", marks=pytest.mark.slow)],
)
def impl(request):
    if request.param == "gpu":
        if not HAS_GPU:
            pytest.skip("no CUDA device")
        ok, why = _build.extension_status("cuda")
        assert ok, f"a GPU is visible but the CUDA extension is not available: {why}"
        return Impl("gpu", "cuda", torch.ops.yolofast)
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler for the CUDA emulation")
    import yolofast.ops._library  # noqa: F401 - yolofast's own schemas first (same names, other namespace)

    torch.ops.load_library(build_emulation())
    return Impl("emu", "cpu", torch.ops.yolofast_cuda_emu)


# ------------------------------------------------------------------------------------------- tal_assign
def _tal_check(impl, args, score_rtol=None, score_atol=None, **kw):
    """Integer outputs and boxes exactly; scores to rounding. On a GPU the kernel's float math is torch's
    own (same CUDA atan/pow): 1e-6. The emulation calls glibc's powf/atanf where the CPU reference uses
    SLEEF/MKL: an ulp of overlap, raised to the 6th power, moves a score by up to ~2e-6 relative."""
    args = impl.to(args)
    score_rtol = score_rtol or (1e-6 if impl.name == "gpu" else 1e-5)
    score_atol = score_atol or (1e-10 if impl.name == "gpu" else 1e-7)
    hp = {"topk": TOPK, "alpha": ALPHA, "beta": BETA, "eps": EPS, **kw}
    ref = tal_assign_ref(*args, **hp)
    out = impl.tal(args, **hp)
    for name, r, o in zip(NAMES, ref, out):
        assert o.dtype == r.dtype, f"{name}: dtype {o.dtype} != reference {r.dtype}"
        assert o.shape == r.shape and o.device == r.device, f"{name}: {o.shape} {o.device} vs {r.shape}"
        if name == "target_scores":
            msg = lambda m, n=name: f"{n}: {m}"  # noqa: E731
            torch.testing.assert_close(o, r, rtol=score_rtol, atol=score_atol, msg=msg)
        else:
            diff = (o != r) if not o.is_floating_point() else ~((o == r) | (o.isnan() & r.isnan()))
            assert not diff.any(), f"{name}: {int(diff.sum())} differ, first at {diff.nonzero()[:5].tolist()}"
    return ref, out


@pytest.mark.parametrize("seed", range(10))
def test_tal_random_scenes(impl, seed):
    M = (1, 8, 40, 120, 300)[seed % 5]
    ref, _ = _tal_check(impl, random_scene(seed, B=2, M=M, pad=seed % 3 != 0))
    if M >= 40:  # the scenes must exercise the assigner, not only background
        assert int(ref[3].sum()) > 10 * (M // 40)


def test_tal_float64_takes_the_two_pass_conflict_resolution(impl):
    for seed, M in ((100, 5), (101, 60)):
        _, out = _tal_check(impl, random_scene(seed, B=2, M=M, dtype=torch.float64))
        assert out[2].dtype == torch.float64


def test_tal_mixed_dtypes(impl):
    scores, pd, anc, labels, gt, mask = random_scene(7, B=2, M=60)
    _tal_check(impl, (scores.bfloat16(), pd, anc, labels, gt, mask), score_rtol=1e-2, score_atol=1e-6)
    _tal_check(impl, (scores, pd, anc, labels.long(), gt.double(), mask.bool()))


@pytest.mark.parametrize(
    "topk,alpha,beta",
    [(13, 1.0, 2.0), (1, 0.5, 6.0), (10, 0.25, 3.5), (10, 0.5, 0.0), (0, 0.5, 6.0), (100, 0.5, 6.0)],
)
def test_tal_hyperparameters(impl, topk, alpha, beta):
    _tal_check(impl, random_scene(11, B=2, M=80), topk=topk, alpha=alpha, beta=beta)


def _one_image(gt_boxes, labels, pd_box, C=4, score=0.5):
    anc = anchors_px(640)
    A = anc.shape[0]
    gt = torch.tensor(gt_boxes, dtype=torch.float32)[None]
    M = gt.shape[1]
    lab = torch.tensor(labels, dtype=torch.float32).view(1, M, 1)
    pd = torch.as_tensor(pd_box, dtype=torch.float32).expand(1, A, 4).clone()
    return torch.full((1, A, C), score), pd, anc, lab, gt, torch.ones(1, M, 1)


def test_tal_topk_ties_go_to_the_lower_anchor_index(impl):
    args = _one_image([[200.0, 200.0, 300.0, 260.0]], [1], [205.0, 202.0, 298.0, 262.0])
    _, out = _tal_check(impl, args)
    anc = args[2]
    inside = (anc[:, 0] > 200) & (anc[:, 0] < 300) & (anc[:, 1] > 200) & (anc[:, 1] < 260)
    assert out[3][0].cpu().nonzero().squeeze(1).tolist() == inside.nonzero().squeeze(1)[:TOPK].tolist()


def test_tal_identical_gts_tie_to_the_lowest_index(impl):
    box, other = [300.0, 100.0, 380.0, 150.0], [20.0, 500.0, 90.0, 600.0]
    _, out = _tal_check(impl, _one_image([other, box, box, box], [0, 1, 2, 3], [302.0, 101.0, 377.0, 152.0]))
    fg, idx = out[3][0].cpu(), out[4][0].cpu()
    assert int(fg.sum()) == TOPK and set(idx[fg].tolist()) == {1}


def test_tal_conflict_goes_to_the_best_overlap_even_if_it_did_not_select(impl):
    gts = [[100.0, 100.0, 260.0, 260.0], [120.0, 120.0, 250.0, 250.0], [100.0, 100.0, 260.0, 260.0]]
    scores, pd, anc, lab, gt, mask = _one_image(gts, [0, 1, 0], gts[1])
    scores = scores * (0.5 + torch.rand(scores.shape, generator=torch.Generator().manual_seed(0)))
    scores[..., 1] *= 0.01
    _, out = _tal_check(impl, (scores, pd, anc, lab, gt, mask))
    assert (out[4][0][out[3][0]] == 1).any()


def test_tal_anchors_on_box_edges_and_small_boxes(impl):
    def step(v, n):  # v moved by n float32 ulps
        t = torch.tensor(v, dtype=torch.float32)
        for _ in range(abs(n)):
            t = torch.nextafter(t, torch.tensor(math.inf if n > 0 else -math.inf))
        return t.item()

    gts = [
        [100.0, 100.0, 164.0, 132.0],  # all four sides on stride-8 centres: excluded (strict inequality)
        [step(4.0, -1), step(4.0, -1), step(20.0, 1), step(20.0, 1)],  # one ulp outside: included
        [step(4.0, 1), step(300.0, 1), step(36.0, -1), 340.0],  # one ulp inside: excluded
        [600.0, 600.0, 636.0, 636.0],  # the bottom-right corner
        [50.0, 50.0, 52.0, 53.0],  # 2 x 3 px: widened to 16 px
        [400.0, 40.0, 416.0, 41.0],
    ]
    scores, pd, anc, lab, gt, mask = _one_image(gts, [0, 1, 2, 3, 0, 1], gts[0])
    pd = torch.cat((anc - 10, anc + 10), -1)[None]
    _, out = _tal_check(impl, (scores, pd, anc, lab, gt, mask), topk=100)
    assert bool(out[3][0, 0]) and int(out[4][0, 0]) == 1


def test_tal_no_gt_slots_and_all_padding(impl):
    scores, pd, anc, labels, gt, mask = random_scene(3, B=2, M=6)
    _, out = _tal_check(impl, (scores, pd, anc, labels[:, :0], gt[:, :0], mask[:, :0]))
    assert (out[0] == scores.shape[-1]).all() and not out[3].any()
    labels[0, 0], labels[1, 0] = 3.0, -1.0
    _, out = _tal_check(impl, (scores, pd, anc, labels, gt, torch.zeros_like(mask)))
    assert not out[3].any()


def test_tal_out_of_range_labels(impl):
    scores, pd, anc, labels, gt, mask = random_scene(5, B=2, M=30, pad=False)
    labels[0, :3, 0] = torch.tensor([-1.0, 80.0, 200.0])
    _tal_check(impl, (scores, pd, anc, labels, gt, mask))


@pytest.mark.parametrize(
    "kind", ["random_points", "perturbed_grid", "single_level", "levels_reversed", "few"]
)
def test_tal_anchors_that_are_not_make_anchors_grid(impl, kind):
    """The device-side grid inference must notice (full scan) or describe them exactly."""
    scores, pd, anc, labels, gt, mask = random_scene(21, B=2, M=40)
    g = torch.Generator().manual_seed(1)
    if kind == "random_points":
        anc = torch.rand(anc.shape, generator=g) * 640
    elif kind == "perturbed_grid":
        anc = anc.clone()
        anc[1234, 0] = torch.nextafter(anc[1234, 0], torch.tensor(1e9))
        anc[5000, 1] -= 3.0
    elif kind == "levels_reversed":  # still grids, stride 32 first
        order = torch.cat((torch.arange(8000, 8400), torch.arange(6400, 8000), torch.arange(0, 6400)))
        anc, scores, pd = anc[order], scores[:, order], pd[:, order]
    elif kind == "single_level":
        anc = anchors_px(640)[:6400].flip(0)
        scores, pd = scores[:, :6400], pd[:, :6400]
    else:
        idx = torch.randperm(anc.shape[0], generator=g)[:7]
        anc, scores, pd = anc[idx], scores[:, idx], pd[:, idx]
    _tal_check(impl, (scores, pd, anc, labels, gt, mask))
    if kind == "few":
        _tal_check(impl, (scores, pd, anc, labels, gt, mask), topk=30)  # topk > A


def test_tal_nan_predictions_hold_topk_slots_but_are_never_positive(impl):
    scores, pd, anc, labels, gt, mask = random_scene(20, B=1, M=8, pad=False)
    g = torch.Generator().manual_seed(1)
    A = scores.shape[1]
    scores[0, torch.rand(A, generator=g) < 0.1] = float("nan")
    pd[0, torch.rand(A, generator=g) < 0.05, 2] = float("nan")
    _tal_check(impl, (scores, pd, anc, labels, gt, mask))


def test_tal_every_output_element_is_written_and_runs_repeat(impl, monkeypatch):
    args = impl.to(random_scene(9, B=2, M=50))
    clean = impl.tal(args)
    monkeypatch.setenv("YOLOFAST_POISON_OUTPUTS", "1")
    poisoned = impl.tal(args)
    for name, a, b in zip(NAMES, clean, poisoned):
        assert torch.equal(a, b), name  # also: two runs give identical results


def test_tal_bad_arguments_raise_clear_errors(impl):
    scores, pd, anc, labels, gt, mask = impl.to(random_scene(14, B=2, M=5))
    with pytest.raises(RuntimeError, match="tal_assign: anc_points"):
        impl.tal((scores, pd, anc[:-1], labels, gt, mask))
    with pytest.raises(RuntimeError, match="tal_assign: mask_gt"):
        impl.tal((scores, pd, anc, labels, gt, mask[:, :4]))
    with pytest.raises(RuntimeError, match="tal_assign: topk"):
        impl.tal((scores, pd, anc, labels, gt, mask), topk=-1)
    with pytest.raises(RuntimeError, match="topk must be <= 1024"):
        impl.tal((scores, pd, anc, labels, gt, mask), topk=5000)


# -------------------------------------------------------------------------------------------- bbox_loss
def _loss_check(impl, args, rtol=1e-5):
    """Losses to rtol; gradients elementwise to rtol with an absolute floor of rtol x the largest entry."""
    args = impl.to(args)
    got = losses_and_grads(impl.loss, args)
    want = losses_and_grads(bbox_loss_ref, args)
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=0)
    for a, b in zip(got[1:], want[1:]):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * float(b.abs().max()) + 1e-30)
    return got


@pytest.mark.parametrize("seed", range(4))
def test_loss_random_shapes(impl, seed):
    B, A, C, R = [(2, 300, 80, 16), (1, 777, 13, 16), (3, 100, 1, 7), (2, 200, 20, 33)][seed]
    _loss_check(impl, make_inputs(B, A, C, seed, fg_frac=0.2, reg_max=R))


def test_loss_realistic_640(impl):
    if impl.name == "emu":
        args = make_inputs(1, 1500, 80, 3, anc=anchors_640()[:1500])  # the emulation is slow
    else:
        args = make_inputs(4, 8400, 80, 3, anc=anchors_640())
    _loss_check(impl, args)


@pytest.mark.parametrize("case", ["no_fg", "all_fg"])
def test_loss_foreground_extremes(impl, case):
    pd, ps, anc, tb, ts, fg = make_inputs(2, 150, 7, 4, fg_frac=0.5)
    fg = torch.zeros_like(fg) if case == "no_fg" else torch.ones_like(fg)
    ts = ts * fg[..., None] if case == "no_fg" else ts
    _loss_check(impl, (pd, ps, anc, tb, ts, fg))


def test_loss_dfl_targets_on_bin_edges_and_degenerate_boxes(impl):
    pd, ps, anc, tb, ts, fg = dfl_edge_inputs()
    tb[0, :3, 2] = tb[0, :3, 0]  # zero width
    tb[0, 3:5, 2:] = tb[0, 3:5, :2]  # a point
    pd[0, 6:8] = 0
    pd[0, 6:8, ::16] = 60.0  # softmax saturated on bin 0
    _loss_check(impl, (pd, ps, anc, tb, ts, fg))


def test_loss_background_boxes_are_never_read(impl):
    pd, ps, anc, tb, ts, fg = make_inputs(2, 120, 6, 5, fg_frac=0.3)
    ts = ts * fg[..., None]
    tb = torch.where(fg[..., None], tb, torch.full_like(tb, float("nan")))
    got = _loss_check(impl, (pd, ps, anc, tb, ts, fg))
    assert all(torch.isfinite(t).all() for t in got)


def test_loss_float64_tight(impl):
    _loss_check(impl, make_inputs(2, 50, 3, 2, fg_frac=0.7, reg_max=6, dtype=torch.float64), rtol=1e-12)


def test_loss_low_precision_inputs_compute_in_float32(impl):
    pd, ps, anc, tb, ts, fg = make_inputs(2, 200, 10, 9, fg_frac=0.1)
    for dt in (torch.bfloat16, torch.float16):
        args = impl.to((pd.to(dt), ps.to(dt), anc, tb, ts, fg))
        got = losses_and_grads(impl.loss, args)
        want = losses_and_grads(bbox_loss_ref, args)
        assert got[0].dtype == torch.float32 and got[1].dtype == dt and got[2].dtype == dt
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=0)


def test_loss_every_output_written_and_deterministic(impl, monkeypatch):
    args = impl.to(make_inputs(3, 333, 13, 5, fg_frac=0.3))
    raw = impl.ops.bbox_loss
    clean = raw(*args)
    monkeypatch.setenv("YOLOFAST_POISON_OUTPUTS", "1")
    poisoned = raw(*args)
    for a, b in zip(clean, poisoned):
        assert torch.isfinite(b).all() and torch.equal(a, b)  # bitwise: no float atomics anywhere


def test_loss_bad_shapes_raise_clear_errors(impl):
    pd, ps, anc, tb, ts, fg = impl.to(make_inputs(1, 20, 3, 6))
    with pytest.raises(RuntimeError, match="anchor_points"):
        impl.ops.bbox_loss(pd, ps, anc[:-1], tb, ts, fg)
    with pytest.raises(RuntimeError, match="reg_max"):
        impl.ops.bbox_loss(pd[..., :4], ps, anc, tb, ts, fg)


# ------------------------------------------------------------------------------------------- ema_update
def _ema_pair(n, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    ema = torch.randn(n, generator=g).to(dtype)
    model = (ema.float() + torch.randn(n, generator=g) * 0.1).to(dtype)
    return ema.to(device), model.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_ema_matches_reference(impl, dtype):
    for n in (1, 15, 17, 1000, 4099):
        for decay in (0.9999, 0.3, 0.5, 0.0):
            for decay_dtype in (torch.float32, torch.float64):
                ema, model = _ema_pair(n, dtype, n, impl.device)
                d = torch.tensor(decay, dtype=decay_dtype, device=impl.device)
                want = ema.clone()
                ema_update_ref(want, model, d)
                before = model.clone()
                impl.ops.ema_update(ema, model, d)
                assert torch.equal(model, before)
                ulp = torch.finfo(dtype).eps  # torch's own lerp may round a*b + c twice in a tail loop
                torch.testing.assert_close(ema, want, rtol=ulp, atol=ulp * 1e-3)
                assert (ema != want).float().mean() < 0.01


def test_ema_decay_sources_views_and_mixed_dtypes(impl):
    dev = impl.device
    ema, model = _ema_pair(1001, torch.float32, 1, dev)
    for d in (
        torch.tensor(0.7),
        torch.tensor(0.7, dtype=torch.float64, device=dev),
        torch.tensor(0.7, dtype=torch.bfloat16, device=dev),
    ):
        e, want = ema.clone(), ema.clone()
        impl.ops.ema_update(e, model, d)
        ema_update_ref(want, model, d.to(dev))
        torch.testing.assert_close(e, want, rtol=1.2e-7, atol=0)
    base = torch.zeros(1002, device=dev)
    view = base[1:]  # 4 bytes off the 16-byte alignment: the element-wise path
    view.copy_(ema)
    want = ema.clone()
    d = torch.tensor(0.9, device=dev)
    impl.ops.ema_update(view, model, d)
    ema_update_ref(want, model, d)
    torch.testing.assert_close(view, want, rtol=1.2e-7, atol=0)
    assert base[0] == 0
    low, full = ema.bfloat16(), model.clone()  # a float32 model into a bf16 EMA
    want = low.clone()
    impl.ops.ema_update(low, full, torch.tensor(0.6, dtype=torch.float64, device=dev))
    ema_update_ref(want, full, torch.tensor(0.6, dtype=torch.float64, device=dev))
    assert torch.equal(low, want)


def test_ema_bad_arguments(impl):
    ema, model = _ema_pair(10, torch.float32, 2, impl.device)
    with pytest.raises(RuntimeError, match="differ in shape"):
        impl.ops.ema_update(ema, model[:5], torch.tensor(0.5))
    with pytest.raises(RuntimeError, match="contiguous"):
        impl.ops.ema_update(ema.view(2, 5).t(), model.view(2, 5).t(), torch.tensor(0.5))
    with pytest.raises(RuntimeError, match="one value"):
        impl.ops.ema_update(ema, model, torch.tensor([0.5, 0.5]))


# ============================================================================================ 3. GPU only
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")


@pytest.fixture(scope="module")
def cuda_ops():
    ok, why = _build.extension_status("cuda")
    assert ok, f"a GPU is visible but the CUDA extension is not available: {why}"
    return torch.ops.yolofast


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
    ema, model = _ema_pair(100_000, torch.float32, 3, "cuda")
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
    ema, model = _ema_pair(1000, torch.float32, 4, "cuda")
    torch.library.opcheck(cuda_ops.ema_update.default, (ema, model, torch.tensor(0.9, device="cuda")))


@gpu
@pytest.mark.cuda
def test_gpu_dense_scene_and_memory(cuda_ops):
    """B=2, 640 px, 1,000 GT per image: identical to the reference, in a fraction of its memory."""
    args = tuple(a.cuda() for a in random_scene(31, B=2, M=1000, pad=False, min_side=4.0, max_side=96.0))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = cuda_ops.tal_assign(*args, TOPK, ALPHA, BETA, EPS)
    torch.cuda.synchronize()
    ours = torch.cuda.max_memory_allocated() - base
    del out
    torch.cuda.reset_peak_memory_stats()
    ref, _ = _tal_check(Impl("gpu", "cuda", cuda_ops), args)
    theirs = torch.cuda.max_memory_allocated() - base
    assert int(ref[3].sum()) > 1000
    assert ours * 20 < theirs, (ours, theirs)


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
