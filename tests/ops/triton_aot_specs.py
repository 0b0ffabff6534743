"""The ahead-of-time compile test's signatures: (kernel, signature, constexprs, options) of every Triton
kernel variant the launch sites use, one function per kernel module (``yolofast.kernels.<op>``, passed as
``mod``). test_triton_aot.py compiles each for sm_90 and fails when a module defines a ``*_kernel`` that has
no entry here: a new kernel gets its signature here, next to the test that uses it.
"""


def bbox_loss(mod) -> list[tuple]:
    """(kernel, signature, constexprs, options) of the GPU variants the ahead-of-time compile test builds:
    float32 with libdevice (what a GPU runs) and the float64 reduction (~8 s of compiling on 2 cores)."""
    sig = {
        "pd_ptr": "*fp32",
        "ps_ptr": "*fp32",
        "anc_ptr": "*fp32",
        "tb_ptr": "*fp32",
        "ts_ptr": "*fp32",
        "fg_ptr": "*i1",
        "gd_box_ptr": "*fp32",
        "gd_dfl_ptr": "*fp32",
        "gs_ptr": "*fp32",
        "part_ptr": "*fp64",
        "n_rows": "i32",
        "A": "i32",
        "C": "i32",
        "R": "constexpr",
        "F64": "constexpr",
        "USE_LIB": "constexpr",
        "BLOCK_A": "constexpr",
        "BLOCK_C": "constexpr",
    }
    main = {"R": 16, "F64": False, "USE_LIB": True, "BLOCK_A": 32, "BLOCK_C": 128}
    red_sig = {
        "part_ptr": "*fp64",
        "out_ptr": "*fp32",
        "inv_s_ptr": "*fp32",
        "n_part": "i32",
        "BLOCK": "constexpr",
    }
    reduce = (mod._bbox_loss_reduce_kernel, red_sig, {"BLOCK": mod.BLOCK_R}, {})
    # reg_max 1 (YOLO26): raw distances, each anchor's stride (st_ptr), the image's H and W (fp32 scalars)
    l1_sig = {k: v for k, v in sig.items() if k not in ("gd_dfl_ptr", "R")}
    l1_sig.update(st_ptr="*fp32", gd_l1_ptr="*fp32", img_h="fp32", img_w="fp32")
    l1 = {k: v for k, v in main.items() if k != "R"}
    return [(mod._bbox_loss_kernel, sig, main, {}), (mod._bbox_loss_l1_kernel, l1_sig, l1, {}), reduce]


def ema_update(mod) -> list[tuple]:
    """(kernel, signature, constexprs, options) of each variant, for the ahead-of-time compile test."""
    specs = []
    for ty in ("fp32", "bf16", "fp64"):
        sig = {
            "ema_ptr": f"*{ty}",
            "model_ptr": f"*{ty}",
            "decay_ptr": "*fp64",
            "n": "i64",
            "F64": "constexpr",
            "BLOCK": "constexpr",
        }
        specs.append((mod._ema_update_kernel, sig, {"F64": ty == "fp64", "BLOCK": mod.BLOCK}, {}))
    return specs


def tal_assign(mod) -> list[tuple]:
    """(kernel, signature, constexprs, options) for the ahead-of-time compile test: every kernel in float32,
    and the metric kernels in float64 (both scan passes) with bf16 scores (a bf16 store when writing)."""
    specs = []
    for ct, sc in (("fp32", "fp32"), ("fp64", "bf16")):
        f64 = ct == "fp64"
        grid_sig = {
            "anc_ptr": f"*{ct}",
            "lvi_ptr": "*i32",
            "nlv_ptr": "*i32",
            "A": "i32",
            "L_MAX": "constexpr",
            "BLOCK": "constexpr",
        }
        if not f64:  # the grid kernels only load anchors: their float64 variant lowers alike
            grid_ce = {"L_MAX": mod.L_MAX, "BLOCK": mod.BLOCK_GRID}
            specs.append((mod._grid_starts_kernel, grid_sig, grid_ce, {}))
        lv_sig = {
            "anc_ptr": f"*{ct}",
            "lvi_ptr": "*i32",
            "lvf_ptr": f"*{ct}",
            "nlv_ptr": "*i32",
            "bad_ptr": "*i32",
            "A": "i32",
            "L_MAX": "constexpr",
            "BLOCK": "constexpr",
        }
        if not f64:
            specs.append((mod._grid_levels_kernel, lv_sig, {"L_MAX": mod.L_MAX, "BLOCK": mod.BLOCK_GRID}, {}))
        metric = {"ALPHA": 0.5, "AK": 2, "BETA": 6, "BK": 5, "F64": f64, "USE_LIB": True}
        exact = dict(mod._common.EXACT)
        scan_sig = {
            "scores_ptr": f"*{sc}",
            "pd_ptr": f"*{sc}",
            "anc_ptr": f"*{ct}",
            "gt_ptr": f"*{ct}",
            "labc_ptr": "*i32",
            "real_ptr": "*i32",
            "lvi_ptr": "*i32",
            "lvf_ptr": f"*{ct}",
            "nlv_ptr": "*i32",
            "bad_ptr": "*i32",
            "cnt_ptr": "*i32",
            "owner_ptr": "*i32",
            "best_ptr": "*i64",
            "bestg_ptr": "*i32",
            "sel_al_ptr": f"*{ct}",
            "sel_ov_ptr": f"*{ct}",
            "A": "i32",
            "C": "i32",
            "M": "i32",
            "K": "i32",
        }
        scan_ce = dict(EPS=1e-9, PASS=1, L_MAX=mod.L_MAX, KP=16, BLOCK=128, **metric)
        scan_sig.update({k: "constexpr" for k in scan_ce})
        for p in (1, 2) if f64 else (1,):
            specs.append((mod._tal_scan_kernel, scan_sig, {**scan_ce, "PASS": p}, exact))
        res_sig = {
            "scores_ptr": f"*{sc}",
            "labc_ptr": "*i32",
            "cnt_ptr": "*i32",
            "owner_ptr": "*i32",
            "best_ptr": "*i64",
            "bestg_ptr": "*i32",
            "sel_al_ptr": f"*{ct}",
            "sel_ov_ptr": f"*{ct}",
            "fg_ptr": "*i1",
            "tgi_ptr": "*i64",
            "pal_ptr": "*i64",
            "pov_ptr": "*i64",
            "A": "i32",
            "C": "i32",
            "M": "i32",
        }
        res_ce = dict(BLOCK=128, DEFER=False, **metric)
        res_sig.update({k: "constexpr" for k in res_ce})
        for defer in (False, True):  # DEFER: a second top-k follows and takes the per-GT maxima itself
            specs.append((mod._tal_resolve_kernel, res_sig, {**res_ce, "DEFER": defer}, exact))
        wr_sig = {
            "fg_ptr": "*i1",
            "tgi_ptr": "*i64",
            "sel_al_ptr": f"*{ct}",
            "sel_ov_ptr": f"*{ct}",
            "pal_ptr": "*i64",
            "pov_ptr": "*i64",
            "labels_ptr": "*i64",
            "gt_raw_ptr": f"*{ct}",
            "tlab_ptr": "*i64",
            "tbox_ptr": f"*{ct}",
            "tsc_ptr": f"*{sc}",
            "A": "i32",
            "C": "i32",
            "M": "i32",
        }
        wr_ce = {"EPS": 1e-9, "F64": f64, "BLOCK": 128, "BLOCK_C": 32}
        wr_sig.update({k: "constexpr" for k in wr_ce})
        specs.append((mod._tal_write_kernel, wr_sig, wr_ce, exact))
        # YOLO26's topk2 (only when topk2 differs from topk): k2 rounds of two steps, then the keep pass
        t2_base = {"fg_ptr": "*i1", "tgi_ptr": "*i64", "sel_al_ptr": f"*{ct}"}
        round_sig = {**t2_base, "t2al_ptr": "*i64", "t2a_ptr": "*i32", "A": "i32", "M": "i32", "BM": "i32",
                     "r": "i32", "STEP": "constexpr", "F64": "constexpr", "BLOCK": "constexpr"}
        for step in (0, 1):
            ce = {"STEP": step, "F64": f64, "BLOCK": mod.BLOCK_A}
            specs.append((mod._tal_topk2_round_kernel, round_sig, ce, exact))
        keep_sig = {**t2_base, "sel_ov_ptr": f"*{ct}", "t2a_ptr": "*i32", "pal_ptr": "*i64",
                    "pov_ptr": "*i64", "A": "i32", "M": "i32", "BM": "i32", "K2": "i32", "F64": "constexpr",
                    "BLOCK": "constexpr"}
        specs.append((mod._tal_topk2_keep_kernel, keep_sig, {"F64": f64, "BLOCK": mod.BLOCK_A}, exact))
    return specs


def ns_orthogonalize(mod) -> list[tuple]:
    """(kernel, signature, constexprs, options): the batched product in bf16 with and without the C term
    (X Xᵀ; the two affine steps) at the GPU's largest tiles and at the smallest (16: a 1 x k matrix), and the
    float32 mode (IEEE dot, no TF32)."""
    specs = []
    for ty, has_c, block in (("bf16", False, 64), ("bf16", True, 64), ("bf16", True, 16), ("fp32", True, 64)):
        sig = {"a_ptr": f"*{ty}", "b_ptr": f"*{ty}", "c_ptr": f"*{ty}", "out_ptr": f"*{ty}",
               "M": "i32", "N": "i32", "K": "i32"}
        strides = ("sab", "sam", "sak", "sbb", "sbk", "sbn", "scb", "scm", "scn", "sob", "som", "son")
        sig |= {s: "i32" for s in strides}
        sig |= {"alpha": "fp32", "beta": "fp32", "HAS_C": "constexpr", "IEEE": "constexpr",
                "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
        ce = {"HAS_C": has_c, "IEEE": ty == "fp32", "BLOCK_M": block, "BLOCK_N": block,
              "BLOCK_K": min(block, mod.MAX_BLOCK_K)}
        specs.append((mod._ns_bmm_kernel, sig, ce, {}))
    return specs
