"""gradients: the norm of each loss branch's gradient over the whole model, the head and each layer group.

The branches box, cls and dfl come from the standard loss (``Trainer.get_loss``) on the same maps; the
gradient of the user's own total minus theirs is what the user's loss adds beyond them (a distillation
term, a branch counted twice): it is reported as one more branch when it is not ~0. With distill_model the
distillation term is the branch ``dis``: it reaches the student through the projectors and the maps that
enter the head (P3-P5), not through the head maps, so it is split off at its own output, L_dis.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from yolofast.doctor.report import Section, fmt
from yolofast.doctor.trace import BRANCHES, branch_names, standard_branches

__all__ = ["layer_groups", "branch_gradients", "check_gradients"]

DOMINANT = 10.0  # a branch whose gradient is this many times every other branch's is flagged


def layer_groups(model: nn.Module) -> list[tuple[str, list]]:
    """(name, trainable parameters) in forward order: one group per layer of ``model.model``, the Detect
    head split into its box (cv2) and class (cv3) branches; other modules: their top-level children."""
    layers = getattr(model, "model", None)
    named = (list(layers.named_children()) if isinstance(layers, nn.ModuleList | nn.Sequential)
             else list(model.named_children()))
    groups = []
    for name, m in named:
        if not any(True for _ in m.parameters()):
            continue  # Upsample, Concat: nothing to train
        label = f"{name} {type(m).__name__}"
        if hasattr(m, "cv2") and hasattr(m, "cv3") and hasattr(m, "reg_max"):  # Detect
            groups.append((f"{label}.box", [p for p in m.cv2.parameters() if p.requires_grad]))
            groups.append((f"{label}.cls", [p for p in m.cv3.parameters() if p.requires_grad]))
            rest = {id(p) for p in (*m.cv2.parameters(), *m.cv3.parameters())}
            other = [p for p in m.parameters() if p.requires_grad and id(p) not in rest]
            if other:
                groups.append((f"{label}.other", other))
        else:
            groups.append((label, [p for p in m.parameters() if p.requires_grad]))
    return groups


def head_params(model: nn.Module) -> list:
    head = getattr(model, "head", None)
    if head is None and isinstance(getattr(model, "model", None), nn.ModuleList | nn.Sequential):
        head = model.model[-1]
    return list(head.parameters()) if head is not None else []


def _norm(grads) -> float:
    g = [x.detach().float().norm() for x in grads if x is not None]
    return float(torch.linalg.vector_norm(torch.stack(g))) if g else 0.0


def branch_gradients(s, feats) -> dict:
    """{branch: per-parameter grads} for box, cls, dfl (x batch, as the total weighs them) and, when it is
    not ~0, the rest of the user's total; ``dis`` when distilling. ``feats``: float32 ``s.forward()``.

    The branches are split on the head maps, in float32, where the sum of the branch gradients equals the
    total's exactly; each map gradient then goes back through the model (under bf16 autocast the backward
    of a sum differs from the sum of backwards by ~3 % of the norm, too much to tell a real extra term)."""
    params = [p for p in s.step.parameters() if p.requires_grad]  # the student's (+ the projectors')
    bsz = feats[0].shape[0]
    leaves = [f.detach().requires_grad_(True) for f in feats]
    t = standard_branches(s.standard, s.maps(leaves), s.batch)
    total, items = s.loss(leaves, s.batch)
    names = branch_names(s.loss, torch.as_tensor(items).numel())

    def map_grad(y, retain=True):
        g = torch.autograd.grad(y, leaves, retain_graph=retain, allow_unused=True)
        return [torch.zeros_like(f) if x is None else x for f, x in zip(leaves, g)]

    on_maps = {name: map_grad(t["branches"][k] * bsz) for k, name in enumerate(BRANCHES)}
    scaled = {}
    if torch.as_tensor(total).requires_grad:
        g_total = map_grad(total, retain=False)
        if s.distilling:  # the gradient on L_dis (dis x batch) is the dis branch; the rest is on the maps
            on_maps["dis"] = [torch.zeros_like(g) for g in g_total[:-1]] + [g_total[-1]]
            g_total[-1] = torch.zeros_like(g_total[-1])
        rest = [gt - sum(on_maps[n][i] for n in BRANCHES) for i, gt in enumerate(g_total)]
        if _norm(rest) > 1e-4 * max(_norm(g_total), 1e-12) or not math.isfinite(_norm(rest)):
            name, c = _multiple_of(rest, on_maps)
            if name is not None:  # the user's loss weighs one branch differently: it is that branch's
                on_maps[name] = [(1 + c) * g for g in on_maps[name]]
                scaled[name] = 1 + c
            else:
                extra = names[3:-1] if s.distilling else names[3:]
                on_maps["+".join(extra) if extra else "rest"] = rest
    out = {name: torch.autograd.grad(feats, params, grad_outputs=g, retain_graph=True, allow_unused=True)
           for name, g in on_maps.items()}
    return {"grads": out, "params": params, "maps": {n: _norm(s.maps(g)) for n, g in on_maps.items()},
            "scaled": scaled}


def _multiple_of(rest, on_maps) -> tuple[str | None, float]:
    """(branch, c) when ``rest`` is c x that branch's map gradient (to 0.1 %), else (None, 0)."""
    for name in BRANCHES:
        g = on_maps[name]
        gg = float(sum((x.double() * x.double()).sum() for x in g))
        if gg > 0 and math.isfinite(gg):
            c = float(sum((r.double() * x.double()).sum() for r, x in zip(rest, g))) / gg
            if _norm([r - c * x for r, x in zip(rest, g)]) <= 1e-3 * _norm(rest):
                return name, c
    return None, 0.0


def check_gradients(sec: Section, s, feats) -> dict:
    r = branch_gradients(s, feats)
    params, grads = r["params"], r["grads"]
    index = {id(p): i for i, p in enumerate(params)}
    groups = layer_groups(s.model)
    if s.distilling:
        groups.append(("projectors (dis)",
                       [p for p in s.step.projector.parameters() if p.requires_grad]))
    student = [id(p) for p in s.model.parameters()]
    head = {id(p) for p in head_params(s.model)}

    def norm_of(g, ids) -> float:
        return _norm([g[index[i]] for i in ids if i in index])

    table = {}
    for name, g in grads.items():
        table[name] = {"model": norm_of(g, student), "head": norm_of(g, head), "head_maps": r["maps"][name],
                       "groups": {gn: norm_of(g, [id(p) for p in ps]) for gn, ps in groups}}
    names = list(table)
    sec.add(f"{'gradient norm':<24}" + "".join(f"{n:>12}" for n in names))
    whole = "whole model (student)" if s.distilling else "whole model"
    sec.add(f"{whole:<24}" + "".join(f"{fmt(table[n]['model']):>12}" for n in names))
    sec.add(f"{'head parameters':<24}" + "".join(f"{fmt(table[n]['head']):>12}" for n in names))
    sec.add(f"{'head maps (its output)':<24}" + "".join(f"{fmt(table[n]['head_maps']):>12}" for n in names))
    for gn, ps in groups:
        if ps:
            sec.add(f"  {gn:<22}" + "".join(f"{fmt(table[n]['groups'][gn]):>12}" for n in names))
    for name, c in r["scaled"].items():
        sec.add(f"({name}: your loss's gradient is {c:.2f}x the standard loss's for this branch)")
    out = {"branches": table, "scaled_vs_standard": r["scaled"]}

    frozen = [gn for gn, ps in groups if not ps]
    hp = head_params(s.model)
    if hp and not any(p.requires_grad for p in hp):
        sec.flag("head-frozen", "FAIL", f"the Detect head has no trainable parameter (its {len(hp)} tensors "
                 "are frozen): it cannot learn the boxes or classes of this data",
                 "do not freeze the head (freeze=N counts layers from the input; requires_grad_(True) on "
                 "model.head)")
    elif frozen:
        sec.flag("frozen-layers", "WARN", f"layers without a trainable parameter: {', '.join(frozen)}",
                 "expected only when freezing on purpose (freeze=...)")
    dead = [gn for gn, ps in groups
            if ps and all(g[index[id(p)]] is None for g in grads.values() for p in ps)]
    if dead:
        sec.flag("params-without-gradient", "WARN", f"trainable layers the loss does not reach: "
                 f"{', '.join(dead)}", "check that forward() uses them (or freeze them on purpose)")

    for name in names:  # non-finite: the first group, walking back from the loss, where it appears
        bad = [gn for gn, ps in groups if not math.isfinite(table[name]["groups"][gn])]
        if bad or not math.isfinite(table[name]["model"]):
            start = bad[-1] if bad else "?"
            sec.flag("gradient-non-finite", "FAIL",
                     f"the {name} gradient is non-finite, starting at {start} ({len(bad)} of {len(groups)} "
                     f"layer groups)", "find the NaN in the trace above (images, targets, head maps, loss); "
                     "if none, lower lr0 or try amp=False")
    finite = {n: table[n]["model"] for n in names if math.isfinite(table[n]["model"])}
    for name, v in finite.items():
        others = [x for n, x in finite.items() if n != name and x > 0]
        if not others or v <= DOMINANT * max(others):
            continue
        start = None
        for gn, ps in reversed(groups):  # from the head back: where the branch first towers over the rest
            gv = table[name]["groups"][gn]
            go = [table[n]["groups"][gn] for n in finite if n != name]
            if ps and gv > DOMINANT * max(max(go), 1e-30):
                start = gn
                break
        sec.flag("gradient-branch-dominant", "FAIL",
                 f"the {name} gradient is {v / max(others):.1f}x the largest other branch's over the whole "
                 f"model{f', from {start} back' if start else ''}",
                 "lower dis=... or check that distill_model predicts this data (mAP of the teacher)"
                 if name == "dis" else f"check the {name} branch's targets (a duplicated target multiplies "
                 f"it) and its gain ({name}=... in the recipe)")
    return out
