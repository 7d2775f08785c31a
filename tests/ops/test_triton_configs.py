"""Which Triton configs the autotuner keeps, read from the compile-check measurements without
compiling: the decode output pass, the unpipelined row tile, pruning of measured spills per dtype
and per arch, the problems a build reports, the cost model's arithmetic."""

import pytest


def test_decode_full_tile_output_pass_keeps_only_the_8_warp_config():
    # the output pass (PASS=2) of a full decode tile (64 rows x head dim 128) spilled on 4 warps
    # and in 64-key blocks; smaller tiles and the LSSAR score pass keep the 4-warp configs
    from lssar.ops.triton import decode as DEC
    from lssar.ops.triton.devtools.compile_check import _config_label

    def kept(bm, bd, step):
        kw = dict(BM=bm, BD=bd, BDV=bd, PASS=step)
        return {_config_label(c, kw) for c in DEC._prune(DEC.decode_tuned.configs, {}, **kw)}

    assert kept(64, 128, 2) == {"64x32 w8 s2"} and kept(32, 256, 2) == {"32x32 w8 s2"}
    assert kept(64, 128, 1) == {"64x64 w4 s2", "64x64 w4 s3", "64x32 w4 s3"}
    assert kept(16, 128, 2) == {"16x64 w4 s2", "16x64 w4 s3", "16x32 w4 s3"}
    assert "16x128 w4 s2" in kept(16, 64, 2)


def test_unpipelined_row_tile_is_only_a_fallback():
    import torch

    from lssar.ops.triton import autotune as A

    def kept(kind, bd, ieee, spans, tf32=False):
        prune = A._pruner(kind)
        args = {
            "tq_key": 1024,
            "Q": torch.zeros(1, dtype=torch.float32 if tf32 else torch.bfloat16),
        }
        cfgs = prune(A._ROW_CONFIGS, args, BD=bd, BDV=bd, IEEE=ieee, HAS_SPANS=spans)
        return [(c.kwargs["BM"], c.kwargs["BN"], c.num_warps, c.num_stages) for c in cfgs]

    # TF32 forward at head dim 256: every pipelined tile spilled somewhere, so the unpipelined one
    assert kept("fwd", 256, False, False, tf32=True) == [(16, 16, 4, 1)]
    for kind in ("fwd", "dq"):
        for bd in (64, 128, 256):
            for spans in (False, True):
                assert all(c[3] > 1 for c in kept(kind, bd, True, spans)), (kind, bd, spans)
                assert all(c[3] > 1 for c in kept(kind, bd, False, spans)), (kind, bd, spans)


def test_problems_flags_errors_and_shared_memory():
    from lssar.ops.triton.devtools.compile_check import problems

    base = {"case": "c", "kernel": "dq", "config": "128x128 w8 s2", "arch": 80, "kept": True}
    ok = {
        **base,
        "ok": True,
        "shared": 1000,
        "shared_limit": 2000,
        "spill_store": 0,
        "spill_load": 0,
    }
    assert problems([ok]) == []
    assert "shared memory" in problems([{**ok, "shared": 3000}])[0]
    assert problems([{**ok, "shared": 3000, "kept": False}]) == []  # the autotuner never runs it
    assert "does not compile" in problems([{**base, "ok": False, "error": "x"}])[0]


@pytest.mark.parametrize("precision", ["half", "ieee", "tf32"])
@pytest.mark.parametrize("bd", [16, 32, 64, 128, 256])
def test_pruning_keeps_a_config_and_drops_measured_spills(bd, precision):
    import torch

    from lssar.ops.triton import autotune as A

    ieee, tf32 = precision == "ieee", precision == "tf32"
    q = torch.zeros(1, dtype=torch.bfloat16 if precision == "half" else torch.float32)
    lists = {"fwd": A._ROW_CONFIGS, "dq": A._ROW_CONFIGS}
    lists["dkdv"] = A._COL_CONFIGS
    launches = [(1, False, False), (1024, False, False), (1024, True, False), (1024, False, True)]
    launches.append((1024, True, True))
    for kind, configs in lists.items():
        for tq, spans, mask in launches:
            where = ({A.SPANS} if spans else set()) | ({A.MASK} if mask else set()) or {A.PLAIN}
            prune = A._pruner(kind)
            args = {"tq_key": tq, "Q": q}
            kept = prune(configs, args, BD=bd, BDV=bd, IEEE=ieee, HAS_SPANS=spans, HAS_MASK=mask)
            assert kept, (kind, bd, precision)
            assert A.precision(args, {"IEEE": ieee}) == (ieee, tf32)
            for c in kept:
                tile = (c.kwargs["BM"], c.kwargs["BN"], c.num_warps, c.num_stages)
                spilled = A.MEASURED_SPILLS.get((kind, bd, precision, *tile), frozenset())
                assert where.isdisjoint(spilled), (kind, bd, precision, tile, where)
                if tf32:
                    assert A.MEASURED_SPILLS.get((kind, bd, "half", *tile)) != A.ANYWHERE
                # TF32 at head dim 256: dq and dk/dv keep one tile over the budget (the
                # fallback, measured not to spill)
                if not (tf32 and bd == 256 and kind in ("dq", "dkdv")):
                    assert A.fits(kind, c, bd, bd, ieee, spans, tf32, mask), (kind, tile)
                if kind != "dkdv" and tq == 1:
                    assert c.kwargs["BM"] == 16  # decoding: no taller row tiles to tune
                if kind != "dkdv" and not ieee:  # 16x16 with 8 warps: for FMA dots only
                    assert c.kwargs["BM"] * c.kwargs["BN"] >= 64 * c.num_warps


def test_measured_spills_apply_where_they_were_measured():
    import triton

    from lssar.ops.triton import autotune as A

    w4 = triton.Config({"BM": 16, "BN": 16}, num_warps=4, num_stages=2)
    w8 = triton.Config({"BM": 16, "BN": 16}, num_warps=8, num_stages=2)
    # fp32 IEEE dq at head dim 256: 16x16 w4 spilled without spans, w8 only with them
    assert not A.fits("dq", w4, 256, 256, True)
    assert not A.fits("dq", w4, 256, 256, True, mask=True)
    assert A.fits("dq", w4, 256, 256, True, spans=True)
    assert A.fits("dq", w8, 256, 256, True)
    assert not A.fits("dq", w8, 256, 256, True, spans=True)
    assert not A.fits("dq", w8, 256, 256, True, spans=True, mask=True)  # both: either list
    # a half-precision tile that spilled everywhere binds TF32 launches too; one that spilled
    # only with spans does not (TF32 with spans was measured on its own)
    assert A.MEASURED_SPILLS[("fwd", 128, "half", 64, 64, 8, 2)] == A.ANYWHERE
    big = triton.Config({"BM": 64, "BN": 64}, num_warps=8, num_stages=2)
    assert A._measured("fwd", big, 128, 128, False, False, True)
    assert A.MEASURED_SPILLS[("dkdv", 128, "half", 16, 16, 8, 1)] == {A.SPANS}
    col = triton.Config({"BM": 16, "BN": 16}, num_warps=8, num_stages=1)
    assert A._measured("dkdv", col, 128, 128, False, True, False)  # half, spans
    assert not A._measured("dkdv", col, 128, 128, False, False, False)  # half, no spans
    assert not A._measured("dkdv", col, 128, 128, False, True, True)  # tf32, spans


def test_pruning_is_per_arch():
    """A tile that spilled on one arch only is pruned there and kept on the other (the LSSAR
    forward at head dim 64, bf16, 64x64 w8 s2: sm_80 only); the two-warpgroup row
    tiles are kept on sm_90 only, where measured (MEASURED_WGMMA_ROWS), and never for a launch
    unlike the measured ones."""
    import torch
    import triton

    from lssar.ops.triton import autotune as A

    tile = triton.Config({"BM": 64, "BN": 64}, num_warps=8, num_stages=2)
    assert A.SPILL_ARCHS[("fwd", 64, "half", 64, 64, 8, 2)] == {80}
    assert not A.fits("fwd", tile, 64, 64, False, mask=True, arch=80)
    assert A.fits("fwd", tile, 64, 64, False, mask=True, arch=90)
    assert not A.fits("fwd", tile, 64, 64, False, mask=True)  # arch unknown: pruned
    assert not A.fits("fwd", tile, 64, 64, False, arch=80)  # (and without a mask: 8 B)
    assert A.fits("fwd", tile, 64, 64, False, arch=90)
    kind, bm, bn, w, st = "fwd", 128, 64, 8, 2
    (bd, reweight, split, fold) = (128, True, False, False)  # LSSAR inference, precise=False
    assert (bd, reweight, split, fold) in A.MEASURED_WGMMA_ROWS[(kind, bm, bn, w, st)]
    big = triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=st)
    flags = dict(reweight=reweight, split=split, fold=fold)
    assert A.fits(kind, big, bd, bd, False, arch=90, **flags)
    assert not A.fits(kind, big, bd, bd, False, arch=80, **flags)
    assert not A.fits(kind, big, bd, bd, False, mask=True, arch=90, **flags)
    assert not A.fits(kind, big, bd, bd, True, arch=90, **flags)  # fp32 (IEEE)
    assert not A.fits(kind, big, bd, bd, False, arch=90, reweight=True, split=False, fold=True)
    # the autotuner's pruning asks the device (compile_check sets it per target arch)
    prune = A._pruner(kind)
    args = {"tq_key": 1024, "Q": torch.zeros(1, dtype=torch.bfloat16)}
    kw = dict(BD=bd, BDV=bd, IEEE=False, REWEIGHT=reweight, SPLIT=split, FOLD_F=fold)
    for arch, expect in ((80, False), (90, True)):
        A_arch = A.device_arch
        try:
            A.device_arch = lambda arch=arch: arch
            kept = prune(A._ROW_CONFIGS, args, **kw)
            tiles = {(c.kwargs["BM"], c.kwargs["BN"], c.num_warps, c.num_stages) for c in kept}
            assert ((bm, bn, w, st) in tiles) == expect, arch
        finally:
            A.device_arch = A_arch


def test_cost_model_arithmetic():
    """The static model on fixed inputs (lssar.ops.triton.cost): MMA shapes to FLOP, the tiles a
    causal problem visits, a kernel's clocks from its per-loop counts, the calibration."""
    from lssar.ops.triton.devtools import cost as C
    from lssar.ops.triton.devtools.sass import mma_flop

    assert mma_flop("HGMMA.64x128x16.F32.BF16") == 2 * 64 * 128 * 16 / 4  # per warp
    assert mma_flop("HMMA.16816.F32.BF16") == 2 * 16 * 8 * 16
    assert mma_flop("FFMA") == 0
    with pytest.raises(ValueError, match="unknown HMMA"):
        mma_flop("HMMA.999.F32")
    # T = 256 in 64x64 tiles: 4 + 3 + 2 + 1 = 10 tiles, the 4 on the diagonal masked
    assert C.tile_counts("fwd", 256, 64, 64) == (6, 4)
    assert C.tile_counts("dkdv", 256, 64, 64) == (6, 4)
    assert C.tile_counts("fwd", 256, 128, 64) == (2, 4)  # two diagonal key blocks per row block

    def loop(total, mufu, flop):
        return {"total": total, "ex2": mufu, "lg2": 0, "rcp": 0, "mufu": mufu, "atomic": 0,
                "local": 0, "flop": flop}  # fmt: skip

    # one pass split in two loops: clean (10 instr, 1 MUFU, 1024 FLOP per warp and tile) and
    # masked (14 instr); 64x64 tiles, 4 warps; T = 256: 6 clean tiles, 4 masked
    row = {"case": "c", "kernel": "fwd", "variant": "lssa", "config": "64x64 w4 s2",
           "loop": {"each": [loop(10, 1, 1024), loop(14, 1, 1024)]}}  # fmt: skip
    k = C.kernel_cost(row, 256)
    visible = 256 * 257 / 2
    thread = (6 * 10 + 4 * 14) * 32 * 4
    assert k.issue == pytest.approx(thread / 128 / visible)
    assert k.mufu == pytest.approx(10 * 32 * 4 / 16 / visible)
    assert k.tensor == pytest.approx(10 * 1024 * 4 / 4096 / visible)
    assert k.clocks == pytest.approx(k.tensor + max(k.issue, k.mufu))
    assert k.unsplit == pytest.approx(k.tensor + 10 * 14 * 32 * 4 / 128 / visible)
    assert k.per_element["total"] == pytest.approx(thread / (10 * 64 * 64))
    with pytest.raises(RuntimeError, match="innermost loops"):
        C.kernel_cost({**row, "loop": {"each": [loop(1, 0, 0)] * 3}}, 256)
    assert C.fa2_factor(128, "fwd") == pytest.approx(0.7 * 616 / 335)
