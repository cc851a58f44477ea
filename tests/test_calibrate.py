"""``python -m dsv2_lib calibrate`` on the CPU: the rules that turn timings into thresholds (the MoE rule
with the sweeps the H200 measured), the tuning file and its errors, and the command line's use of it."""
import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from dsv2_lib import LLM
from dsv2_lib.model.tuning import Tuning
from dsv2_lib.ops.attention import AttentionTuning
from dsv2_lib.ops.mla_decode import DecodeTuning
from dsv2_lib.ops.moe_experts import MoETuning
from dsv2_lib.tools import benchmark
from dsv2_lib.tools.calibrate import NEVER, choose, load_tuning, recommend_moe, save_tuning, sdpa_from, tuning_from_dict

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
    assert recommend_moe(s) == MoETuning(gemv_max_tokens=16, skinny_max_tokens=0, grouped_mm_min_tokens=1)
    assert [r["fastest"] for r in s][:6] == ["gemv"] * 5 + ["grouped_mm"]


def test_the_grouped_gemv_is_timed_but_never_recommended():
    """Chapter 08's grouped GEMV wins at 1, 8 and 64 tokens here; the engine cannot take it, so the
    recommendation is made among its own paths: the GEMV up to 8, mma at 64, grouped_mm from 512."""
    rows = [(1, 0.05, 0.04, 0.2, 0.1), (8, 0.2, 0.15, 0.3, 0.25), (64, 0.9, 0.8, 0.5, 0.6),
            (512, None, None, 0.7, 0.6), (4096, None, None, 3.0, 1.0)]
    s = sweep(rows)
    assert recommend_moe(s) == MoETuning(gemv_max_tokens=8, skinny_max_tokens=0, grouped_mm_min_tokens=512)
    assert [r["fastest"] for r in s] == ["gemv", "gemv", "mma", "grouped_mm", "grouped_mm"]


def test_no_gemv_run_and_no_grouped_mm_keep_the_base():
    rows = [(1, 0.2, 0.3, 0.1, None), (8, 0.3, 0.4, 0.2, None)]
    base = MoETuning(grouped_mm_min_tokens=7)
    assert recommend_moe(sweep(rows), base=base) == MoETuning(gemv_max_tokens=0, skinny_max_tokens=0, grouped_mm_min_tokens=7)


def test_grouped_mm_never_ahead_of_mma_is_never_taken():
    rows = [(1, 0.05, None, 0.2, 0.3), (512, None, None, 0.7, 0.8)]
    assert recommend_moe(sweep(rows)).grouped_mm_min_tokens == NEVER


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
    rec = recommend_moe(sweep(MEASURED_SKINNY, NAMES), streams)
    assert rec == MoETuning(gemv_max_tokens=4, skinny_max_tokens=128, grouped_mm_min_tokens=1, shared_stream_max_tokens=16)
    assert rec == MoETuning()  # the engine is set as measured


def test_the_skinny_gemm_takes_the_run_after_the_gemv():
    """The GEMV wins at 1 and 8, the skinny GEMM at 16, 32 and 64, grouped_mm at 128: the skinny range
    ends at 64 (its win at 512 does not extend the run); grouped_mm beats mma at every larger size."""
    rows = [(1, 0.04, 0.05, 0.06, 0.2, 0.1), (8, 0.17, 0.2, 0.18, 0.4, 0.3), (16, 0.29, 0.37, 0.25, 0.5, 0.33),
            (32, 0.47, 0.66, 0.30, 0.67, 0.40), (64, 0.86, 1.2, 0.35, 0.68, 0.40), (128, None, None, 0.45, 0.69, 0.41),
            (512, None, None, 0.40, 0.70, 0.43)]
    assert recommend_moe(sweep(rows, NAMES)) == MoETuning(gemv_max_tokens=8, skinny_max_tokens=64, grouped_mm_min_tokens=1)


def test_the_one_launch_router_takes_its_leading_run_of_wins():
    """It wins at 8, 16 and 32 tokens, loses at 64, wins again at 128: the threshold is 32 (a later win does
    not extend the run); with no router rows the base's threshold stays."""
    rows = [{"tokens": t, "few_ms": f, "gemm_ms": g}
            for t, f, g in [(8, 0.003, 0.009), (16, 0.004, 0.009), (32, 0.006, 0.010), (64, 0.012, 0.011),
                            (128, 0.010, 0.012)]]
    assert recommend_moe(sweep(MEASURED_SKINNY, NAMES), router=rows).router_few_max_tokens == 32
    assert recommend_moe(sweep(MEASURED_SKINNY, NAMES), router=rows[3:4]).router_few_max_tokens == 0
    base = MoETuning(router_few_max_tokens=17)
    assert recommend_moe(sweep(MEASURED_SKINNY, NAMES), base=base).router_few_max_tokens == 17


# ---- the attention and GEMV rules, and choose ------------------------------------------------------------

def attention_rows(pairs):
    return [{"tokens": n, "kernel_ms": k, "sdpa_ms": s} for n, k, s in pairs]


def test_sdpa_from_the_first_length_where_it_wins_for_good():
    assert sdpa_from(attention_rows([(256, 1, 2), (512, 2, 3), (1024, 4, 3), (2048, 8, 6)])) == 1024
    assert sdpa_from(attention_rows([(256, 1, 0.5), (512, 2, 3), (1024, 4, 3)])) == 1024  # an early win alone does not count
    assert sdpa_from(attention_rows([(256, 1, 0.5), (512, 2, 1)])) == 256
    assert sdpa_from(attention_rows([(256, 1, 2), (512, 2, 3)])) == NEVER


def test_choose_sets_what_was_measured_and_keeps_the_rest():
    moe = [{"tokens": 1, "gemv_ms": 0.04, "skinny_ms": 0.06, "mma_ms": 0.2, "grouped_mm_ms": 0.1},
           {"tokens": 64, "gemv_ms": 0.9, "skinny_ms": 0.3, "mma_ms": 0.7, "grouped_mm_ms": 0.4},
           {"tokens": 512, "mma_ms": 0.7, "grouped_mm_ms": 0.4}]
    gemv = [{"tokens": t, "projections": [{"name": "q", "gemv_ms": g, "cublas_ms": 1.0},
                                          {"name": "o", "gemv_ms": 0.5, "cublas_ms": 1.0}]}
            for t, g in ((1, 0.5), (2, 0.9), (3, 1.1), (4, 0.8))]  # the kernel loses on q at 3: the run ends at 2
    base = Tuning(decode=DecodeTuning(stages=3), q_stream_max_tokens=7)
    got = choose(moe, attention_rows([(256, 1, 2), (1024, 4, 3)]), gemv, base)
    assert got.moe == MoETuning(gemv_max_tokens=1, skinny_max_tokens=64, grouped_mm_min_tokens=1)
    assert (got.attention.sdpa_min_tokens, got.attention.sdpa_min_max_len) == (1024, 1024)
    assert got.attention.kernel_variant == base.attention.kernel_variant and got.gemv_max_tokens == 2
    assert got.decode == base.decode and got.q_stream_max_tokens == 7
    assert got.skinny_max_tokens == base.skinny_max_tokens  # not measured: kept


def test_the_skinny_gemm_takes_the_counts_past_the_gemv_while_it_wins_everywhere():
    def rows(*wins):  # tokens -> does the skinny GEMM win on both projections
        return [{"tokens": t, "projections": [{"name": "q", "skinny_ms": 1.0 if w else 2.0, "cublas_ms": 1.5},
                                              {"name": "o", "skinny_ms": 1.0, "cublas_ms": 1.5}]} for t, w in wins]
    gemv = [{"tokens": t, "projections": [{"name": "q", "gemv_ms": 0.5, "cublas_ms": 1.0}]} for t in (1, 2, 3, 4)]
    attention = attention_rows([(256, 1, 2)])

    def skinny_max(*wins):
        return choose([], attention, gemv, skinny_rows=rows(*wins)).skinny_max_tokens

    assert skinny_max((3, False), (4, False), (8, True), (16, True), (32, False), (64, True)) == 16  # from 5 on
    assert skinny_max((3, True), (4, True), (8, False)) == 0  # loses at the first count past the GEMV: never
    assert skinny_max((3, True), (8, True), (16, True)) == 16


# ---- the tuning file ------------------------------------------------------------------------------------

def test_a_tuning_file_round_trips_and_may_leave_fields_out(tmp_path):
    t = Tuning(moe=MoETuning(gemv_max_tokens=3), attention=AttentionTuning(sdpa_min_tokens=NEVER),
               decode=DecodeTuning(workers=64), gemv_max_tokens=1)
    path = save_tuning(t, tmp_path / "t.json", {"moe": []})
    assert load_tuning(path) == t and json.loads(path.read_text())["measured"] == {"moe": []}
    assert tuning_from_dict({"moe": {"skinny_max_tokens": 9}}) == Tuning(moe=MoETuning(skinny_max_tokens=9))


@pytest.mark.parametrize("tuning, message", [
    ({"moe": {"gemv_max": 3}}, "tuning.moe: unknown field 'gemv_max'"),
    ({"speed": 1}, "tuning: unknown field 'speed'"),
    ({"gemv_max_tokens": True}, "tuning.gemv_max_tokens: expected int, got True"),
    ({"moe": {"skinny_max_tokens": "128"}}, "tuning.moe.skinny_max_tokens: expected int, got '128'"),
    ({"decode": {"workers": 1.5}}, "tuning.decode.workers: expected int or null, got 1.5"),
    ({"attention": {"kernel_variant": "mma_w99"}}, "'mma_w99' is not one of the engine's variants"),
    ({"decode": []}, "tuning.decode: expected an object of DecodeTuning's fields, got list"),
])
def test_a_bad_tuning_is_refused_naming_the_field(tmp_path, tuning, message):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"tuning": tuning}))
    with pytest.raises(ValueError) as e:
        load_tuning(path)
    assert message in str(e.value) and str(path) in str(e.value), str(e.value)


@pytest.mark.parametrize("text, message", [("{not json", "not a JSON tuning file"),
                                            ('{"moe": {}}', "no 'tuning' object"), ("[1]", "no 'tuning' object")])
def test_a_file_that_is_not_a_tuning_file_is_refused(tmp_path, text, message):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_tuning(path)
    with pytest.raises(ValueError, match="cannot read the tuning file"):
        load_tuning(tmp_path / "missing.json")


def test_the_shipped_defaults_are_what_calibrate_measured_on_the_h200():
    """benchmarks/tuning_h200.json: ``python -m dsv2_lib calibrate`` on an H200. The engine's defaults must
    be those thresholds (a default changed without measuring, or a rule changed, fails here)."""
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "tuning_h200.json"
    record = json.loads(path.read_text())
    assert record["gpu"] == "NVIDIA H200" and load_tuning(path) == Tuning()
    m = record["measured"]
    # the file's tuning follows from its timings (a file from before the skinny GEMM or the one-launch router
    # keeps that default)
    assert choose(m["moe"], m["attention"], m["gemv"], skinny_rows=m.get("skinny"),
                  router_rows=m.get("router", ())) == Tuning()


def test_the_engine_takes_a_loaded_tuning(tmp_path):
    t = Tuning(moe=MoETuning(gemv_max_tokens=1), gemv_max_tokens=1)
    llm = LLM("tiny", device="cpu", tuning=load_tuning(save_tuning(t, tmp_path / "t.json")))
    assert llm.engine_config.tuning == t


# ---- the command line ------------------------------------------------------------------------------------

def run(*args):
    return subprocess.run([sys.executable, "-m", "dsv2_lib", *args], capture_output=True, text=True, timeout=120)


def test_the_command_line_takes_a_tuning_file_and_names_a_bad_one(tmp_path):
    good = save_tuning(dataclasses.replace(Tuning(), gemv_max_tokens=1), tmp_path / "good.json")
    r = run("generate", "--device", "cpu", "--max-tokens", "3", "--tuning", str(good), "hi")
    assert r.returncode == 0 and r.stdout.startswith("hi"), r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"tuning": {"moe": {"gemv_max_tokens": -1.0}}}))
    for argv in (["generate", "--device", "cpu", "hi"], ["bench", "--model", "tiny", "--device", "cpu"],
                 ["serve", "--device", "cpu", "--port", "1"]):
        r = run(*argv, "--tuning", str(bad))
        assert r.returncode == 2 and "tuning.moe.gemv_max_tokens: expected int, got -1.0" in r.stderr, (argv, r.stderr)
        assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1


def test_calibrate_needs_a_gpu_and_says_so_in_one_line(tmp_path):
    import torch

    r = run("calibrate", "--device", "cpu", "--out", str(tmp_path / "t.json"))
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr
    if not torch.cuda.is_available():
        r = run("calibrate", "--out", str(tmp_path / "t.json"))
        assert r.returncode == 2 and "PyTorch sees no CUDA GPU" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "t.json").exists()
    r = run("calibrate", "--out", str(tmp_path / "no" / "t.json"))  # checked before the GPU is: any machine
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_rotated_fills_the_rotation_bytes_with_fresh_copies():
    """Enough copies that calls reading them in turn exceed ROTATE_BYTES (at least one), each a new tensor."""
    made = []

    def make():
        made.append(torch.zeros(1))
        return made[-1]

    assert len(benchmark.rotated(make, benchmark.ROTATE_BYTES // 3 + 1)) == 3
    assert len(benchmark.rotated(make, 2 * benchmark.ROTATE_BYTES)) == 1
    copies = benchmark.rotated(make, benchmark.ROTATE_BYTES // 4)
    assert len(copies) == 4 and all(c is m for c, m in zip(copies, made[-4:]))
