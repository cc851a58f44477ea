"""benchmarks/bench_moe.py's threshold recommendation, on the CPU, with the sweep the H200 measured."""
from bench_moe import recommend

# routed experts alone, each path forced (ms, GPU time), H200 2026-11-29; the GEMV paths stop early
MEASURED = [(1, 0.0427, 0.0557, 0.1781, 0.0837), (2, 0.0710, 0.0857, 0.1908, 0.1173),
            (4, 0.1110, 0.1317, 0.2840, 0.1688), (8, 0.1755, 0.2228, 0.3833, 0.2383),
            (16, 0.2888, 0.3760, 0.5133, 0.3307), (32, 0.4722, 0.6660, 0.6766, 0.3977),
            (64, 0.8621, 1.2162, 0.6817, 0.4029), (128, None, 2.3926, 0.6849, 0.4098),
            (256, None, 4.7378, 0.6887, 0.4171), (512, None, None, 0.6892, 0.4295),
            (4096, None, None, 3.3461, 1.0896)]


def sweep(rows, names=("gemv_choice", "gemv", "mma", "grouped_mm")):
    return [{"tokens": t, **{f"{n}_ms": v for n, v in zip(names, vs) if v is not None}} for t, *vs in rows]


def test_the_measured_sweep_recommends_the_per_choice_gemv_up_to_16_then_grouped_mm():
    s = sweep(MEASURED)
    assert recommend(s) == {"GEMV_MAX_TOKENS": 16, "GEMV_KERNEL": "per_choice", "SKINNY_MAX_TOKENS": 0,
                            "GROUPED_MM_MIN_TOKENS": 1}
    assert [r["fastest"] for r in s][:6] == ["gemv_choice"] * 5 + ["grouped_mm"]


def test_grouped_gemv_wins_and_mma_keeps_a_middle_range():
    rows = [(1, 0.05, 0.04, 0.2, 0.1), (8, 0.2, 0.15, 0.3, 0.25), (64, 0.9, 0.8, 0.5, 0.6),
            (512, None, None, 0.7, 0.6), (4096, None, None, 3.0, 1.0)]
    assert recommend(sweep(rows)) == {"GEMV_MAX_TOKENS": 8, "GEMV_KERNEL": "grouped", "SKINNY_MAX_TOKENS": 0,
                                      "GROUPED_MM_MIN_TOKENS": 512}


def test_no_gemv_run_and_no_grouped_mm():
    rows = [(1, 0.2, 0.3, 0.1, None), (8, 0.3, 0.4, 0.2, None)]
    assert recommend(sweep(rows)) == {"GEMV_MAX_TOKENS": 0, "GEMV_KERNEL": "per_choice", "SKINNY_MAX_TOKENS": 0,
                                      "GROUPED_MM_MIN_TOKENS": None}


# the same with the skinny GEMM, H200 2026-11-29 (seventh session)
MEASURED_SKINNY = [(1, 0.038, 0.0491, 0.0673, 0.1747, 0.0792), (2, 0.0658, 0.0784, 0.0828, 0.1857, 0.1112),
                   (4, 0.1051, 0.123, 0.1103, 0.2766, 0.1574), (8, 0.1687, 0.2129, 0.1586, 0.3708, 0.2297),
                   (16, 0.2822, 0.3649, 0.2307, 0.4975, 0.3183), (32, 0.4644, 0.6565, 0.294, 0.6568, 0.3832),
                   (64, 0.8563, 1.2033, 0.2882, 0.6614, 0.3973), (128, None, 2.386, 0.3619, 0.6671, 0.3992),
                   (256, None, 4.7393, 0.5271, 0.6688, 0.4112), (512, None, None, None, 0.6698, 0.4165),
                   (1024, None, None, None, 1.1347, 0.4196), (4096, None, None, None, 3.3129, 1.0339)]


def test_the_measured_sweep_with_the_skinny_gemm_recommends_the_engine_thresholds():
    import dsv2_lib.model.moe as moe

    rec = recommend(sweep(MEASURED_SKINNY, ("gemv_choice", "gemv", "skinny", "mma", "grouped_mm")))
    assert rec == {"GEMV_MAX_TOKENS": 4, "GEMV_KERNEL": "per_choice", "SKINNY_MAX_TOKENS": 128, "GROUPED_MM_MIN_TOKENS": 1}
    assert rec == {k: getattr(moe, k) for k in rec}  # the engine is set as measured


def test_the_skinny_gemm_takes_the_run_after_the_gemv():
    """The GEMV wins at 1 and 8, the skinny GEMM at 16, 32 and 64, grouped_mm at 128: the skinny range
    ends at 64 (its win at 512 does not extend the run); grouped_mm beats mma at every larger size."""
    names = ("gemv_choice", "gemv", "skinny", "mma", "grouped_mm")
    rows = [(1, 0.04, 0.05, 0.06, 0.2, 0.1), (8, 0.17, 0.2, 0.18, 0.4, 0.3), (16, 0.29, 0.37, 0.25, 0.5, 0.33),
            (32, 0.47, 0.66, 0.30, 0.67, 0.40), (64, 0.86, 1.2, 0.35, 0.68, 0.40), (128, None, None, 0.45, 0.69, 0.41),
            (512, None, None, 0.40, 0.70, 0.43)]
    assert recommend(sweep(rows, names)) == {"GEMV_MAX_TOKENS": 8, "GEMV_KERNEL": "per_choice", "SKINNY_MAX_TOKENS": 64,
                                             "GROUPED_MM_MIN_TOKENS": 1}
