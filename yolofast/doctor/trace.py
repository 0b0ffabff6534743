"""trace: one batch through every stage — images, targets, head maps, assigner, loss branches."""

from __future__ import annotations

import torch

from yolofast.boxes import xywh2xyxy
from yolofast.doctor.report import Section, fmt, stats, stats_line
from yolofast.ops import reference
from yolofast.ops.bbox_loss import maps_to_rows

__all__ = ["trace_data", "trace_model", "standard_branches", "branch_names"]

BRANCHES = ("box", "cls", "dfl")


def branch_names(loss, n: int) -> list[str]:
    """Names of a loss's items: its own ``loss_names``/``item_names`` when it has them, else box, cls, dfl
    and ``item3``, ... for anything a loss adds; the distillation term of distill_model is ``dis``."""
    if _is_distill_loss(loss):
        return branch_names(loss.criterion, n - 1) + ["dis"]
    own = getattr(loss, "loss_names", None) or getattr(loss, "item_names", None)
    if own is not None and len(own) == n:
        return [str(x) for x in own]
    return list(BRANCHES[:n]) + [f"item{k}" for k in range(len(BRANCHES), n)]


def _is_distill_loss(loss) -> bool:
    """engine/distill.py's DistillLoss (a layer above the doctor, so known by its shape): the criterion's
    items, then ``dis x L_dis``."""
    return isinstance(loss, torch.nn.Module) and hasattr(loss, "criterion") and hasattr(loss, "dis")


# ---------------------------------------------------------------------------------------------- data
def trace_data(sec: Section, batch: dict, nc: int, label: str) -> dict:
    """Images and targets of one preprocessed batch; flags what would make the loss wrong."""
    img = batch["img"]
    bsz = img.shape[0]
    s_img = stats(img)
    sec.add(f"{label}: images {stats_line(s_img)}")
    if s_img["nonfinite"]:
        sec.flag("images-non-finite", "FAIL", f"{s_img['nonfinite']} image values are NaN/inf ({label})",
                 "check the image files and preprocess_batch (a division by a zero scale?)")
    if s_img["max"] > 1.0 + 1e-3 or s_img["min"] < -1e-3:
        sec.flag("images-not-normalized", "FAIL",
                 f"image values span [{fmt(s_img['min'])}, {fmt(s_img['max'])}] after preprocess_batch; the "
                 f"model expects [0, 1] ({label})", "divide uint8 images by 255 once in preprocess_batch")
    elif s_img["max"] - s_img["min"] < 1e-6:
        sec.flag("images-constant", "WARN", f"every image value is {fmt(s_img['max'])} ({label})",
                 "check that the loader reads the image files (not a blank letterbox)")

    bi = batch["batch_idx"].detach().reshape(-1).long().cpu()
    cls = batch["cls"].detach().reshape(-1).cpu()
    boxes = batch["bboxes"].detach().reshape(-1, 4).float().cpu()
    n = int(cls.numel())
    per_img = torch.bincount(bi.clamp(0, bsz), minlength=bsz + 1)[:bsz].tolist() if n else [0] * bsz
    xyxy = xywh2xyxy(boxes) if n else boxes
    bad_cls = (cls < 0) | (cls >= nc) | (cls != cls.round())
    off = ((xyxy < -0.01) | (xyxy > 1.01)).any(-1) if n else torch.zeros(0, dtype=torch.bool)
    tiny = (boxes[:, 2] <= 0) | (boxes[:, 3] <= 0) if n else torch.zeros(0, dtype=torch.bool)
    bad_idx = (bi < 0) | (bi >= bsz)
    dups = 0
    if n:
        rows = torch.cat((bi[:, None].float(), cls[:, None].float(), boxes), 1)
        dups = n - int(torch.unique(rows, dim=0).shape[0])
    out = {"images": s_img, "targets": n, "per_image": per_img, "class_out_of_range": int(bad_cls.sum()),
           "boxes_outside_0_1": int(off.sum()), "zero_size_boxes": int(tiny.sum()),
           "batch_idx_out_of_range": int(bad_idx.sum()), "duplicate_targets": dups}
    if n:
        out["classes_seen"] = [float(cls.min()), float(cls.max())]
    sec.add(f"{label}: targets {n} ({fmt(n / bsz, 3)} per image: {per_img}), classes "
            f"{'-' if not n else f'{int(cls.min())}..{int(cls.max())}'} of nc={nc}; out of range: class "
            f"{out['class_out_of_range']}, box outside [0, 1] {out['boxes_outside_0_1']}, zero size "
            f"{out['zero_size_boxes']}, duplicates {dups}")
    if out["class_out_of_range"]:
        sec.flag("labels-out-of-range", "FAIL",
                 f"{out['class_out_of_range']} of {n} targets have a class outside 0..{nc - 1} (seen "
                 f"{fmt(float(cls.min()))}..{fmt(float(cls.max()))}; {label})",
                 f"classes are 0-based indices below nc={nc}: check the label files' first column and the "
                 f"data yaml's names (a 1-based or shifted class column?)")
    if out["batch_idx_out_of_range"]:
        sec.flag("targets-batch-index", "FAIL",
                 f"{out['batch_idx_out_of_range']} targets point at images outside the batch of {bsz} "
                 f"(batch_idx up to {int(bi.max())}; {label})",
                 "build batch_idx once per image in the collate: a target tensor repeated along the batch "
                 "dimension gives indices >= batch size")
    if dups:
        sec.flag("duplicate-targets", "FAIL" if dups * 2 >= n else "WARN",
                 f"{dups} of {n} targets are exact copies of another target of the same image ({label})",
                 "build each image's targets once: a repeated target tensor counts its loss twice")
    if out["boxes_outside_0_1"]:
        lvl = "FAIL" if out["boxes_outside_0_1"] == n else "WARN"
        sec.flag("boxes-out-of-range", lvl,
                 f"{out['boxes_outside_0_1']} of {n} boxes reach outside the image ([0, 1] normalized; "
                 f"{label})", "labels are normalized 'cx cy w h' in [0, 1]: divide pixel coordinates by the "
                 "image width and height")
    if out["zero_size_boxes"]:
        sec.flag("zero-size-boxes", "WARN", f"{out['zero_size_boxes']} boxes have zero width or height "
                 f"({label})", "drop degenerate label lines or give them their real size")
    if not n:
        sec.flag("no-targets", "WARN", f"the batch holds no target ({label}): nothing to learn boxes from",
                 "check that the labels/ folder mirrors images/ and holds one .txt per image")
    for k in ("gt_cls", "gt_mask"):  # the padded copy the ops read must agree with the flat targets
        if k in batch and batch[k].shape[0] != bsz:
            sec.flag("targets-batch-index", "FAIL",
                     f"the padded '{k}' has {batch[k].shape[0]} rows for a batch of {bsz} images ({label})",
                     "pad targets per image (yolofast.data.collate.pad_targets), one row per image")
    if "gt_mask" in batch and batch["gt_mask"].shape[0] == bsz and int(batch["gt_mask"].sum()) != n:
        sec.flag("targets-padding-mismatch", "FAIL",
                 f"the padded targets hold {int(batch['gt_mask'].sum())} boxes, the flat ones {n} ({label})",
                 "build gt_cls/gt_bboxes/gt_mask from the same cls/bboxes/batch_idx (pad_targets)")
    return out


# ---------------------------------------------------------------------------------------------- loss
def standard_branches(loss, feats, batch) -> dict:
    """The standard loss (a ``DetectionLoss``), stage by stage (``DetectionLoss.stages``): targets, assigner
    outputs, and the differentiable per-branch values ``branches`` (3,) = [box, cls, dfl] with their gains
    (no batch factor), the same numbers ``DetectionLoss.__call__`` returns as items."""
    st = loss.stages(feats, batch)
    with torch.no_grad():  # the assigner's scores, for the reasons a GT got no anchor
        pd_scores = maps_to_rows([f.detach().float() for f in feats], loss.reg_max)[1].sigmoid()
    return {"branches": st.items, "fg_mask": st.fg_mask, "gt_idx": st.target_gt_idx, "gt_cls": st.gt_cls,
            "gt_xyxy": st.gt_xyxy, "gt_mask": st.gt_mask, "pd_scores": pd_scores, "pd_bboxes": st.pd_bboxes,
            "anc_px": st.anc_px, "img_wh": st.img_wh}


_REASONS = {
    "outside": "outside the image",
    "degenerate": "zero width or height",
    "small": "no anchor centre inside it (too small for the strides)",
    "no_overlap": "no predicted box overlaps it yet (alignment 0 on every candidate)",
    "taken": "its anchors went to overlapping GTs with a larger overlap",
}


@torch.no_grad()
def _unassigned(t: dict, loss) -> tuple[list, dict]:
    """GTs that got no positive anchor, each with the first reason that applies (dense per image: M x A)."""
    fg, gt_idx, mask = t["fg_mask"], t["gt_idx"], t["gt_mask"].reshape(t["fg_mask"].shape[0], -1) > 0
    w_img, h_img = t["img_wh"]
    anc = t["anc_px"].float()
    rows, counts = [], dict.fromkeys(_REASONS, 0)
    for b in range(fg.shape[0]):
        real = mask[b].nonzero().flatten()
        if not real.numel():
            continue
        got = torch.zeros(mask.shape[1], dtype=torch.bool, device=fg.device)
        got[gt_idx[b][fg[b]]] = True
        for g in real.tolist():
            if got[g]:
                continue
            box = t["gt_xyxy"][b, g].float()
            x1, y1, x2, y2 = box.tolist()
            label = int(t["gt_cls"][b, g, 0])
            cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
            if min(x2, w_img) <= max(x1, 0) or min(y2, h_img) <= max(y1, 0):
                why = "outside"
            elif x2 <= x1 or y2 <= y1:
                why = "degenerate"
            else:
                half = reference.SMALL_GT_SIDE / 2
                ex1, ex2 = (cx - half, cx + half) if x2 - x1 < reference.SMALL_GT_SIDE else (x1, x2)
                ey1, ey2 = (cy - half, cy + half) if y2 - y1 < reference.SMALL_GT_SIDE else (y1, y2)
                inside = ((anc[:, 0] - ex1 > 1e-9) & (anc[:, 1] - ey1 > 1e-9) & (ex2 - anc[:, 0] > 1e-9)
                          & (ey2 - anc[:, 1] > 1e-9))
                if not inside.any():
                    why = "small"
                else:
                    c = min(max(label, 0), t["pd_scores"].shape[-1] - 1)  # as the assigner clamps it
                    score = t["pd_scores"][b, inside, c].float()
                    ov = reference.bbox_ciou(box.expand(int(inside.sum()), 4),
                                             t["pd_bboxes"][b, inside].float()).clamp(min=0)
                    align = score.pow(loss.alpha) * ov.pow(loss.beta)
                    why = "no_overlap" if not (align > 0).any() else "taken"
            counts[why] += 1
            rows.append({"image": b, "class": label, "box_px": [round(v, 1) for v in (x1, y1, x2, y2)],
                         "reason": _REASONS[why]})
    return rows, {k: v for k, v in counts.items() if v}


def trace_model(sec: Section, s, feats) -> dict:
    """Head maps, the user's loss and the standard one on the same maps, the assigner's positives.
    ``feats``: the step's outputs (the head maps, then L_dis when distilling)."""
    loss, bsz, maps = s.loss, feats[0].shape[0], s.maps(feats)
    out = {"head": _trace_head(sec, s.model, maps)}
    with torch.no_grad():
        try:
            total, items = loss(feats, s.batch)
        except Exception as e:  # the user's loss may refuse this batch: report it and go on
            sec.flag("loss-error", "FAIL", f"get_loss(model)(feats, batch) raised {type(e).__name__}: {e}",
                     "run the loss on this batch by hand; the trace above shows its inputs")
            return out
        items = torch.as_tensor(items).detach().float().reshape(-1).cpu()
        total = float(torch.as_tensor(total).detach().float().sum())
        t = standard_branches(s.standard, maps, s.batch)
    std = t["branches"].detach().float().cpu()
    names = branch_names(loss, items.numel())
    out.update(total=total, items=dict(zip(names, items.tolist())),
               standard=dict(zip(BRANCHES, std.tolist())))
    denom = float(items.sum())
    shares = [float(v) / denom if denom else float("nan") for v in items]
    sec.add(f"loss: total {fmt(total)} (= batch {bsz} x sum of items {fmt(denom)})")
    for k, name in enumerate(names):
        ratio = float(items[k] / std[k]) if k < 3 and float(std[k]) else float("nan")
        vs = f"  (standard YOLOv8 loss: {fmt(float(std[k]))}, ratio {ratio:.2f}x)" if k < 3 else ""
        sec.add(f"  {name:<5} {fmt(float(items[k])):>9}  share {shares[k]:6.1%}{vs}")
    out["shares"] = dict(zip(names, shares))

    if not torch.isfinite(items).all() or not torch.isfinite(torch.tensor(total)):
        sec.flag("loss-non-finite", "FAIL", f"the loss is non-finite on the first batch (total {fmt(total)}, "
                 f"items {[fmt(v) for v in items.tolist()]})", "see the images, targets and head maps above: "
                 "a NaN there, or a target box of zero size in a custom loss")
    elif abs(total - bsz * denom) > 1e-3 * abs(total) + 1e-6:
        sec.flag("loss-total-mismatch", "WARN", f"the total your loss backpropagates ({fmt(total)}) is not "
                 f"batch x the sum of its logged items ({fmt(bsz * denom)})", "return total = "
                 "items.sum() * batch_size, so the log shows what is optimised")
    out["ratio_to_standard"] = _check_ratios(sec, names, items, std)
    out["assigner"] = _trace_assigner(sec, t, s.standard, maps)
    return out


def _trace_head(sec: Section, model, maps) -> list:
    """Statistics of each head map; non-finite values are a FAIL."""
    head = []
    for i, f in enumerate(maps):
        st = stats(f)
        head.append(st)
        stride = int(model.stride[i]) if hasattr(model, "stride") else "?"
        sec.add(f"head P{i + 3}/{stride}: {stats_line(st)}")
        if st["nonfinite"]:
            sec.flag("head-non-finite", "FAIL", f"head map {i} (stride {stride}) holds {st['nonfinite']} "
                     f"NaN/inf values on the first batch", "check the images for NaN and the model's init "
                     "(a custom layer?); with amp=True try amp=False")
    return head


def _check_ratios(sec: Section, names, items, std) -> dict:
    """Each branch of the user's loss over the standard one on the same maps: 1.0 unless it differs on
    purpose; an integer factor is the mark of a target tensor duplicated along the batch."""
    ratios = {}
    for k, name in enumerate(names[:3]):
        if float(std[k]) > 1e-12 and torch.isfinite(items[k]):
            ratios[name] = float(items[k] / std[k])
    for name, r in ratios.items():
        if abs(r - 1) <= 0.02:
            continue
        integer = round(r) >= 2 and abs(r - round(r)) < 0.02 * r
        others = ", ".join(f"{n} {v:.2f}x" for n, v in ratios.items() if n != name)
        why = ": an integer factor, as a target tensor duplicated along the batch gives" if integer else ""
        sec.flag("loss-branch-scaled", "FAIL" if integer else "WARN",
                 f"the {name} branch is {r:.2f}x the standard YOLOv8 loss on the same maps and targets "
                 f"({others}){why}",
                 f"print the shapes of the targets inside your get_loss (each one row per image and GT); if "
                 f"the {name} loss is meant to differ, ignore this")
    return ratios


def _trace_assigner(sec: Section, t: dict, standard, maps) -> dict:
    """Positive anchors per image and level, and the GTs that got none (with the reason)."""
    fg = t["fg_mask"]
    sizes = [f.shape[2] * f.shape[3] for f in maps]
    per_level = [int(x.sum()) for x in fg.split(sizes, 1)]
    per_img = fg.sum(1).tolist()
    n_gt = int((t["gt_mask"] > 0).sum())
    rows, reasons = _unassigned(t, standard)
    sec.add(f"assigner: {int(fg.sum())} positive anchors for {n_gt} GTs; per image {per_img}; per level "
            + ", ".join(f"P{i + 3} {v}" for i, v in enumerate(per_level)))
    if rows:
        sec.add(f"  {len(rows)} GTs got no positive anchor: "
                + "; ".join(f"{v} {_REASONS[k]}" for k, v in reasons.items()))
        for r in rows[:5]:
            sec.add(f"    image {r['image']} class {r['class']} box {r['box_px']} px: {r['reason']}")
    if n_gt and not int(fg.sum()):
        sec.flag("no-positives", "FAIL", f"none of the {n_gt} GTs got a positive anchor: the box and DFL "
                 "losses are 0 and the class loss only pushes every score down", "check the label "
                 "coordinates (normalized cx cy w h) against the images; see the reasons above")
    elif n_gt and len(rows) > 0.2 * n_gt:
        top = max(reasons, key=reasons.get)
        sec.flag("gts-unassigned", "WARN", f"{len(rows)} of {n_gt} GTs got no positive anchor (mostly: "
                 f"{_REASONS[top]})", "outside/zero-size: fix those labels; too small: a larger imgsz")
    return {"positives_per_image": per_img, "positives_per_level": per_level, "gts": n_gt,
            "gts_without_positive": len(rows), "reasons": reasons, "unassigned": rows[:20]}
