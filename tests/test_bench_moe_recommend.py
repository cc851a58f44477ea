"""benchmarks/bench_moe.py's recommendation, on the CPU, with the sweeps the H200 measured."""
from bench_moe import NEVER, recommend

from dsv2_lib.ops.moe_experts import MoETuning

# routed experts alone, each path forced (ms, GPU time) on the H200, before the skinny GEMM; the GEMV paths stop early
MEASURED = [(1, 0.0427, 0.0557, 0.1781, 0.0837), (2, 0.0710, 0.0857, 0.1908, 0.1173),
            (4, 0.1110, 0.1317, 0.2840, 0.1688), (8, 0.1755, 0.2228, 0.3833, 0.2383),
            (16, 0.2888, 0.3760, 0.5133, 0.3307), (32, 0.4722, 0.6660, 0.6766, 0.3977),
            (64, 0.8621, 1.2162, 0.6817, 0.4029), (128, None, 2.3926, 0.6849, 0.4098),
            (256, None, 4.7378, 0.6887, 0.4171), (512, None, None, 0.6892, 0.4295),
            (4096, None, None, 3.3461, 1.0896)]


def sweep(rows, names=("gemv", "gemv_grouped", "mma", "grouped_mm")):
    return [{"tokens": t, **{f"{n}_ms": v for n, v in zip(names, vs) if v is not None}} for t, *vs in rows]


def test_the_measured_sweep_recommends_the_gemv_up_to_16_then_grouped_mm():
    s = sweep(MEASURED)
    assert recommend(s) == MoETuning(gemv_max_tokens=16, skinny_max_tokens=0, grouped_mm_min_tokens=1)
    assert [r["fastest"] for r in s][:6] == ["gemv"] * 5 + ["grouped_mm"]


def test_the_grouped_gemv_is_timed_but_never_recommended():
    """Chapter 08's grouped GEMV wins at 1, 8 and 64 tokens here; the engine cannot take it, so the
    recommendation is made among its own paths: the GEMV up to 8, mma at 64, grouped_mm from 512."""
    rows = [(1, 0.05, 0.04, 0.2, 0.1), (8, 0.2, 0.15, 0.3, 0.25), (64, 0.9, 0.8, 0.5, 0.6),
            (512, None, None, 0.7, 0.6), (4096, None, None, 3.0, 1.0)]
    s = sweep(rows)
    assert recommend(s) == MoETuning(gemv_max_tokens=8, skinny_max_tokens=0, grouped_mm_min_tokens=512)
    assert [r["fastest"] for r in s] == ["gemv", "gemv", "mma", "grouped_mm", "grouped_mm"]


def test_no_gemv_run_and_no_grouped_mm_keep_the_base():
    rows = [(1, 0.2, 0.3, 0.1, None), (8, 0.3, 0.4, 0.2, None)]
    base = MoETuning(grouped_mm_min_tokens=7)
    assert recommend(sweep(rows), base=base) == MoETuning(gemv_max_tokens=0, skinny_max_tokens=0, grouped_mm_min_tokens=7)


def test_grouped_mm_never_ahead_of_mma_is_never_taken():
    rows = [(1, 0.05, None, 0.2, 0.3), (512, None, None, 0.7, 0.8)]
    assert recommend(sweep(rows)).grouped_mm_min_tokens == NEVER


# the same with the skinny GEMM, on the H200
MEASURED_SKINNY = [(1, 0.038, 0.0491, 0.0673, 0.1747, 0.0792), (2, 0.0658, 0.0784, 0.0828, 0.1857, 0.1112),
                   (4, 0.1051, 0.123, 0.1103, 0.2766, 0.1574), (8, 0.1687, 0.2129, 0.1586, 0.3708, 0.2297),
                   (16, 0.2822, 0.3649, 0.2307, 0.4975, 0.3183), (32, 0.4644, 0.6565, 0.294, 0.6568, 0.3832),
                   (64, 0.8563, 1.2033, 0.2882, 0.6614, 0.3973), (128, None, 2.386, 0.3619, 0.6671, 0.3992),
                   (256, None, 4.7393, 0.5271, 0.6688, 0.4112), (512, None, None, None, 0.6698, 0.4165),
                   (1024, None, None, None, 1.1347, 0.4196), (4096, None, None, None, 3.3129, 1.0339)]
# the whole layer with the shared experts on a side stream or on the layer's stream (ms), on the H200
MEASURED_STREAMS = [(8, 0.211, 0.222), (16, 0.260, 0.265), (32, 0.347, 0.337), (64, 0.403, 0.334)]
NAMES = ("gemv", "gemv_grouped", "skinny", "mma", "grouped_mm")


def test_the_measured_sweeps_recommend_the_engine_tuning():
    streams = [{"tokens": t, "side_ms": a, "one_ms": b} for t, a, b in MEASURED_STREAMS]
    rec = recommend(sweep(MEASURED_SKINNY, NAMES), streams)
    assert rec == MoETuning(gemv_max_tokens=4, skinny_max_tokens=128, grouped_mm_min_tokens=1, shared_stream_max_tokens=16)
    assert rec == MoETuning()  # the engine is set as measured


def test_the_skinny_gemm_takes_the_run_after_the_gemv():
    """The GEMV wins at 1 and 8, the skinny GEMM at 16, 32 and 64, grouped_mm at 128: the skinny range
    ends at 64 (its win at 512 does not extend the run); grouped_mm beats mma at every larger size."""
    rows = [(1, 0.04, 0.05, 0.06, 0.2, 0.1), (8, 0.17, 0.2, 0.18, 0.4, 0.3), (16, 0.29, 0.37, 0.25, 0.5, 0.33),
            (32, 0.47, 0.66, 0.30, 0.67, 0.40), (64, 0.86, 1.2, 0.35, 0.68, 0.40), (128, None, None, 0.45, 0.69, 0.41),
            (512, None, None, 0.40, 0.70, 0.43)]
    assert recommend(sweep(rows, NAMES)) == MoETuning(gemv_max_tokens=8, skinny_max_tokens=64, grouped_mm_min_tokens=1)
