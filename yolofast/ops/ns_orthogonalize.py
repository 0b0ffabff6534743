"""Public ``ns_orthogonalize``: Muon's Newton–Schulz orthogonalisation of a whole list of matrices (the
Muon part of a MuSGD step), dispatched to the selected backend.

    outs = ns_orthogonalize([m.grad for m in convs])     # each NS5(mat(g)) in g's shape and dtype

Backends: "cpp" (CPU) groups the list by shape and runs each group as one batched bmm/baddbmm per product
(csrc/common/ns_groups.h), no padding; "ref" runs ``reference.ns_orthogonalize_ref`` matrix by matrix.
Both give the same bits (the batched products compute each matrix as they compute it alone). On a GPU,
"cuda" (the same grouping on cuBLAS, csrc/cuda/ns_orthogonalize_cuda.cpp) and "triton" (one batched
strided-matmul launch per product and shape, kernels/ns_orthogonalize.py) sum their products in another
order than the reference's GEMMs: within bf16 rounding of it (<= 0.03 absolute), not bit for bit. Every
backend is CUDA-graph capturable. ``fp32=True``
computes in float32 instead of bfloat16: for CPUs without native bf16 arithmetic, where bf16 matmuls are
emulated and several times slower; it differs from the bf16 reference by bf16 rounding (max abs
difference <= 0.03 on entries up to ~0.5; measured 0.011 on one random matrix of each Muon shape of the
YOLO11/YOLO26 models, tests/ops/test_ns_orthogonalize.py), which Muon's update does not care about: NS5
only approximates the polar factor (singular values 0.7-1.2) in either dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from yolofast.ops._backend import backend_name, implementation

__all__ = ["ns_orthogonalize"]


def ns_orthogonalize(mats, *, steps: int = 5, eps: float = 1e-7, fp32: bool = False) -> list[Tensor]:
    """NS5(mat(u)) for every u in ``mats`` (a tensor or a list; ndim >= 2), each returned in u's shape and
    dtype, contiguous. ``mat(u)`` = u.reshape(u.shape[0], -1): rows = output channels, columns = the rest in
    NCHW order whatever u's memory format. Semantics: ``reference.ns_orthogonalize_ref`` (bf16 NS5 with
    Muon's coefficients, each matrix in its own orientation); ``fp32=True`` computes in float32.
    """
    single = torch.is_tensor(mats)
    mats = [mats] if single else list(mats)
    if not mats:
        return []
    for i, u in enumerate(mats):
        if u.dim() < 2:
            raise ValueError(f"ns_orthogonalize: tensor {i} has shape {tuple(u.shape)}; Muon orthogonalises "
                             f"matrices and conv weights (ndim >= 2): give the others to SGD")
    name = backend_name("ns_orthogonalize", mats[0].device.type)
    fn = implementation("ns_orthogonalize", name)
    if name == "ref":
        dtype = torch.float32 if fp32 else torch.bfloat16
        out = [fn(u.reshape(u.shape[0], -1), steps, eps, dtype).view(u.shape) for u in mats]
    else:
        out = fn(mats, steps, eps, fp32)
    return out[0] if single else out
