"""The committed GPU validation report is fresh and green (see gate/gpu_validation.py)."""
import json

import pytest
from gpu_validation import PARTS, REPORT, part_ok, sanitized_sources, sources_hash


def test_report_matches_current_kernel_sources():
    report = json.loads(REPORT.read_text())
    assert report["sources_sha256"] == sources_hash(), (
        "kernels_cu/ or an engine module the GPU tests import changed since the last GPU validation: run "
        "`python gate/gpu_validation.py tests` on the GPU machine (and memcheck and racecheck if the next test "
        "fails too) and commit gate/gpu_validation_report.json"
    )


def test_sanitizer_parts_match_current_kernel_path():
    report = json.loads(REPORT.read_text())
    assert report["sanitized_sha256"] == sources_hash(sanitized_sources()), (
        "kernels_cu/ or the code that checks and launches kernels (dsv2_lib/core, dsv2_lib/ops, a module that "
        "declares or launches one) changed since the last sanitizer run: run `python gate/gpu_validation.py "
        "memcheck` and `... racecheck` on the GPU machine and commit gate/gpu_validation_report.json"
    )


@pytest.mark.parametrize("part", PARTS)
def test_report_is_green(part):
    report = json.loads(REPORT.read_text())
    assert "H200" in report["gpu"] or "NVIDIA" in report["gpu"]
    assert part_ok(report, part), (
        f"the GPU gate's part {part!r} is missing, failed or ran out of time in {REPORT.name}: "
        f"run `python gate/gpu_validation.py {part}` on the GPU machine")
