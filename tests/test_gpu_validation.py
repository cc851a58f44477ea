"""The GPU gate's bookkeeping, on the CPU: which kernels are ours, which sanitizer errors count."""
from gpu_validation import (
    PARTS,
    SANITIZER_MARKERS,
    SHARDS,
    collect,
    deal,
    junit_seconds,
    merged,
    our_kernels,
    part_ok,
    sanitizer_errors,
    shard_count,
    spread,
    summed,
)

VENDOR_RACE = """\
....========= Error: Race reported between Read access at nvjet_sm90_hsh_64x8_64x16_4x1_v_bz_TNT+0xb00
=========     and Write access at nvjet_sm90_hsh_64x8_64x16_4x1_v_bz_TNT+0x2820 [176 hazards]
=========
"""
OUR_RACE = """\
========= Error: Race reported between Write access at void mla_decode_split<__nv_bfloat16, 512, 64, 2, false>(float *)+0x1f0
=========     and Read access at void mla_decode_split<__nv_bfloat16, 512, 64, 2, false>(float *)+0x2a0 [32 hazards]
=========
========= Warning: Race reported between Read access at rms_norm_kernel+0x10
=========     and Write access at rms_norm_kernel+0x20 [2 hazards]
"""
SUMMARY = "========= RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warnings)\n"


def test_our_kernels_are_found_in_kernels_cu():
    ours = our_kernels()
    assert {"mla_decode_split", "mla_decode_combine", "mla_decode_balanced", "write_cache_rows", "topk_softmax",
            "moe_align", "linear_gemv"} <= ours
    assert not any(n.startswith("nvjet") or "cudnn" in n for n in ours)


def test_racecheck_counts_only_races_in_our_kernels():
    ours = {"mla_decode_split", "rms_norm_kernel"}
    assert sanitizer_errors("racecheck", VENDOR_RACE + SUMMARY, ours) == {"errors": 0, "other_kernels_races": 1}
    # the warning is not an error; our error is
    assert sanitizer_errors("racecheck", VENDOR_RACE + OUR_RACE + SUMMARY, ours) == {"errors": 1, "other_kernels_races": 1}


def test_a_crashed_or_cut_run_is_never_clean():
    crash = "========= Internal Sanitizer Error: The Sanitizer failed to handle a hardware exception.\n" + SUMMARY
    assert sanitizer_errors("racecheck", crash, set())["errors"] == 1
    assert sanitizer_errors("racecheck", "....", set())["errors"] is None  # killed before its summary
    assert sanitizer_errors("memcheck", "....", set())["errors"] is None
    assert sanitizer_errors("memcheck", "========= ERROR SUMMARY: 0 errors\n", set())["errors"] == 0
    assert sanitizer_errors("memcheck", "========= ERROR SUMMARY: 2 errors\n" + crash, set())["errors"] == 3


def test_shards_are_summed_and_a_missing_count_stays_missing():
    def shard(passed, errors, timed_out=False):
        return {"tests": {"passed": passed, "failed": 0, "skipped": 0, "errors": 0, "timed_out": timed_out},
                "errors": errors, "other_kernels_races": 0}
    total = summed([shard(3, 0), shard(4, 1)])
    assert total["tests"]["passed"] == 7 and total["errors"] == 1 and not total["tests"]["timed_out"]
    assert summed([shard(3, 0), shard(0, None, timed_out=True)])["errors"] is None


def test_tests_a_dead_shard_never_reported_keep_the_part_unclean():
    """A shard whose process died before writing its junit file counts none of its tests: the summed
    counts can look clean (no failure, no error) while 14 tests never ran; ``unreported`` says so."""
    def shard(passed, unreported):
        return {"tests": {"passed": passed, "failed": 0, "skipped": 0, "errors": 0, "timed_out": False},
                "errors": 0, "other_kernels_races": 0, "unreported": unreported}
    assert part_ok({"racecheck": summed([shard(174, 0), shard(0, 0)])}, "racecheck")
    lost = summed([shard(174, 0), shard(0, 14)])
    assert lost["unreported"] == 14 and lost["tests"]["failed"] == 0 and lost["errors"] == 0
    assert not part_ok({"racecheck": lost}, "racecheck")


def test_collect_lists_the_sanitizer_tests_without_a_gpu():
    ids = collect(["tests/test_cache_write_gpu.py"], SANITIZER_MARKERS)
    assert ids and all(i.startswith("tests/test_cache_write_gpu.py::") for i in ids)
    assert not any("cuda_graph" in i for i in ids)  # the capture test is marked cuda_graph


def test_spread_samples_each_test_function_from_end_to_end():
    ids = [f"t.py::a[{k}]" for k in range(10)] + ["t.py::b[x]", "t.py::b[y]", "t.py::c"]
    picked = spread(ids, 4)
    assert picked[:4] == ["t.py::a[0]", "t.py::a[3]", "t.py::a[6]", "t.py::a[9]"]
    assert picked[4:] == ["t.py::b[x]", "t.py::b[y]", "t.py::c"]  # functions with few cases keep them all
    assert spread(ids, 2)[:2] == ["t.py::a[0]", "t.py::a[9]"]


def _env(sha, sanitized=None):
    return {"date": "d", "gpu": "NVIDIA H200", "versions": {}, "sources": [], "sources_sha256": sha,
            "sanitized_sha256": sha if sanitized is None else sanitized}


CLEAN = {"tests": {"passed": 5, "failed": 0, "skipped": 0, "errors": 0, "timed_out": False}, "errors": 0}


def test_parts_merge_only_on_the_same_sources():
    tests = {"gpu_tests": {"passed": 9, "failed": 0, "skipped": 0, "errors": 0, "timed_out": False}}
    report = merged(merged({}, "tests", tests, _env("a")), "memcheck", {"memcheck": CLEAN}, _env("a"))
    report = merged(report, "racecheck", {"racecheck": CLEAN}, _env("a"))
    assert all(part_ok(report, p) for p in PARTS) and set(report["dates"]) == set(PARTS)
    # the sources changed between the parts: the earlier parts' results no longer count
    report = merged(report, "racecheck", {"racecheck": CLEAN}, _env("b"))
    assert not part_ok(report, "tests") and not part_ok(report, "memcheck") and part_ok(report, "racecheck")


def test_a_change_off_the_kernel_path_keeps_the_sanitizer_parts():
    """The engine or model changed, the kernels and their wrappers did not: the tests part must run
    again, the sanitizer parts still count; a change on the kernel path drops them."""
    tests = {"gpu_tests": {"passed": 9, "failed": 0, "skipped": 0, "errors": 0, "timed_out": False}}
    report = merged({}, "tests", tests, _env("a", "k"))
    report = merged(report, "memcheck", {"kernel_tests": ["t"], "memcheck": CLEAN}, _env("a", "k"))
    report = merged(report, "racecheck", {"racecheck": CLEAN}, _env("a", "k"))
    # a scheduler change: the next run of the tests part keeps both sanitizer sections
    after = merged(report, "tests", tests, _env("b", "k"))
    assert all(part_ok(after, p) for p in PARTS) and after["kernel_tests"] == ["t"]
    # ...but a sanitizer run on new sources drops the tests part run on the old ones
    stale = merged(report, "memcheck", {"memcheck": CLEAN}, _env("b", "k"))
    assert not part_ok(stale, "tests") and part_ok(stale, "racecheck")
    # a kernel change: both sanitizer sections go
    kernel = merged(report, "tests", tests, _env("c", "k2"))
    assert part_ok(kernel, "tests") and not part_ok(kernel, "memcheck") and not part_ok(kernel, "racecheck")


def test_the_sanitizers_answer_to_the_kernel_path_only():
    import gpu_validation as gv

    names = {p.relative_to(gv.ROOT).as_posix() for p in gv.sanitized_sources()}
    assert {"kernels_cu/mla_decode.cu", "dsv2_lib/ops/gemv.py", "dsv2_lib/core/kernels.py",
            "dsv2_lib/core/dependent_launch.py", "dsv2_lib/lessons/gemm.py", "dsv2_lib/lessons/kernel_exercises.py"} <= names
    assert not names & {"dsv2_lib/engine/scheduler.py", "dsv2_lib/engine/graph_runner.py", "dsv2_lib/model/moe.py",
                        "dsv2_lib/lessons/exercises.py"}
    assert names <= {p.relative_to(gv.ROOT).as_posix() for p in gv.kernel_sources()}


def test_a_part_that_timed_out_or_ran_nothing_is_not_ok():
    cut = {"gpu_tests": {"passed": 9, "failed": 0, "skipped": 0, "errors": 0, "timed_out": True}}
    assert not part_ok(merged({}, "tests", cut, _env("a")), "tests")
    empty = dict(CLEAN, tests=dict(CLEAN["tests"], passed=0))
    assert not part_ok({"memcheck": CLEAN, "racecheck": empty}, "racecheck")
    assert not part_ok({"memcheck": dict(CLEAN, errors=None), "racecheck": CLEAN}, "memcheck")
    assert not part_ok({"memcheck": CLEAN}, "racecheck")  # never ran
    cut = dict(CLEAN, tests=dict(CLEAN["tests"], timed_out=True))
    assert not part_ok({"racecheck": cut}, "racecheck")


def test_a_run_past_its_time_is_killed_with_everything_it_started(tmp_path):
    """The timeout kills the whole process group: here pytest runs as a grandchild, under a shell
    (as it runs under compute-sanitizer), and nothing of the group may outlive the kill. Nothing
    here depends on how fast the machine is: the shell records the group's id before pytest starts,
    and the group is checked whether or not pytest had reached the test when the kill came."""
    import os
    import time
    from pathlib import Path

    from gpu_validation import run_pytest

    group_file = tmp_path / "group"
    test = tmp_path / "test_sleeps.py"
    test.write_text("import time\n\ndef test_sleeps():\n    time.sleep(600)\n")
    counts, log = run_pytest([str(test)], tmp_path / "junit.xml", tmp_path / "log.txt",
                             prefix=["bash", "-c", f'echo $$ > {group_file}; "$@"; true', "--"], timeout=10)
    assert counts["timed_out"] and "killed after 10 s" in log
    group = int(group_file.read_text())  # the shell leads the new session, so its pid is the group id

    def alive_in_group() -> list[int]:
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()  # after "(comm)": state, ppid, pgrp, ...
            except OSError:
                continue  # a process that ended while we looked
            if int(fields[2]) == group and fields[0] not in "ZX":  # zombie or exiting: dead, not yet reaped
                found.append(int(stat.parent.name))
        return found

    # SIGKILL is delivered at once but a process takes a moment to go: wait for it, up to a bound so
    # generous that only a process the kill never reached can hit it
    deadline = time.monotonic() + 60
    while alive_in_group() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive_in_group(), "a process of the killed run outlived its timeout"
    assert os.getpgid(os.getpid()) != group  # the run had its own group: the kill could not reach us


def test_deal_balances_shards_by_the_last_run_and_keeps_the_order():
    ids = [f"tests/t.py::f[{i}]" for i in range(8)]
    seconds = dict(zip(ids, [1, 8, 2, 7, 3, 6, 4, 5]))
    shards = deal(ids, 2, seconds)
    assert sorted(i for s in shards for i in s) == sorted(ids)          # every test once
    assert all(s == sorted(s, key=ids.index) for s in shards)           # collection order inside a shard
    assert sorted(sum(seconds[i] for i in s) for s in shards) == [18, 18]  # round-robin would give 16 and 20
    new = ids + ["tests/t.py::g"]                                       # not timed before: the median, 4.5
    assert len(deal(new, 3, seconds)) == 3 and len(deal(ids[:2], 5, {})) == 2


def test_a_smaller_gpu_runs_fewer_sanitizer_processes():
    assert shard_count("memcheck", 139.8) == 3  # H200: 3 x 40 GiB
    assert shard_count("memcheck", 79.2) == 1  # H100: one process (two ran out of memory)
    assert shard_count("racecheck", 79.2) == SHARDS["racecheck"]
    assert shard_count("memcheck", 8) == 1


def test_junit_seconds_are_keyed_by_pytest_id(tmp_path):
    junit = tmp_path / "j.xml"
    junit.write_text('<testsuites><testsuite name="pytest" tests="2"><testcase classname="tests.test_moe_gpu" '
                     'name="test_a[x-1]" time="3.5"/><testcase classname="tests.test_rope_gpu" name="test_b" '
                     'time="0.25"/></testsuite></testsuites>')
    assert junit_seconds(junit) == {"tests/test_moe_gpu.py::test_a[x-1]": 3.5,
                                                   "tests/test_rope_gpu.py::test_b": 0.25}
    assert junit_seconds(tmp_path / "missing.xml") == {}


def test_the_hash_covers_every_engine_module_the_gpu_tests_import(tmp_path, monkeypatch):
    """Not only the kernel wrappers: the scheduler, block manager, graph runner and engine loop run in
    the full-size GPU tests, so a change to them needs a GPU run too. Modules no GPU test reaches stay out."""
    import gpu_validation as gv

    names = {p.relative_to(gv.ROOT).as_posix() for p in gv.kernel_sources()}
    assert {"kernels_cu/mla_decode.cu", "kernels_cu/common.cuh", "dsv2_lib/ops/mla_decode.py", "dsv2_lib/engine/scheduler.py",
            "dsv2_lib/engine/block_manager.py", "dsv2_lib/engine/graph_runner.py", "dsv2_lib/engine/llm.py", "dsv2_lib/__init__.py"} <= names
    assert "dsv2_lib/tools/train_tiny.py" not in names and "dsv2_lib/tools/show.py" not in names
    # the closure follows relative imports (from . import x, from .x import y, from .. import z)
    pkg = tmp_path / "dsv2_lib"
    (pkg / "sub").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    (tmp_path / "kernels_cu").mkdir()
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from . import b\nimport os\n")
    (pkg / "b.py").write_text("x = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import d\n")
    (pkg / "d.py").write_text("")
    (pkg / "unused.py").write_text("")
    (tmp_path / "tests" / "test_x_gpu.py").write_text("import pytest\npytestmark = pytest.mark.gpu\n"
                                                      "from dsv2_lib.sub.c import thing\n")
    (tmp_path / "tests" / "test_cpu.py").write_text("from dsv2_lib import unused\n")
    monkeypatch.setattr(gv, "ROOT", tmp_path)
    got = {p.relative_to(tmp_path).as_posix() for p in gv.gpu_tested_modules()}
    assert got == {"dsv2_lib/__init__.py", "dsv2_lib/a.py", "dsv2_lib/b.py", "dsv2_lib/sub/__init__.py",
                   "dsv2_lib/sub/c.py", "dsv2_lib/d.py"}
