"""The GPU validation gate: run on the GPU machine after any change to code that the GPU tests run.

    python gate/gpu_validation.py tests        # part 1: pytest -m gpu (~3 min on the H200)
    python gate/gpu_validation.py memcheck     # part 2: compute-sanitizer memcheck over the kernel tests
    python gate/gpu_validation.py racecheck    # part 3: compute-sanitizer racecheck (~5 min)
    python gate/gpu_validation.py              # all three, one after the other

Each part fits one 10-minute call on the GPU machine and writes its section of
gate/gpu_validation_report.json; a section written for other sources (those its hash covers, below)
is dropped, so the report is complete only when every part ran on the sources being committed.

1. ``tests``: ``pytest -m gpu`` (every GPU test: kernels against references, full-size parity);
2. and 3. ``memcheck`` and ``racecheck``: ``compute-sanitizer --tool memcheck`` over the kernel tests
   (``tests/test_*_gpu.py``), and ``--tool racecheck`` over those of kernels that use shared memory,
   with PyTorch's caching allocator off so that every tensor is its own allocation and an
   out-of-bounds access is caught at the tensor's edge (tests marked ``cuda_graph`` are left out
   there: capture cannot allocate without the caching allocator; so are tests marked ``heavy``, the
   large sizes, which the sanitizers slow down 10-100 times — the same code paths run there at small
   sizes); each tool's tests are dealt into ``SHARDS`` processes (fewer on a GPU with less memory:
   ``shard_count``) that run side by side, balanced by
   each test's time in the last run (``gate/sanitizer_seconds.json``, rewritten by each run); racecheck
   leaves out ``large_reference`` tests and runs at most ``RACECHECK_PER_TEST`` parametrizations of
   each test function (see ``spread``); only our kernels' errors count (see ``MEMCHECK_SKIP`` and
   ``RACECHECK_SKIP``). The parts do not share the GPU: measured on the H200, the full-size tests
   (~100 GB) beside 14 sanitizer processes ran the sanitized tests out of memory and both out of time;
3. a report with the GPU, versions, dates, pass/fail counts, sanitizer error counts and two hashes:
   of ``kernels_cu/`` and every engine module the GPU tests import (``kernel_sources``), for the
   tests part, and of the kernel path alone (``sanitized_sources``: ``kernels_cu/``, ``dsv2_lib/core``,
   ``dsv2_lib/ops`` and any module that declares or launches a kernel), for the sanitizer parts, which
   only kernels and the code that checks and launches them can change. ``tests/test_gpu_report.py``
   (CPU, in CI) fails when a part's hash no longer matches the sources or a part is missing, so no
   change that a GPU test runs lands without a GPU run, and a kernel change not without the sanitizers
   (a change to the model or engine alone needs the tests part only). Every process has a time limit and streams its log to ``$OUT/gate_logs`` (default
   /tmp/gate_logs), so a run cut short still leaves its evidence.
"""
from __future__ import annotations

import concurrent.futures
import datetime
import hashlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the repository's dsv2_lib
from dsv2_lib.tools.layer_map import imported_modules  # noqa: E402

SANITIZER_TIMEOUT_S = 500  # per process; a run that needs longer fails the gate instead of hanging the machine
GPU_TESTS_TIMEOUT_S = 540
PARTS = ("tests", "memcheck", "racecheck")
REPORT = ROOT / "gate" / "gpu_validation_report.json"
SECONDS = ROOT / "gate" / "sanitizer_seconds.json"  # each sanitized test's seconds in its last run, per tool


def gpu_test_files() -> list[Path]:
    """The test files that hold GPU tests (a ``pytest.mark.gpu`` in them)."""
    return sorted(p for p in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())


def _module_file(name: str) -> Path | None:
    """The source file of module ``name`` inside the repository (a package's ``__init__.py``)."""
    base = ROOT.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def gpu_tested_modules() -> list[Path]:
    """Every ``dsv2_lib`` module that the GPU tests import, directly or through other modules (an
    import of ``dsv2_lib.x`` also runs the packages above it): the engine code a GPU run exercises."""
    todo = set().union(*(imported_modules(p, None) for p in gpu_test_files()))
    seen: dict[str, Path] = {}
    while todo:
        name = todo.pop()
        parts = name.split(".")
        todo |= {".".join(parts[:i]) for i in range(1, len(parts))} - seen.keys()
        path = _module_file(name)
        if name in seen or path is None:
            continue
        seen[name] = path
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        todo |= imported_modules(path, package) - seen.keys()
    return sorted(set(seen.values()))


def kernel_files() -> list[Path]:
    """The CUDA C sources: every ``.cu`` and ``.cuh`` under kernels_cu/."""
    return sorted(p for p in (ROOT / "kernels_cu").rglob("*") if p.suffix in (".cu", ".cuh"))


def kernel_sources() -> list[Path]:
    """What a GPU gate run validates: kernels_cu/ and every engine module the GPU tests import (the
    kernel wrappers, and the model, cache, scheduler and engine loop that the full-size tests run)."""
    return kernel_files() + gpu_tested_modules()


LAUNCHES = re.compile(r"\b(?:declare|launch|RawModule|RawKernel)\(")  # a module on the kernel path


def sanitized_sources() -> list[Path]:
    """What the sanitizer parts validate: kernels_cu/, and of the modules the GPU tests import those on
    the kernel path: ``dsv2_lib/core`` (loading, launch), ``dsv2_lib/ops`` (the wrappers that check inputs
    and set grids) and any other module that declares or launches a kernel (the lessons' kernels)."""
    core_ops = (ROOT / "dsv2_lib" / "core", ROOT / "dsv2_lib" / "ops")
    return kernel_files() + [p for p in gpu_tested_modules()
                 if any(d in p.parents for d in core_ops) or LAUNCHES.search(p.read_text())]


def sources_hash(paths: list[Path] | None = None) -> str:
    """SHA-256 of ``paths`` (default: :func:`kernel_sources`), names and contents."""
    h = hashlib.sha256()
    for p in kernel_sources() if paths is None else paths:
        h.update(p.relative_to(ROOT).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def run_pytest(args: list[str], junit: Path, log: Path, prefix: list[str] = (), env=None,
               timeout: float | None = None) -> tuple[dict, str]:
    """Run pytest (optionally under ``prefix``, e.g. compute-sanitizer), its output streamed to ``log``
    (so a run cut short still leaves its log); (counts from its junit file, the log's text). A run
    past ``timeout`` seconds is killed and reported with ``"timed_out": True``."""
    cmd = [*prefix, sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-q",
           f"--junitxml={junit}", *args]
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "timed_out": False}
    with open(log, "w") as f:
        # its own process group: on timeout, the sanitizer and the pytest it started both go
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            counts["timed_out"] = True
            f.write(f"\n--- killed after {timeout} s\n")
    if junit.is_file():
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        total = int(suite.get("tests"))
        counts.update(failed=int(suite.get("failures")), errors=int(suite.get("errors")),
                      skipped=int(suite.get("skipped")))
        counts["passed"] = total - counts["failed"] - counts["errors"] - counts["skipped"]
    return counts, log.read_text(errors="replace")


SANITIZER_MARKERS = "gpu and not cuda_graph and not heavy"
RACECHECK_MARKERS = SANITIZER_MARKERS + " and not large_reference"
RACECHECK_PER_TEST = 4  # racecheck must instrument cuBLAS too (below): ~5-10 s per test there
# Processes per tool. The sanitizers are bound by the host's cores (16 on the H200 machine), so the tools
# run one at a time, each with all of them (side by side, 6 + 8 processes, racecheck's slowest process
# needed more than its 500 s). Tests are dealt by their seconds in the last run (``deal``).
SHARDS = {"memcheck": 12, "racecheck": 14}
# GPU memory each sanitized process may need at once (GiB): memcheck runs the kernel tests at full size
# without the caching allocator, and processes' peaks can coincide. On an 80 GB H100, 12 shards ran out
# of memory (32 tests failed, 44 errored), and so did 7 (25 failed, 17 errored), 5 (3 failed), 3 (8 failed:
# the V2-Lite-sized MoE layers beside the 4,096-token RoPE tests) and 2 (1 failed); 1 ran clean in 215 s.
# At 40 GiB each, 3 run on the H200 and 1 on the H100. racecheck's 14 ran clean on the H100, so its
# figure only has to keep them there.
# A smaller GPU gets fewer, longer shards (``shard_count``).
SHARD_GIB = {"memcheck": 40, "racecheck": 5}
# memcheck does not instrument these kernels (they still run): PyTorch's own (ATen), cuBLAS/CUTLASS and
# cuDNN. That keeps its runs minutes long. racecheck cannot skip them: excluding a cuBLAS kernel from
# racecheck crashes it ("Internal Sanitizer Error: failed to handle a hardware exception", measured on
# the H200 with compute-sanitizer of CUDA 13), so racecheck runs everything except cuDNN and the gate
# counts only the hazards it reports in our kernels (cuBLAS's and cuDNN's Hopper kernels write shared
# memory through TMA, which racecheck reports as races).
MEMCHECK_SKIP = ["--kernel-name-exclude", "regex=at6native|cudnn|cutlass|xmma|nvjet|cublas"]
RACECHECK_SKIP = ["--kernel-name-exclude", "kns=cudnn"]
RACE = re.compile(r"(Error|Warning): Race reported between \w+ access at (.+?)\+0x[0-9a-f]+[ \t]*\n=+\s+"
                  r"and \w+ access at (.+?)\+0x[0-9a-f]+")


def our_kernels() -> set[str]:
    """The names of every ``__global__`` function in kernels_cu/."""
    names = set()
    for cu in kernel_files():
        names |= set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s+)?(\w+)\s*\(",
                                cu.read_text()))  # launch bounds may call a constexpr function: f(x)
    return names


def sanitizer_errors(tool: str, log: str, ours: set[str]) -> dict:
    """Errors in one sanitizer log: memcheck's own count; for racecheck the race errors in our kernels
    (a race between two kernels' names counts if either is ours), with those in other kernels counted
    apart; any internal sanitizer error counts as an error. ``None`` where the run printed no summary."""
    internal = log.count("Internal Sanitizer Error")
    if tool == "memcheck":
        m = re.findall(r"ERROR SUMMARY: (\d+) error", log)
        return {"errors": sum(map(int, m)) + internal if m else None}
    if "RACECHECK SUMMARY" not in log:
        return {"errors": None, "other_kernels_races": None}
    is_ours = lambda name: any(k in name for k in ours)  # noqa: E731 (mangled or demangled names)
    races = [(a, b) for level, a, b in RACE.findall(log) if level == "Error"]
    mine = sum(1 for a, b in races if is_ours(a) or is_ours(b))
    return {"errors": mine + internal, "other_kernels_races": len(races) - mine}


def collect(tests: list[str], markers: str) -> list[str]:
    """The ids of the tests in ``tests`` selected by ``markers`` (pytest's collection, no GPU needed)."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-q",
                        "--collect-only", "-m", markers, *tests], cwd=ROOT, capture_output=True, text=True)
    return [line for line in r.stdout.splitlines() if "::" in line]


def spread(test_ids: list[str], per_test: int) -> list[str]:
    """At most ``per_test`` parametrizations of each test function, evenly spaced over the order
    pytest collected them in (first and last included), so every test function runs and its
    parameter grid is sampled from end to end (``per_test`` >= 2)."""
    groups: dict[str, list[str]] = {}
    for i in test_ids:
        groups.setdefault(i.split("[")[0], []).append(i)
    out = []
    for ids in groups.values():
        n = len(ids)
        picks = sorted({round(k * (n - 1) / (per_test - 1)) for k in range(per_test)}) if n > per_test else range(n)
        out += [ids[k] for k in picks]
    return out


def deal(test_ids: list[str], n: int, seconds: dict[str, float]) -> list[list[str]]:
    """``test_ids`` into at most ``n`` shards of about equal time: the longest first, each to the shard
    with the least time so far (``seconds``: each test's time in the last run; a test not timed before
    counts as the median of those that were, 10 s if none); each shard in collection order."""
    known = [seconds[i] for i in test_ids if i in seconds]
    guess = statistics.median(known) if known else 10.0
    order = {i: k for k, i in enumerate(test_ids)}
    shards, load = [[] for _ in range(n)], [0.0] * n
    for i in sorted(test_ids, key=lambda i: (-seconds.get(i, guess), order[i])):
        s = min(range(n), key=load.__getitem__)
        shards[s].append(i)
        load[s] += seconds.get(i, guess)
    return [sorted(s, key=order.__getitem__) for s in shards if s]


def junit_seconds(junit: Path) -> dict[str, float]:
    """Each test's seconds (setup, call and teardown) in a junit file, by pytest id ``tests/x.py::name``."""
    if not junit.is_file():
        return {}
    return {f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}": float(case.get("time"))
            for case in ET.parse(junit).getroot().iter("testcase")}


def sanitizer(tool: str, test_ids: list[str], xml: Path, log: Path, ours: set[str]) -> tuple[dict, str]:
    """``test_ids`` under ``compute-sanitizer --tool tool``: ({"tests": counts, "errors": ..., "unreported": n},
    log), ``n`` the tests its junit file does not account for (all of them when the process died before
    writing it)."""
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", DSV2_BACKEND="cuda")
    prefix = ["compute-sanitizer", f"--tool={tool}", "--target-processes=all", "--error-exitcode=0",
              *(MEMCHECK_SKIP if tool == "memcheck" else RACECHECK_SKIP)]
    counts, text = run_pytest(test_ids, xml, log, prefix, env, timeout=SANITIZER_TIMEOUT_S)
    reported = sum(counts[k] for k in ("passed", "failed", "skipped", "errors"))
    return {"tests": counts, **sanitizer_errors(tool, text, ours), "unreported": len(test_ids) - reported}, text


def summed(runs: list[dict]) -> dict:
    """Per-shard sanitizer results -> one: counts summed (an error count is None if any shard reported none)."""
    tests = {k: sum(r["tests"][k] for r in runs) for k in ("passed", "failed", "skipped", "errors")}
    tests["timed_out"] = any(r["tests"]["timed_out"] for r in runs)
    out = {"tests": tests}
    for key in runs[0].keys() - {"tests"}:
        values = [r[key] for r in runs]
        out[key] = None if None in values else sum(values)
    return out


def shared_memory_tests(kernel_tests: list[str]) -> list[str]:
    """The kernel tests (``tests/test_<op>_gpu.py``) whose kernel (``kernels_cu/<op>.cu``) uses shared
    memory, directly or through ``block_sum``: racecheck only finds races there, and is slow."""
    def uses_shared(test: str) -> bool:
        cu = ROOT / "kernels_cu" / (Path(test).stem.removeprefix("test_").removesuffix("_gpu") + ".cu")
        return not cu.is_file() or any(k in cu.read_text() for k in ("__shared__", "block_sum"))
    return [t for t in kernel_tests if uses_shared(t)]


def shard_count(tool: str, gpu_gib: float) -> int:
    """Processes for ``tool`` on a GPU of ``gpu_gib`` GiB: ``SHARDS[tool]``, fewer where their memory
    (``SHARD_GIB[tool]`` each) would not fit; at least one."""
    return max(1, min(SHARDS[tool], int(gpu_gib // SHARD_GIB[tool])))


def run_tests(out_dir: Path, xml_dir: Path) -> dict:
    """Part 1: every GPU test."""
    gpu, _ = run_pytest(["-m", "gpu", "--durations=30", "tests"], xml_dir / "gpu.xml", out_dir / "gpu_tests.log",
                        timeout=GPU_TESTS_TIMEOUT_S)
    return {"gpu_tests": gpu}


def run_sanitizer(tool: str, out_dir: Path, xml_dir: Path) -> dict:
    """Part 2 or 3: the tool's tests dealt by their last run's seconds (``deal``) into ``shard_count``
    processes, side by side; each test's seconds in this run are written back to ``SECONDS``."""
    kernel_tests = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*_gpu.py"))
    if tool == "memcheck":
        ids, selection = collect(kernel_tests, SANITIZER_MARKERS), {"kernel_tests": kernel_tests}
    else:
        racecheck_tests = shared_memory_tests(kernel_tests)
        ids = spread(collect(racecheck_tests, RACECHECK_MARKERS), RACECHECK_PER_TEST)
        selection = {"racecheck_tests": racecheck_tests, "racecheck_per_test": RACECHECK_PER_TEST}
    timed = json.loads(SECONDS.read_text()) if SECONDS.is_file() else {}
    import torch

    gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    shards = deal(ids, shard_count(tool, gpu_gib), timed.get(tool, {}))
    ours = our_kernels()
    with concurrent.futures.ThreadPoolExecutor(len(shards)) as pool:
        runs = [pool.submit(sanitizer, tool, shard, xml_dir / f"{tool}{i}.xml", out_dir / f"{tool}{i}.log", ours)
                for i, shard in enumerate(shards)]
        results = [r.result() for r in runs]
    counts = [c for c, _ in results]
    for i, (c, text) in enumerate(results):  # a shard that died says so here: its log may not come back
        if c["errors"] is None or c["unreported"]:
            tail = "\n".join(text.splitlines()[-20:])
            print(f"{tool} shard {i}: {len(shards[i])} tests, {c['unreported']} not in its junit file, "
                  f"{'no' if c['errors'] is None else 'a'} sanitizer summary; its log ends:\n{tail}")
    for i in range(len(shards)):
        timed.setdefault(tool, {}).update(junit_seconds(xml_dir / f"{tool}{i}.xml"))
    SECONDS.write_text(json.dumps(timed, indent=1, sort_keys=True) + "\n")
    return {**selection, tool: summed(counts)}


def part_ok(report: dict, part: str) -> bool:
    """Whether ``part`` of the report ran and is clean."""
    if part == "tests":
        gpu = report.get("gpu_tests")
        return bool(gpu) and gpu["failed"] == gpu["errors"] == 0 and gpu["passed"] > 0 and not gpu.get("timed_out")
    run = report.get(part)
    return bool(run) and run["errors"] == 0 and run["tests"]["failed"] == 0 and run["tests"]["passed"] > 0 \
        and not run["tests"].get("timed_out") and not run.get("unreported")


PART_KEYS = {"tests": ("gpu_tests",), "memcheck": ("kernel_tests", "memcheck"),
             "racecheck": ("racecheck_tests", "racecheck_per_test", "racecheck")}  # each part's sections
PART_HASH = {"tests": "sources_sha256", "memcheck": "sanitized_sha256", "racecheck": "sanitized_sha256"}


def merged(old: dict, part: str, results: dict, env: dict) -> dict:
    """The report after ``part`` ran: another part's sections are kept only if the hash that part
    answers to (``PART_HASH``) is the same now as when it ran."""
    report = dict(env)
    for other in PARTS:
        if other != part and old.get(PART_HASH[other]) == env[PART_HASH[other]] and other in old.get("dates", {}):
            report.update({k: old[k] for k in PART_KEYS[other] if k in old})
            report.setdefault("dates", {})[other] = old["dates"][other]
    report.update(results)
    report.setdefault("dates", {})[part] = env["date"]
    return report


def main(parts: list[str]) -> int:
    import cupy
    import torch

    if not parts or any(p not in PARTS for p in parts):
        sys.exit(f"usage: gpu_validation.py [{'|'.join(PARTS)}]...; got {parts}")
    out_dir = Path(os.environ.get("OUT", "/tmp")) / "gate_logs"
    out_dir.mkdir(parents=True, exist_ok=True)
    xml_dir = Path(tempfile.mkdtemp())  # junit files
    for part in parts:
        results = run_tests(out_dir, xml_dir) if part == "tests" else run_sanitizer(part, out_dir, xml_dir)
        env = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(),
            "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                         "cupy": cupy.__version__, "driver": cupy.cuda.runtime.driverGetVersion()},
            "sources": [str(p.relative_to(ROOT)) for p in kernel_sources()],
            "sources_sha256": sources_hash(),
            "sanitized_sha256": sources_hash(sanitized_sources()),
        }
        old = json.loads(REPORT.read_text()) if REPORT.is_file() else {}
        report = merged(old, part, results, env)
        REPORT.write_text(json.dumps(report, indent=2) + "\n")
        print(part, "clean" if part_ok(report, part) else "NOT clean", json.dumps(results, indent=2))
    return 0 if all(part_ok(report, p) for p in parts) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(PARTS)))
