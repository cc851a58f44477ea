"""tests/bench_moe.py's threshold recommendation, on the CPU, with the sweep the H200 measured."""
from bench_moe import recommend

# routed experts alone, each path forced (ms, GPU time), H200 2026-11-29; the GEMV paths stop early
MEASURED = [(1, 0.0427, 0.0557, 0.1781, 0.0837), (2, 0.0710, 0.0857, 0.1908, 0.1173),
            (4, 0.1110, 0.1317, 0.2840, 0.1688), (8, 0.1755, 0.2228, 0.3833, 0.2383),
            (16, 0.2888, 0.3760, 0.5133, 0.3307), (32, 0.4722, 0.6660, 0.6766, 0.3977),
            (64, 0.8621, 1.2162, 0.6817, 0.4029), (128, None, 2.3926, 0.6849, 0.4098),
            (256, None, 4.7378, 0.6887, 0.4171), (512, None, None, 0.6892, 0.4295),
            (4096, None, None, 3.3461, 1.0896)]


def sweep(rows):
    names = ("gemv_choice", "gemv", "mma", "grouped_mm")
    return [{"tokens": t, **{f"{n}_ms": v for n, v in zip(names, vs) if v is not None}} for t, *vs in rows]


def test_the_measured_sweep_recommends_the_per_choice_gemv_up_to_16_then_grouped_mm():
    s = sweep(MEASURED)
    assert recommend(s) == {"GEMV_MAX_TOKENS": 16, "GEMV_KERNEL": "per_choice", "GROUPED_MM_MIN_TOKENS": 1}
    assert [r["fastest"] for r in s][:6] == ["gemv_choice"] * 5 + ["grouped_mm"]


def test_grouped_gemv_wins_and_mma_keeps_a_middle_range():
    rows = [(1, 0.05, 0.04, 0.2, 0.1), (8, 0.2, 0.15, 0.3, 0.25), (64, 0.9, 0.8, 0.5, 0.6),
            (512, None, None, 0.7, 0.6), (4096, None, None, 3.0, 1.0)]
    assert recommend(sweep(rows)) == {"GEMV_MAX_TOKENS": 8, "GEMV_KERNEL": "grouped", "GROUPED_MM_MIN_TOKENS": 512}


def test_no_gemv_run_and_no_grouped_mm():
    rows = [(1, 0.2, 0.3, 0.1, None), (8, 0.3, 0.4, 0.2, None)]
    assert recommend(sweep(rows)) == {"GEMV_MAX_TOKENS": 0, "GEMV_KERNEL": "per_choice", "GROUPED_MM_MIN_TOKENS": None}
