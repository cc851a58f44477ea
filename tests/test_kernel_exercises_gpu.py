"""The kernel exercises cannot rot: each chapter's hidden CUDA solution compiles (on any machine with
nvcc) and, on a GPU, matches the reference on every case, while planted wrong kernels fail with a
line that names the case and what differs."""
import shutil

import pytest
import torch
from notebook_solutions import solutions

from dsv2_lib.lessons.kernel_exercises import KERNEL_EXERCISES, grade_kernel

gpu = pytest.mark.gpu


SOLUTIONS = solutions("check_kernel")


def wrong(name: str, old: str, new: str) -> str:
    source = SOLUTIONS[name][1]
    assert old in source, f"{name}: the planted change no longer applies to the solution"
    return source.replace(old, new)


def test_every_kernel_exercise_has_a_solution_in_its_chapter():
    assert set(SOLUTIONS) == set(KERNEL_EXERCISES)
    for name, (chapter, _) in SOLUTIONS.items():
        assert chapter.startswith(KERNEL_EXERCISES[name].chapter + "_"), f"{name}: solution in {chapter}"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
@pytest.mark.parametrize("name", sorted(KERNEL_EXERCISES))
def test_without_a_gpu_the_solution_compiles_and_a_typo_does_not(name, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    passed, line = grade_kernel(name, SOLUTIONS[name][1])
    assert passed is None and "compiles for sm_90" in line, line
    passed, line = grade_kernel(name, wrong(name, "threadIdx.x", "threadIdx.q"))
    assert passed is False and line.startswith(f"✗ {name}: does not compile: line ") and 'no member "q"' in line, line


def test_the_combine_reference_sums_the_picks_through_their_slots():
    """Chapter 08's spec on a case by hand: token 0's second pick was dropped (slot -1), token 1's picks
    read sorted rows 0 and 3 with their own weights."""
    y = torch.tensor([[1.0], [10.0], [100.0], [1000.0]])
    weights = torch.tensor([[0.5, 9.0], [2.0, 0.25]])
    slot_of = torch.tensor([2, -1, 0, 3], dtype=torch.int32)
    assert torch.equal(KERNEL_EXERCISES["combine_kernel"].reference(y, weights, slot_of), torch.tensor([[50.0], [252.0]]))


@gpu
@pytest.mark.parametrize("name", sorted(KERNEL_EXERCISES))
def test_the_solution_passes_on_the_gpu(name):
    passed, line = grade_kernel(name, SOLUTIONS[name][1])
    assert passed is True and line.startswith(f"✓ {name}: all "), line


@gpu
@pytest.mark.parametrize("name, old, new, says", [
    ("embedding_kernel", "weight[id * hidden + c]", "weight[t * hidden + c]", "case 2 of 5 (ids [3] into weight"),
    ("embedding_kernel", "id = ids[t]", "id = ids[0]", "case 2 of 5"),  # every token gets the first id's row
    ("rms_norm_kernel", "partial[0] / cols + eps", "partial[0] / cols", "case 6 of 6 (x [2, 64] float32 of zeros"),
    ("rms_norm_kernel", "row[c] * scale * weight[c]", "row[c] * scale", "expected"),  # weight forgotten
    ("rms_norm_kernel", "partial[0] / cols", "partial[0] / blockDim.x", "case 1 of 6 (x [1, 1] float32"),  # wrong mean
    ("silu_and_mul_kernel", "gate / (1.f + expf(-gate)) * up", "gate * up", "case 1 of 5 (x [1, 2] float32)"),
    ("silu_and_mul_kernel", "x[r * 2 * inter + inter + c]", "x[r * 2 * inter + c]", "expected"),  # up = gate
    ("combine_kernel", "weights[t * k + j]", "weights[j]", "case 2 of 5 (T 3, k 2"),  # token 0's weights for all
    ("combine_kernel", "acc += weights", "acc = weights", "case 2 of 5"),  # only the last pick kept
    ("combine_kernel", "y[(long long)slot * hidden + c]", "y[(t * k + j) * hidden + c]", "case 2 of 5"),  # unsorted
])
def test_a_wrong_kernel_fails_with_the_case_and_the_element(name, old, new, says):
    """Every planted mistake stays inside the buffers: a kernel that reads past them would be caught by
    compute-sanitizer as an error of the test, not of the reader."""
    passed, line = grade_kernel(name, wrong(name, old, new))
    assert passed is False and line.startswith(f"✗ {name}, case ") and says in line and "got" in line, line


@gpu
def test_an_element_no_thread_stores_is_named():
    """The launch fills out with NaN: the last element, skipped by a bound one too tight, is reported as never
    stored, not compared with whatever the memory held (nothing is read or written out of bounds)."""
    source = wrong("silu_and_mul_kernel", "if (i >= (long long)rows * inter) return;",
                   "if (i >= (long long)rows * inter - 1) return;")
    passed, line = grade_kernel("silu_and_mul_kernel", source)
    assert passed is False and "out[0, 0] was never stored (1 of 1 elements" in line, line


@gpu
def test_a_kernel_of_another_name_is_named_in_the_answer():
    passed, line = grade_kernel("rms_norm_kernel", wrong("rms_norm_kernel", "void rms_norm(", "void my_norm("))
    assert passed is False and "no kernel named 'rms_norm'" in line, line
