"""Ahead-of-time compile of every Triton kernel for sm_90 (H100/H200), no GPU needed.

The interpreter (what the other Triton tests run on a CPU) never lowers a kernel, so a kernel that the
real compiler rejects (bad types, unsupported ops, a jit helper the code generator cannot inline) would
pass them and fail on the first GPU. Here each kernel goes through Triton's whole pipeline down to a cubin
(Triton's bundled ptxas) with the signatures the launch sites use (triton_aot_specs.py, one function
per kernel module).
It runs in subprocesses because tests/conftest.py sets TRITON_INTERPRET=1 in this process, and
``triton.jit`` decides between the interpreter and the compiler at import time.
"""

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

pytestmark = [pytest.mark.triton, pytest.mark.slow]  # ~15 s of compiling on 2 idle cores

_SCRIPT = r"""
import importlib, json, sys
sys.path.insert(0, sys.argv[1])  # tests/ops: triton_aot_specs
import triton
import triton_aot_specs
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction
from yolofast.kernels import _common
assert not _common.INTERPRET, "TRITON_INTERPRET leaked into the compile subprocess"
target = GPUTarget("cuda", 90, 32)
for name in sys.argv[2:]:
    mod = importlib.import_module("yolofast.kernels." + name)
    specs = getattr(triton_aot_specs, name)(mod)
    defined = sorted(k for k, v in vars(mod).items() if isinstance(v, JITFunction) and k.endswith("_kernel"))
    covered = sorted({k.fn.__name__ for k, *_ in specs})
    print(json.dumps({"mod": name, "defined": defined, "covered": covered}), flush=True)
    for kernel, signature, constexprs, options in specs:
        ce = {k: str(v) for k, v in constexprs.items()}
        rec = {"mod": name, "kernel": kernel.fn.__name__, "constexprs": ce}
        try:
            src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
            compiled = triton.compile(src, target=target, options=options)
            ptx = compiled.asm.get("ptx", "")
            # denormal-flushing arithmetic (.ftz); the approximate ex2/rcp/sqrt instructions always flush
            ftz = [ln.split()[0] for ln in ptx.splitlines() if ".ftz" in ln and "approx" not in ln]
            rec.update(ok=True, stages=sorted(compiled.asm), cubin=len(compiled.asm.get("cubin", b"")),
                       exact=options.get("enable_fp_fusion") is False, ftz=ftz[:5], n_ftz=len(ftz))
        except Exception as e:
            rec.update(ok=False, error=f"{type(e).__name__}: {e}"[-3000:])
        print(json.dumps(rec), flush=True)
"""


def _has_nvidia_backend() -> bool:
    from triton.backends import backends

    return "nvidia" in backends


@pytest.mark.skipif(
    not _has_nvidia_backend(), reason="this Triton build has no NVIDIA backend to compile with"
)
def test_every_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # the two cores compile in parallel (about 10 s per group): bbox_loss's main kernel alone takes ~8 s
    groups = [["bbox_loss", "ema_update"], ["tal_assign", "ns_orthogonalize"]]
    procs = []
    for i, mods in enumerate(groups):
        env_i = dict(env, TRITON_CACHE_DIR=str(tmp_path / f"cache{i}"))  # a fresh cache: really compile
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _SCRIPT, os.path.dirname(__file__), *mods],
                env=env_i,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    records = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, f"compile subprocess failed:\n{err[-4000:]}"
        records += [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    coverage = [r for r in records if "defined" in r]
    assert {r["mod"] for r in coverage} == {"bbox_loss", "tal_assign", "ema_update", "ns_orthogonalize"}
    for r in coverage:
        assert r["defined"] == r["covered"], f"{r['mod']}: kernels without an entry in triton_aot_specs.py"
    compiled = [r for r in records if "kernel" in r]
    failed = [f"{r['mod']}.{r['kernel']} {r['constexprs']}: {r['error']}" for r in compiled if not r["ok"]]
    assert not failed, "\n\n".join(failed)
    for r in compiled:
        assert {"ttir", "ttgir", "llir", "ptx", "cubin"} <= set(r["stages"]), r
        assert r["cubin"] > 0, r
    # The assigner's integer outputs must equal torch's: its exact kernels keep denormals (an overlap of
    # 3e-7 gives overlap**6 = 7e-40, not 0). With Triton's default enable_reflect_ftz the scan has 42.
    exact = [r for r in compiled if r["mod"] == "tal_assign" and r["exact"]]
    assert exact, "no tal_assign kernel was compiled with the exact options"
    flushing = [f"{r['kernel']} {r['constexprs']}: {r['n_ftz']} e.g. {r['ftz']}" for r in exact if r["n_ftz"]]
    assert not flushing, "\n".join(flushing)
