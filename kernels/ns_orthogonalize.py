"""Triton ``ns_orthogonalize``: Muon's Newton–Schulz NS5 of a whole list of matrices (YOLO11_YOLO26.md §5.3),
spec ``reference.ns_orthogonalize_ref`` applied to ``u.reshape(u.shape[0], -1)`` of every u.

The list is grouped by (rows, cols, dtype) without padding (a YOLO model's 88-136 Muon matrices have 37-41
distinct shapes); each group is one (G, r, c) batch, and each of NS5's 15 products is ONE launch of
``_ns_bmm_kernel`` over the whole batch: a strided batched ``out = alpha·(A @ B) + beta·C`` with bf16
inputs, fp32 accumulation (``tl.dot``) and one rounding to bf16 at the store, as ``torch.baddbmm`` in bf16.
Transposes are strides, never copies: ``X Xᵀ`` reads X twice, and a tall group (r > c) iterates on ``Xᵀ``
(the smaller Gram matrix) by reading and writing its (G, r, c) buffers through swapped strides, so the
result lands in the input's orientation. The Frobenius norms, the gather into the batches and the scatter
back are torch ops (one multi-tensor copy each way). Shapes come from the tensors' metadata only and
nothing is read back to the host: the op is CUDA-graph capturable.

``fp32=True`` computes in float32 (``tl.dot`` with ``input_precision="ieee"``: no TF32), the mode for
hardware without native bf16 (yolofast/ops/ns_orthogonalize.py states its tolerance). Tolerance against the
bf16 reference: the kernel sums each product in another order than the reference's GEMM, so a result
differs from it by bf16 rounding compounded over 5 iterations (tests/ops/test_ns_orthogonalize.py:
``TRITON_ATOL``), not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _common
from ._constants import NS_EPS

# Muon's quintic coefficients (a, b, c); equal to reference.NS_COEFFS (the tests hold them together).
NS_COEFFS = (3.4445, -4.7750, 2.0315)
# Largest tile side: 64 x 64 fp32 accumulators over 4 warps on a GPU (32 per thread), 32-deep K steps. The
# interpreter runs programs one by one in numpy: there bigger tiles mean fewer Python-level iterations.
MAX_BLOCK_MN = 256 if _common.INTERPRET else 64
MAX_BLOCK_K = 256 if _common.INTERPRET else 32
_DTYPES = {False: torch.bfloat16, True: torch.float32}
_INTERPRET = tl.constexpr(_common.INTERPRET)


@triton.jit
def _ns_bmm_kernel(a_ptr, b_ptr, c_ptr, out_ptr, M, N, K,
                   sab, sam, sak, sbb, sbk, sbn, scb, scm, scn, sob, som, son,
                   alpha, beta, HAS_C: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[g] = alpha·(A[g] @ B[g]) + beta·C[g] for one BLOCK_M x BLOCK_N tile of batch member g (axis 1);
    every operand addressed by its own (batch, row, col) strides, so transposed views cost nothing."""
    g = tl.program_id(1).to(tl.int64)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    rm = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm = rm < M
    mn = rn < N
    a_row = a_ptr + g * sab + rm[:, None].to(tl.int64) * sam
    b_col = b_ptr + g * sbb + rn[None, :].to(tl.int64) * sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mk = rk < K
        a = tl.load(a_row + rk[None, :].to(tl.int64) * sak, mask=mm[:, None] & mk[None, :], other=0.0)
        b = tl.load(b_col + rk[:, None].to(tl.int64) * sbk, mask=mk[:, None] & mn[None, :], other=0.0)
        if _INTERPRET:  # its bf16 dot multiplies raw bits: upcast (exact) and sum in fp32, as the GPU does
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    res = acc * alpha
    omask = mm[:, None] & mn[None, :]
    if HAS_C:
        c_off = g * scb + rm[:, None].to(tl.int64) * scm + rn[None, :].to(tl.int64) * scn
        c = tl.load(c_ptr + c_off, mask=omask, other=0.0).to(tl.float32)
        res = res + beta * c
    o_off = g * sob + rm[:, None].to(tl.int64) * som + rn[None, :].to(tl.int64) * son
    tl.store(out_ptr + o_off, _common.cast_to(res, out_ptr.dtype.element_ty), mask=omask)


def _block(n: int, cap: int) -> int:
    """16 (tl.dot's smallest tile side) for n <= 16, else ``cap``: two tile sizes per side, so a GPU compiles
    ~10 variants for all 94 Muon shapes instead of one per power of two; the interpreter, where a tile
    costs per element and a program per launch, takes the power of two up to ``cap``."""
    if _common.INTERPRET:
        return min(max(_common.next_pow2(n), 16), cap)
    return 16 if n <= 16 else cap


def _bmm(a: Tensor, b: Tensor, out: Tensor, alpha: float = 1.0, c: Tensor | None = None,
         beta: float = 0.0) -> None:
    """out = alpha·(a @ b) + beta·c over (G, ·, ·) strided views; out must not overlap a, b (c may be out)."""
    G, M, K = a.shape
    N = b.shape[2]
    bm, bn, bk = _block(M, MAX_BLOCK_MN), _block(N, MAX_BLOCK_MN), _block(K, MAX_BLOCK_K)
    cc = out if c is None else c
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), G)
    _common.launch(_ns_bmm_kernel)[grid](
        a, b, cc, out, M, N, K, *a.stride(), *b.stride(), *cc.stride(), *out.stride(), float(alpha),
        float(beta), HAS_C=c is not None, IEEE=a.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=4,
    )


def _newton_schulz(x: Tensor, steps: int, eps: float) -> Tensor:
    """NS5 of the contiguous (G, r, c) batch x (overwritten); returns a contiguous (G, r, c) result."""
    r, c = x.shape[1:]
    x.div_(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).add_(eps))  # the reference's ops
    tall = r > c
    view = (lambda t: t.transpose(1, 2)) if tall else (lambda t: t)  # the iterate X: (G, m, n), m <= n
    m = min(r, c)
    a, b, cc = NS_COEFFS
    gram = torch.empty(x.shape[0], m, m, dtype=x.dtype, device=x.device)
    poly = torch.empty_like(gram)
    other = torch.empty_like(x)  # X ping-pongs between x and other: the product must not overwrite its input
    for _ in range(steps):
        X = view(x)
        _bmm(X, X.transpose(1, 2), gram)
        _bmm(gram, gram, poly, alpha=cc, c=gram, beta=b)
        _bmm(poly, X, view(other), c=X, beta=a)
        x, other = other, x
    return x


def _groups(mats: list[Tensor]) -> list[list[int]]:
    where: dict[tuple, list[int]] = {}
    for i, u in enumerate(mats):
        r = u.shape[0]
        where.setdefault((r, u.numel() // max(r, 1), u.dtype), []).append(i)
    return list(where.values())


def _check(mats: list[Tensor], steps: int) -> None:
    if steps < 0:
        raise ValueError(f"ns_orthogonalize: steps must be >= 0, got {steps}")
    for i, u in enumerate(mats):
        if u.dim() < 2:
            raise ValueError(f"ns_orthogonalize: tensor {i} has shape {tuple(u.shape)}; Muon orthogonalises "
                             f"matrices and conv weights (ndim >= 2): give the others to SGD")
        if not u.dtype.is_floating_point:
            raise TypeError(f"ns_orthogonalize: tensor {i} is {u.dtype}; expected a floating-point momentum")
        if u.device != mats[0].device:
            raise ValueError(f"ns_orthogonalize: tensor {i} is on {u.device} but tensor 0 on "
                             f"{mats[0].device}; orthogonalise one device's tensors per call")


@torch.library.triton_op("yolofast::ns_orthogonalize_triton", mutates_args=())
def _ns_orthogonalize_op(mats: list[Tensor], steps: int, eps: float, fp32: bool) -> list[Tensor]:
    _check(mats, steps)
    cdt = _DTYPES[bool(fp32)]
    out = [torch.empty(u.shape, dtype=u.dtype, device=u.device) for u in mats]
    groups, batches, dst, src = _groups(mats), [], [], []
    for idx in groups:  # gather: one multi-tensor copy (and cast) for the whole list
        u0 = mats[idx[0]]
        r = u0.shape[0]
        x = torch.empty(len(idx), r, u0.numel() // max(r, 1), dtype=cdt, device=u0.device)
        batches.append(x)
        if x.numel():
            dst += [x[j].view(mats[i].shape) for j, i in enumerate(idx)]
            src += [mats[i] for i in idx]
    if dst:
        torch._foreach_copy_(dst, src)
    dst, src = [], []
    for idx, x in zip(groups, batches):
        if x.numel():
            y = _newton_schulz(x, int(steps), float(eps))
            dst += [out[i].view(y.shape[1:]) for i in idx]
            src += list(y.unbind(0))
    if dst:
        torch._foreach_copy_(dst, src)  # scatter, cast to each input's dtype
    return out


def ns_orthogonalize(mats, steps: int = 5, eps: float = NS_EPS, fp32: bool = False) -> list[Tensor]:
    """NS5(u.reshape(u.shape[0], -1)) for every u in ``mats`` (a list of tensors, ndim >= 2, one device),
    each returned contiguous in u's shape and dtype; bf16 compute (``fp32=True``: float32)."""
    with torch.no_grad():
        return torch.ops.yolofast.ns_orthogonalize_triton(list(mats), int(steps), float(eps), bool(fp32))
