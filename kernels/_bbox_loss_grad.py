"""The autograd glue of the fused ``bbox_loss`` ops, shared by ``yolofast::bbox_loss`` (C++/CUDA,
registered in ``yolofast/ops/_schemas.py``) and ``yolofast::bbox_loss_triton`` (``bbox_loss.py`` here).

Both ops return ``(losses (3,) [L_box, L_cls, L_dfl], grad_dist_box (B,A,4R), grad_dist_dfl (B,A,4R),
grad_scores (B,A,C), inv_s ())``: the forward pass has already computed the gradients of S*L_box, S*L_dfl
and S*L_cls w.r.t. the logits, and inv_s = 1/S, so backward only scales them by the incoming grads over S
(DESIGN §2.2: nothing is recomputed, nothing else is kept alive).

``yolofast::bbox_loss.rows`` (the CPU path of ``bbox_loss``) returns ``grad_scores`` and, like the maps op
below, the box and DFL gradients of the foreground anchors only; its backward is
``yolofast::_bbox_loss_rows_scale``.

``yolofast::bbox_loss_maps`` returns the class gradient in the head maps' layout, one (B, C, H, W)
``grad_cls`` per level, and the box and DFL gradients of the foreground anchors only (``fg_rows`` (N, 2, 4R),
``fg_index`` (N,)); its backward, ``yolofast::_bbox_loss_maps_scale``, writes each map's gradient straight
into a fresh (B, 4R+C, H, W) tensor in one pass (no cat, no zero rows stored).
"""

from __future__ import annotations

import torch


def eager() -> bool:
    """Plain eager execution. Under torch.compile or a dispatch mode (a graph-capture recorder such as
    tests/graph_emulator.py, fake tensors) shapes and control flow must not depend on the data: the loss ops
    then take their static layout and the backward never tests the incoming gradient's values."""
    if torch.compiler.is_compiling():
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is None


def setup_context(ctx, inputs, output) -> None:
    """Both (B, A, .) ops, ``bbox_loss`` and ``bbox_loss.rows``: every output but the losses is kept for
    backward and is not differentiable."""
    ctx.save_for_backward(*output[1:])
    ctx.dtypes = (inputs[0].dtype, inputs[1].dtype)
    ctx.mark_non_differentiable(*output[1:])
    # Otherwise autograd hands backward zero-filled grads for those 4 outputs: 55 MB of memset per step.
    ctx.set_materialize_grads(False)


def backward(ctx, g_losses, *_unused):
    grad_dist_box, grad_dist_dfl, grad_scores, inv_s = ctx.saved_tensors
    if g_losses is None:
        return (None,) * 6
    c = g_losses.to(inv_s.dtype) * inv_s  # (3,): the incoming grads over S
    grad_dist = grad_pred_scores = None
    if ctx.needs_input_grad[0]:
        # One fresh (B, A, 4R) buffer, not two: at B=8 each costs ~17 MB of first-touch page faults.
        grad_dist = (grad_dist_box * c[0]).addcmul_(grad_dist_dfl, c[2]).to(ctx.dtypes[0])
    if ctx.needs_input_grad[1]:
        grad_pred_scores = (grad_scores * c[1]).to(ctx.dtypes[1])
    return grad_dist, grad_pred_scores, None, None, None, None


def l1_backward(ctx, g_losses, *_unused):
    """``backward`` of the reg_max 1 ops (``bbox_loss.l1``: three more inputs, the L1 geometry)."""
    return (*backward(ctx, g_losses), None, None, None)


def maps_setup_context(ctx, inputs, output) -> None:
    feats, reg_max = inputs[0], inputs[5]  # (inputs[6], compact, changes the layout, not the backward)
    ctx.n_inputs = len(inputs)
    _, grad_cls, fg_rows, fg_index, inv_s = output
    ctx.save_for_backward(inv_s, fg_rows, fg_index, *grad_cls)
    ctx.reg_max = int(reg_max)
    ctx.dtypes = [f.dtype for f in feats]
    # Given weights, grad_cls holds the final gradients of weights . losses (see yolofast/ops/_schemas.py).
    ctx.weights = inputs[8].detach() if len(inputs) > 8 and inputs[8] is not None else None
    ctx.handed_out = False
    ctx.mark_non_differentiable(*grad_cls, fg_rows, fg_index, inv_s)
    ctx.set_materialize_grads(False)


def maps_backward(ctx, g_losses, *_unused):
    inv_s, fg_rows, fg_index, *grad_cls = ctx.saved_tensors
    rest = (None,) * (ctx.n_inputs - 1)
    if g_losses is None:  # a Tensor[] input takes a list of (undefined) grads, not one None
        return [None] * len(grad_cls), *rest
    c = g_losses.to(inv_s.dtype) * inv_s  # (3,): the incoming grads over S
    if ctx.weights is not None:
        if ctx.handed_out:
            raise RuntimeError(
                "bbox_loss_maps: a second backward through a loss whose final gradients were already handed "
                "on (they may have been accumulated into since); call it without weights to backpropagate "
                "more than once")
        if eager() and torch.equal(g_losses, ctx.weights.to(g_losses.dtype)):  # (traced: data-dependent)
            # The gradient the forward prepared: the maps' gradients as they are, nothing written here
            # (b16/320, AVX2: a 2.9 ms pass over 30 MB).
            ctx.handed_out = True
            return [g.to(dt) for g, dt in zip(grad_cls, ctx.dtypes)], *rest
        # Another gradient (a branch alone, a scaled loss): the box channels again from the compact rows,
        # the class channels, (sigmoid - t) * k1, rescaled by c1 / k1.
        k = ctx.weights.to(inv_s.dtype) * inv_s
        R4 = 4 * ctx.reg_max
        grad_cls = [g[:, R4:] for g in grad_cls]
        c = torch.stack((c[0], c[1] / k[1], c[2]))
    grads = torch.ops.yolofast._bbox_loss_maps_scale(grad_cls, fg_rows, fg_index, c, ctx.reg_max)
    return [g.to(dt) for g, dt in zip(grads, ctx.dtypes)], *rest


def rows_backward(ctx, g_losses, *_unused):
    grad_scores, fg_rows, fg_index, inv_s = ctx.saved_tensors
    if g_losses is None:
        return (None,) * 7
    c = g_losses.to(inv_s.dtype) * inv_s  # (3,): the incoming grads over S
    grad_dist, grad_pred_scores = torch.ops.yolofast._bbox_loss_rows_scale(grad_scores, fg_rows, fg_index, c)
    return grad_dist.to(ctx.dtypes[0]), grad_pred_scores.to(ctx.dtypes[1]), None, None, None, None, None
