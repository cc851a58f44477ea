"""The committed GPU validation report is fresh and green (see tests/gpu_validation.py)."""
import json

from gpu_validation import REPORT, sources_hash


def test_report_matches_current_kernel_sources():
    report = json.loads(REPORT.read_text())
    assert report["sources_sha256"] == sources_hash(), (
        "kernels_cu/ or a kernel wrapper changed since the last GPU validation: run "
        "`python tests/gpu_validation.py` on the GPU machine and commit tests/gpu_validation_report.json"
    )


def test_report_is_green():
    report = json.loads(REPORT.read_text())
    assert "H200" in report["gpu"] or "NVIDIA" in report["gpu"]
    assert report["gpu_tests"]["passed"] > 0 and report["gpu_tests"]["failed"] == report["gpu_tests"]["errors"] == 0
    for tool in ("memcheck", "racecheck"):
        assert report[tool]["errors"] == 0 and report[tool]["tests"]["failed"] == 0, tool
        assert not report[tool]["tests"].get("timed_out"), f"{tool} ran out of time"
        assert report[tool]["tests"]["passed"] > 0, f"{tool} ran no kernel test"
